"""The GPU paths, end to end: Transformer Engine layer spec, THD packed sequences, NCCL collectives (the
weight push in TP2/EP2/PP2, and by CUDA IPC to colocated engines), context parallelism over THD, FP8
training and rollout, official vLLM as the RL engine (one GPU, tensor-parallel over two, colocated and
asleep), MoE weight reload, resume under TE.

Marked ``gpu``: skipped where CUDA is missing (every CPU machine and CI here), run with
``scripts/gpu_check.sh`` (or ``pytest -m gpu``) on a GPU node. Every test asserts values, not "it ran".
What each `mars train` run here is configured with is in :data:`RUNS`, so ``tests/test_gpu_rules.py``
checks every one of those configs on CPU (the FP8 runs once died at the config check before reaching a
GPU). README, GPU status, says what has run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mars_megatron.models.presets import init_model
from tests.test_cli import TOKENS, hf_logprobs, mars, ok, read_logprobs, write_tokens

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
TE = ["model.transformer_impl=transformer_engine", "model.dtype=bfloat16"]
FP8 = ["parallel.moe_token_dispatcher=alltoall", "train.pack_length=1024"]  # MoE FP8 pads expert tokens
VLLM_ONE_GPU = ["rollout.engine=vllm", "pipeline.placement=colocated"]  # the rank and the engine share it
BASE_RUN = ["parallel.ep=1", "train.steps=2", "data.problems_per_step=4"]

RUNS: dict[str, tuple[int, list[str]]] = {
    "te_thd_nccl": (1, [*BASE_RUN, *TE]),
    **{f"fp8_{m}": (1, [*BASE_RUN, *TE, f"model.fp8={m}", *FP8]) for m in ("hybrid", "e4m3", "blockwise")},
    "vllm_fp8_rollout": (1, [*BASE_RUN, *VLLM_ONE_GPU, *TE, "model.fp8=hybrid", *FP8]),
    "vllm_colocated": (1, [*BASE_RUN, *VLLM_ONE_GPU, *TE]),
    "vllm_tp2_colocated": (2, [*BASE_RUN, "parallel.ep=2", *VLLM_ONE_GPU, "rollout.tp=2", *TE]),
    "vllm_bf16_mismatch": (1, [*BASE_RUN, *VLLM_ONE_GPU, *TE, "rollout.dtype=bfloat16", "train.steps=3"]),
    "te_resume": (1, [*BASE_RUN, *TE, "train.steps=4", "checkpoint.save_interval=2",
                      "checkpoint.save_dir={tmp}/ckpt"]),
}  # fmt: skip
"""name -> (GPUs it needs, overrides of examples/tiny_cpu.yaml) of every `mars train` run below; ``{tmp}``
stands for the test's own directory (:func:`run_overrides`)."""


def run_overrides(name: str, model: Path, tmp: Path) -> list[str]:
    """The whole command-line config of run ``name`` on ``model``, writing under ``tmp``."""
    return [f"model.hf_dir={model}", f"data.train_file={REPO / 'examples/data/arith_train.jsonl'}",
            f"logging.run_dir={tmp / 'run'}", *(o.format(tmp=tmp) for o in RUNS[name][1])]  # fmt: skip


MISMATCH_BOUND = 0.05
"""Mean |log p_trainer - log p_engine| per response token a bf16 vLLM engine may show against the bf16 TE
trainer on the same weights (both round to bf16; GPU RL stacks report ~1e-3 to 1e-2)."""


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, this node has {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("gpu") / "hf")


def test_transformer_engine_spec_scores_like_transformers(tiny: Path, tmp_path: Path) -> None:
    """TE layers (fused attention, grouped GEMM experts) on the GPU give HF's log-probs."""
    tokens = write_tokens(tmp_path / "tokens.jsonl", TOKENS)
    out = tmp_path / "te.jsonl"
    ok(mars("score", "--model-dir", tiny, "--input", tokens, "--output", out, "--impl", "transformer_engine",
            cwd=REPO))  # fmt: skip
    for got, ref in zip(read_logprobs(out), hf_logprobs(tiny, TOKENS), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-3)  # TF32 GEMMs on the GPU


