"""Process groups for the Megatron adapter: start torch.distributed, initialise megatron's parallel
state, and run a function on N local processes.

Megatron's parallel state is global; it is created and destroyed only here so that the rest of the
package can take a :class:`ParallelConfig` and never touch ``parallel_state`` directly.

Multi-process runs on one machine rendezvous through a ``FileStore`` in a temporary directory and pin gloo
to the loopback interface, so nothing listens on a network address.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mars_megatron.config import ParallelConfig
from mars_megatron.training import cpu_compat


def min_world_size(parallel: ParallelConfig) -> int:
    """Smallest world that realises the layout: ``pp * lcm(tp * cp, ep * etp)`` (data parallel fills the
    rest)."""
    return parallel.pp * math.lcm(parallel.tp * parallel.cp, parallel.ep * parallel.effective_etp)


def use_gpu() -> bool:
    return torch.cuda.is_available()


def init_distributed(rank: int, world_size: int, store_path: str | None = None) -> None:
    """Start torch.distributed (NCCL on GPUs, gloo on CPU) unless it is already running.

    With ``store_path`` the ranks meet through a file; otherwise the usual ``MASTER_ADDR``/``MASTER_PORT``
    environment of torchrun or Slurm is used.
    """
    if dist.is_initialized():
        return
    if use_gpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        backend = "nccl"
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = "gloo"
    if store_path is not None:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)


def init_model_parallel(parallel: ParallelConfig, seed: int) -> None:
    """Create megatron's TP/PP/EP groups for ``parallel`` on the running world and seed its RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu_compat.install()
    world = dist.get_world_size()
    parallel.check_world_size(world)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.effective_etp,
    )
    # The CUDA RNG tracker needs a CUDA generator; on CPU a no-op tracker is correct because the model is
    # initialised layout-independently by ``weights.init_weights`` and dropout is off.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not use_gpu())
    torch.manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class RankCoords:
    """Where this rank sits in every megatron group; gathered once so any rank can find a tensor's owner."""

    rank: int
    pp: int
    tp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int


def rank_coords() -> RankCoords:
    from megatron.core import parallel_state as ps

    return RankCoords(
        rank=dist.get_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        tp=ps.get_tensor_model_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_rank(),
        edp=ps.get_expert_data_parallel_rank(),
    )


def all_rank_coords() -> list[RankCoords]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rank_coords())
    return gathered


# ---------------------------------------------------------------------------------------------- launching
def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    try:
        torch.set_num_threads(threads)
        init_distributed(rank, world_size, store_path)
        out = fn(*args)
        results.put((rank, True, out))
    except BaseException:  # report every failure to the parent, including SystemExit
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy()
        except Exception:
            pass


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 900.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes joined in one torch.distributed world.

    Returns each rank's return value (which must be picklable). If any rank fails, the others are
    terminated and a RuntimeError carries that rank's traceback. ``fn`` must be importable (module level),
    because processes are spawned, not forked: forking a process that already ran torch ops can hang in
    OpenMP.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="mars-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, store_path, threads, fn, args, results), daemon=False
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outputs) < world_size:
                try:
                    rank, ok, payload = results.get(timeout=1.0)
                except queue.Empty:
                    crashed = [
                        i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in outputs
                    ]
                    if crashed:
                        codes = {i: procs[i].exitcode for i in crashed}
                        raise RuntimeError(
                            f"ranks {crashed} died without a report (exit codes {codes})"
                        ) from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"distributed run timed out after {timeout_s}s") from None
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
                outputs[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=30 if len(outputs) == world_size else 1)
                if p.is_alive():
                    p.terminate()
                    p.join()
    return [outputs[r] for r in range(world_size)]