def _train(model: Path, tmp: Path, name: str, *extra: str) -> list[dict]:
    """Run ``name`` of :data:`RUNS` (``extra`` overrides last); its metrics, one record per step."""
    _need_gpus(RUNS[name][0])
    ok(mars("train", REPO / "examples" / "tiny_cpu.yaml", *run_overrides(name, model, tmp), *extra, cwd=REPO))
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def test_rl_steps_with_te_thd_packing_and_nccl(tiny: Path, tmp_path: Path) -> None:
    """`mars train` on one GPU: TE spec, packed THD micro-batches, NCCL process group."""
    records = _train(tiny, tmp_path, "te_thd_nccl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/update_ok"] == 1.0 and r["train/grad_norm"] > 0 for r in records)


@pytest.mark.parametrize("mode", ["hybrid", "e4m3", "blockwise"])
def test_fp8_training_steps(tiny: Path, tmp_path: Path, mode: str) -> None:
    need = (9, 0) if mode == "blockwise" else (8, 9)
    if _capability() < need:
        pytest.skip(f"model.fp8={mode} needs compute capability {need}")
    records = _train(tiny, tmp_path, f"fp8_{mode}")
    assert all(r["train/update_ok"] == 1.0 and 0 < r["train/loss"] + 10 < 20 for r in records)


def test_te_spec_takes_the_local_specs_step(tiny: Path) -> None:
    """One RL step on the same packed samples with the TE spec (THD, fused attention, grouped GEMM) and
    the local spec (block-diagonal mask): the same loss and gradient norm within bf16 rounding."""
    from mars_megatron.training import parallel
    from tests.rl_workers import train_samples
    from tests.test_rl_train import BASE, SAMPLES

    runs = {}
    for impl in ("local", "transformer_engine"):
        overrides = [*BASE, "model.dtype=bfloat16", f"model.transformer_impl={impl}"]
        (runs[impl],) = parallel.launch(train_samples, 1, str(tiny), overrides, SAMPLES, 1, timeout_s=600)
    local, te = runs["local"][0], runs["transformer_engine"][0]
    assert te["train/tokens"] == local["train/tokens"]
    assert te["train/loss"] == pytest.approx(local["train/loss"], rel=2e-2, abs=1e-3)
    assert te["train/grad_norm"] == pytest.approx(local["train/grad_norm"], rel=5e-2)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [{"tp": 2}, {"ep": 2}, {"pp": 2}], ids=["tp2", "ep2", "pp2"])
def test_weight_push_over_nccl(tiny: Path, layout: dict[str, int]) -> None:
    """Three GPUs: two trainer ranks (NCCL) broadcast their buckets over an NCCL transfer group to a
    transformers engine whose actor holds the third GPU (it receives on the GPU, loads into its model);
    the engine's log-probs of its own greedy tokens then equal the trainer's, and each end held at most
    two buckets."""
    _need_gpus(3)
    import functools

    import ray

    from mars_megatron.pipeline.fleet import EngineFleet
    from mars_megatron.rollout.hf_engine import HFEngine
    from mars_megatron.rollout.ray_engine import start_rollout_actor
    from mars_megatron.training.ray_group import RayWorkerGroup
    from tests.ray_workers import TrainerRank
    from tests.test_weight_sync import BUCKET, REQUESTS, TRAIN

    ray.init(num_cpus=4, num_gpus=3, include_dashboard=False, log_to_driver=False)
    try:
        group = RayWorkerGroup(
            TrainerRank, 2, str(tiny), layout, threads_per_rank=1, num_gpus_per_rank=1, bucket_bytes=BUCKET
        )
        factory = functools.partial(HFEngine, str(tiny), seed=0)
        engine = start_rollout_actor(factory, threads=1, num_gpus=1)
        fleet = EngineFleet(group, [("policy", engine)], lambda i: None, host="127.0.0.1", backend="nccl")
        before = engine.generate(REQUESTS)
        group.call("train_step", TRAIN, pack_length=48)
        report = fleet.push_weights({"policy": 1})["policy"]
        after = engine.generate(REQUESTS)
        full = [list(r.prompt_ids) + o.token_ids for r, o in zip(REQUESTS, after, strict=True)]
        trainer = group.call("logprobs", full, 2)[1 if layout.get("pp") else 0]
        for r, o, lp in zip(REQUESTS, after, trainer, strict=True):
            torch.testing.assert_close(
                torch.tensor(o.logprobs), torch.tensor(lp[len(r.prompt_ids) - 1 :]), rtol=0, atol=2e-3
            )
        assert [o.logprobs for o in after] != [o.logprobs for o in before]
        largest = fleet.plans["policy"].largest_bucket
        assert report.sender_peak_bytes <= 2 * largest and report.receiver_peak_bytes <= 2 * largest
        fleet.close()
        group.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.multiproc
def test_a_dead_member_of_an_nccl_transfer_group_costs_the_others_its_deadline_not_their_process() -> None:
    """Two GPUs: a sender and a member that joined and then stopped (what a killed engine is to NCCL: no
    error, kernels spin). The sender's wait gives up at the group's deadline (TransferTimeout), its
    communicator aborted, and its process lives on past the group's NCCL watchdog timeout with a working
    GPU: no watchdog takes a trainer rank down (transfer.group)."""
    _need_gpus(2)
    import multiprocessing as mp
    import time

    from mars_megatron.transfer.group import GroupSpec, host_store
    from tests.transfer_workers import nccl_member_stalls

    timeout_s = 10.0
    store = host_store("127.0.0.1", 120)
    spec = GroupSpec("127.0.0.1", store.port, f"gpu/stall/{time.time_ns()}", 2, "nccl", timeout_s)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=nccl_member_stalls, args=(spec, r, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted((out.get(timeout=180) for _ in range(2)), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert got[0] == ("joined", 1), got
    status, took, total = got[1]
    assert status == "timed out" and timeout_s <= took < timeout_s + 5 and total == 1024.0, got
    assert procs[0].exitcode == 0


@pytest.mark.vllm
def test_official_vllm_as_the_rl_engine_with_fp8_rollout(tiny: Path, tmp_path: Path) -> None:
    """vLLM on the GPU generates the rollouts and takes the trainer's weights after every update; with
    model.fp8 it quantizes them online."""
    if _capability() < (8, 9):
        pytest.skip("FP8 rollout needs compute capability 8.9")
    records = _train(tiny, tmp_path, "vllm_fp8_rollout")
    assert [r["policy_version"] for r in records] == [1.0, 2.0]


@pytest.mark.vllm
def test_colocated_vllm_engine_frees_its_memory_asleep_and_decodes_after_wake_and_push(
    tmp_path: Path,
) -> None:
    """A colocated engine as `mars train` builds one (sleep mode, a share of the GPU): sleep (level 2)
    gives back most of that share, which this process (standing in for the trainer) can then allocate;
    after wake_weights, the weight push and wake it decodes what it decoded before."""
    from safetensors.torch import load_file

    from mars_megatron.rollout.engine import GenerationRequest, SamplingParams
    from mars_megatron.rollout.factory import build_engine
    from mars_megatron.rollout.vllm_engine import VLLMEngine

    dense = init_model("tiny-dense", tmp_path / "dense", dtype="bfloat16")
    share = 0.3
    engine = build_engine("vllm", str(dense), dtype="bfloat16", seed=0, max_batch=8,
                          gpu_memory_utilization=share, enable_sleep_mode=True)  # fmt: skip
    assert isinstance(engine, VLLMEngine) and engine.sleep_frees_memory
    assert engine.llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization == share
    greedy = SamplingParams(max_tokens=16, temperature=0)
    requests = [GenerationRequest(f"r{i}", tuple(range(5 + i, 12 + 2 * i)), greedy) for i in range(4)]
    before = engine.generate(requests)
    free_awake, total = torch.cuda.mem_get_info()
    engine.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    gib = 2**30
    assert freed >= 0.5 * share * total, f"sleep freed {freed / gib:.2f} GiB of {share * total / gib:.1f}"
    held = torch.empty(int(0.9 * freed), dtype=torch.uint8, device="cuda")  # the trainer's turn
    del held
    torch.cuda.empty_cache()
    engine.wake_weights()
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(dense.glob("*.safetensors")):
        tensors.update(load_file(f))
    assert engine.update_weights(tensors.items()) == len(tensors)
    engine.wake()
    after = engine.generate(requests)
    engine.shutdown()  # its memory back before the next engine of this process starts
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


def _perturbed_copy(model: Path, out: Path, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """``model``'s checkpoint with every weight changed (seeded), written to ``out``; returns the tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        part = {
            n: t + scale * torch.randn(t.shape, generator=generator).to(t.dtype)
            for n, t in load_file(f).items()
        }
        save_file(part, f, metadata={"format": "pt"})
        tensors.update(part)
    return tensors


def _greedy(engine: object) -> list[tuple[list[int], list[float]]]:
    from mars_megatron.rollout.engine import GenerationRequest, SamplingParams

    greedy = SamplingParams(max_tokens=16, temperature=0)
    requests = [GenerationRequest(f"r{i}", tuple(range(5 + i, 12 + 2 * i)), greedy) for i in range(4)]
    return [(o.token_ids, o.logprobs) for o in engine.generate(requests)]  # type: ignore[attr-defined]


def _assert_same_decoding(got: list, want: list, atol: float) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_moe_reload_decodes_like_a_fresh_engine(tmp_path: Path, tp: int) -> None:
    """A MoE engine (CUDA graphs on, as `mars train` builds it on GPUs) that takes new weights through
    update_weights decodes what an engine built from those weights decodes; with tp=2 through vLLM's Ray
    executor, its workers on one GPU each (the weights then travel pickled, not as a generator)."""
    _need_gpus(tp)
    from mars_megatron.rollout.vllm_engine import VLLMEngine

    moe = init_model("tiny-moe", tmp_path / "moe", dtype="bfloat16")
    new = _perturbed_copy(moe, tmp_path / "moe-new")
    kwargs = dict(dtype="bfloat16", gpu_memory_utilization=0.25, tensor_parallel_size=tp)
    engine = VLLMEngine(moe, **kwargs)  # type: ignore[arg-type]
    try:
        assert engine.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name != "NONE"
        before = _greedy(engine)
        assert engine.update_weights(new.items()) == len(new)
        reloaded = _greedy(engine)
    finally:
        engine.shutdown()  # tp=2: gives back the placement group the next engine needs
    _assert_no_placement_group_left()
    fresh = VLLMEngine(tmp_path / "moe-new", **kwargs)  # type: ignore[arg-type]
    try:
        _assert_same_decoding(reloaded, _greedy(fresh), atol=1e-3)
    finally:
        fresh.shutdown()
    assert [t for t, _ in reloaded] != [t for t, _ in before]


def _assert_no_placement_group_left() -> None:
    """No Ray placement group of this process still reserves GPUs: vLLM's Ray executor makes one for a
    multi-GPU engine built outside any (this pytest process) and never removes it; VLLMEngine.shutdown
    does, or the next such engine would wait vLLM's PG_WAIT_TIMEOUT (1800 s) for the GPUs."""
    import ray

    if not ray.is_initialized():
        return  # no Ray: no multi-GPU engine ran in this process
    left = {k: v["state"] for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    assert not left, left


@pytest.mark.vllm
def test_vllm_tensor_parallel_engine_decodes_like_one_gpu(tmp_path: Path) -> None:
    """rollout.tp = 2: the same greedy tokens as one GPU, log-probs within bf16 rounding."""
    _need_gpus(2)
    from mars_megatron.rollout.vllm_engine import VLLMEngine

    dense = init_model("tiny-dense", tmp_path / "dense", dtype="bfloat16")
    one = VLLMEngine(dense, dtype="bfloat16", gpu_memory_utilization=0.25)
    try:
        single = _greedy(one)
    finally:
        one.shutdown()
    two = VLLMEngine(dense, dtype="bfloat16", gpu_memory_utilization=0.25, tensor_parallel_size=2)
    try:
        assert two.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "ray"
        _assert_same_decoding(_greedy(two), single, atol=2e-2)
    finally:
        two.shutdown()
    _assert_no_placement_group_left()


@pytest.mark.vllm
def test_a_colocated_replacement_engine_starts_beside_a_rank_holding_most_of_the_gpu(tmp_path: Path) -> None:
    """A colocated engine asking for 0.5 of the GPU while this process (standing in for the trainer
    rank) holds more than half: vLLM alone would refuse to start (its free-memory check at start); the
    engine takes what is free less the margin, which vLLM accepts, and decodes."""
    from mars_megatron.rollout.vllm_engine import STARTUP_MARGIN_BYTES, VLLMEngine

    dense = init_model("tiny-dense", tmp_path / "dense", dtype="bfloat16")
    free, total = torch.cuda.mem_get_info()
    held = torch.empty(max(0, free - int(0.4 * total)), dtype=torch.uint8, device="cuda")  # 40% left
    free_now = torch.cuda.mem_get_info()[0]
    assert free_now < 0.5 * total
    engine = VLLMEngine(dense, dtype="bfloat16", gpu_memory_utilization=0.5, enable_sleep_mode=True)
    try:
        share = engine.gpu_memory_utilization
        assert 0.3 < share < 0.5 and share * total <= free_now - STARTUP_MARGIN_BYTES
        assert engine.llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization == share
        assert all(len(tokens) == 16 for tokens, _ in _greedy(engine))
    finally:
        engine.shutdown()
        del held


@pytest.mark.vllm
def test_rl_steps_with_a_colocated_vllm_engine(tiny: Path, tmp_path: Path) -> None:
    """`mars train` with pipeline.placement=colocated on one GPU: the trainer rank and the vLLM engine
    share it; the engine sleeps through each update and wakes around the weight push."""
    records = _train(tiny, tmp_path, "vllm_colocated")
    assert [r["policy_version"] for r in records] == [1.0, 2.0]
    assert all(r["train/update_ok"] == 1.0 for r in records)
    # the push went by CUDA IPC handle (colocated) and the engine computes the trainer's policy
    assert all(r["sync/recovered_engines"] == 0.0 and r["sync/receiver_peak_bytes"] > 0 for r in records)
    assert all(0 < r["train/mismatch/all/abs_mean"] < MISMATCH_BOUND for r in records)


@pytest.mark.vllm
def test_rl_steps_with_a_two_gpu_vllm_engine(tiny: Path, tmp_path: Path) -> None:
    """rollout.tp = 2 over the two trainer ranks' GPUs: the engine's vLLM workers take one bundle each."""
    records = _train(tiny, tmp_path, "vllm_tp2_colocated")
    assert [r["policy_version"] for r in records] == [1.0, 2.0]
    assert all(r["train/update_ok"] == 1.0 for r in records)
    # both trainer ranks host a vLLM worker: EP2's second sender broadcasts to the other host over NCCL,
    # each host hands its buffer to its worker by CUDA IPC
    assert all(0 < r["train/mismatch/all/abs_mean"] < MISMATCH_BOUND for r in records)


@pytest.mark.vllm
def test_trainer_and_bf16_vllm_agree_on_the_log_probs(tiny: Path, tmp_path: Path) -> None:
    """The train-rollout mismatch of a bf16 vLLM engine against the bf16 TE trainer, per role, within
    :data:`MISMATCH_BOUND`; none of it an outlier sequence."""
    records = _train(tiny, tmp_path, "vllm_bf16_mismatch")
    for r in records:
        assert 0 < r["train/mismatch/all/abs_mean"] < MISMATCH_BOUND, r["train/mismatch/all/abs_mean"]
        assert r["train/mismatch/all/seq_outliers"] == 0.0


def test_resume_under_transformer_engine_repeats_the_steps(tiny: Path, tmp_path: Path) -> None:
    """4 steps saving at 2, and a run stopped after 2 then resumed from its checkpoint to 4: steps 3-4
    agree (rollouts bit for bit; losses and gradient norms within the run-to-run spread of GPU kernels)."""
    full = _train(tiny, tmp_path / "full", "te_resume")
    _train(tiny, tmp_path / "part", "te_resume", "train.steps=2")
    resumed = _train(tiny, tmp_path / "part", "te_resume", "--resume")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full[2:], resumed[2:], strict=True):
        assert a["tokens"] == b["tokens"] and a["reward/solver"] == b["reward/solver"]
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-3, abs=1e-5)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-2)


def test_context_parallel_thd_steps_on_two_gpus(tiny: Path) -> None:
    """CP2 with TE's ring attention over THD packs (every sample padded to a multiple of 2*cp and split
    per sample) takes the step one GPU takes, within bf16 rounding."""
    _need_gpus(2)
    from mars_megatron.training import parallel
    from tests.rl_workers import train_samples
    from tests.test_rl_train import BASE, SAMPLES

    overrides = [*BASE, *TE, "optimizer.lr=1e-3"]
    (one,) = parallel.launch(train_samples, 1, str(tiny), overrides, SAMPLES, 1, timeout_s=600)
    ranks = parallel.launch(
        train_samples, 2, str(tiny), [*overrides, "parallel.cp=2"], SAMPLES, 1, timeout_s=600
    )
    for r in ranks:
        assert r[0]["train/tokens"] == one[0]["train/tokens"]
        assert r[0]["train/loss"] == pytest.approx(one[0]["train/loss"], rel=2e-2)
        assert r[0]["train/grad_norm"] == pytest.approx(one[0]["train/grad_norm"], rel=2e-2)
