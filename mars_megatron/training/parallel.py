"""Process groups for the Megatron adapter: start torch.distributed, initialise megatron's parallel
state, and run a function on N local processes.

Megatron's parallel state is global; it is created and destroyed only here so that the rest of the
package can take a :class:`ParallelConfig` and never touch ``parallel_state`` directly.

Multi-process runs on one machine rendezvous through a ``FileStore`` in a temporary directory and pin gloo
to the loopback interface, so nothing listens on a network address.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from mars_megatron import runtime_env
from mars_megatron.config import ParallelConfig
from mars_megatron.training import cpu_compat, rank_start


def min_world_size(parallel: ParallelConfig) -> int:
    """Smallest world that realises the layout: ``pp * lcm(tp * cp, ep * etp)`` (data parallel fills the
    rest)."""
    return parallel.pp * math.lcm(parallel.tp * parallel.cp, parallel.ep * parallel.effective_etp)


def use_gpu() -> bool:
    return torch.cuda.is_available()


def cuda_device_index(
    rank: int, world_size: int, device_count: int, env: Mapping[str, str], *, spawned: bool
) -> int:
    """The CUDA device (index among the visible ones) rank ``rank`` of ``world_size`` binds.

    ``spawned``: the ranks are this machine's processes started by :func:`launch`, numbered from 0, so
    rank *is* the local rank; a ``LOCAL_RANK`` in their environment was inherited from whatever started
    the parent (torchrun, Slurm, a Ray trainer rank that sets it) and would put every child on the
    parent's device. Otherwise (torchrun/Slurm started this process) ``LOCAL_RANK`` is trusted only
    once it is consistent: an integer, not above the global rank (local ranks number the node's
    processes in global-rank order), below ``LOCAL_WORLD_SIZE`` where that is set, and naming a visible
    device. A launcher that binds one GPU per task (``CUDA_VISIBLE_DEVICES`` per process: Slurm's
    ``--gpus-per-task``, Ray) leaves one visible device, which is then the rank's whatever its local
    rank. Without ``LOCAL_RANK``: ``rank % device_count``, the single-node rule."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    where = f"{device_count} visible CUDA device(s)"
    if visible:
        where += f" (CUDA_VISIBLE_DEVICES={visible})"
    if device_count < 1:
        raise RuntimeError(f"rank {rank}: no CUDA device is visible to bind ({where})")
    if spawned:
        if world_size > device_count:
            raise RuntimeError(
                f"launch: {world_size} ranks on this machine but {where}: NCCL needs one device per rank"
            )
        return rank
    raw = env.get("LOCAL_RANK")
    if raw is None:
        return rank % device_count
    try:
        local = int(raw)
    except ValueError:
        raise RuntimeError(f"LOCAL_RANK={raw!r} is not an integer (rank {rank})") from None
    if not 0 <= local <= rank:
        raise RuntimeError(
            f"LOCAL_RANK={local} with RANK={rank}: a local rank lies in [0, RANK]; this LOCAL_RANK was "
            "probably inherited from another launcher's environment"
        )
    raw_size = env.get("LOCAL_WORLD_SIZE")
    if raw_size is not None:
        try:
            local_world = int(raw_size)
        except ValueError:
            raise RuntimeError(f"LOCAL_WORLD_SIZE={raw_size!r} is not an integer (rank {rank})") from None
        if not local < local_world <= world_size:
            raise RuntimeError(
                f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={local_world}, WORLD_SIZE={world_size}: need "
                "LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE"
            )
    if device_count == 1:
        return 0
    if local >= device_count:
        raise RuntimeError(f"LOCAL_RANK={local} (rank {rank}) names no device: {where}")
    return local


def trainer_nccl_env() -> None:
    """Before this process creates its NCCL training world: the environment that keeps a weight-transfer
    group's failure from terminating it (:data:`~mars_megatron.transfer.group.TRAINER_NCCL_ENV`, whose
    module docstring says why); values already set are kept."""
    from mars_megatron.transfer.group import TRAINER_NCCL_ENV

    for key, value in TRAINER_NCCL_ENV.items():
        os.environ.setdefault(key, value)


def init_distributed(rank: int, world_size: int, store_path: str | None = None) -> None:
    """Start torch.distributed (NCCL on GPUs, gloo on CPU) unless it is already running.

    With ``store_path`` the ranks meet through a file (the processes :func:`launch` spawned on this
    machine); otherwise the usual ``MASTER_ADDR``/``MASTER_PORT`` environment of torchrun or Slurm is
    used. The device each rank binds: :func:`cuda_device_index`.
    """
    if dist.is_initialized():
        return
    if use_gpu():
        spawned = store_path is not None
        device = cuda_device_index(rank, world_size, torch.cuda.device_count(), os.environ, spawned=spawned)
        torch.cuda.set_device(device)
        trainer_nccl_env()
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


# ---------------------------------------------------------------------------------------------- launching
def result_bytes(fn: Callable[..., Any], result: Any) -> bytes:
    """A rank's return value as self-contained bytes, pickled here rather than by the queue: the queue
    pickles in a feeder thread, where a failure is only printed and the caller would wait for this rank
    until its timeout. Plain pickle, not multiprocessing's: once ``torch.multiprocessing`` is imported (a
    forked rank has it from the server), that one sends a tensor as a file descriptor to share, which the
    caller can no longer fetch once the rank has exited."""
    try:
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise TypeError(f"{fn.__qualname__} returned a value that cannot be sent back: {err}") from err


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    threads: int,
    inherited: rank_start.Inherited,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    try:
        inherited.apply()
        torch.set_num_threads(threads)
        # this machine's processes, numbered by rank: what torchrun would give them (an inherited
        # LOCAL_RANK belongs to the parent's launcher)
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        init_distributed(rank, world_size, store_path)
        results.put((rank, True, result_bytes(fn, fn(*args))))
    except BaseException:  # report every failure to the parent, including SystemExit
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy()
        except Exception:
            pass


_EXIT_GRACE_S = 0.5
"""How long a failure report waits for the exit status of a rank that died without one: its gloo peer
reports the broken connection as the rank's process ends, a moment before its exit status shows here."""


def _died_silently(procs: list[Any], reported: set[int], grace_s: float = 0.0) -> dict[int, int]:
    """Exit codes of the ranks that ended with a failure and sent no report, waiting up to ``grace_s``
    for one to show."""
    end = time.monotonic() + grace_s
    while True:
        codes = {
            i: p.exitcode for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in reported
        }
        if codes or time.monotonic() >= end:
            return codes
        time.sleep(0.02)


def _died_message(codes: dict[int, int]) -> str:
    return f"ranks {sorted(codes)} died without a report (exit codes {codes})"


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 900.0,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes joined in one torch.distributed world.

    Returns each rank's return value (which must be picklable). If any rank fails, the others are
    terminated and a RuntimeError carries that rank's traceback. ``fn`` must be importable (module level),
    because this process is not forked: forking a process that already ran torch ops can hang in OpenMP.
    The ranks fork from a server that has imported torch and Megatron-Core, or are spawned
    (:mod:`~mars_megatron.training.rank_start` says when each, and why; ``start_method`` forces one).
    Either way each rank has this process's environment (the ``mars`` command's numerics pins,
    :mod:`mars_megatron.runtime_env`), ``sys.path``, working directory and standard output and error, and
    runs ``runtime_env.cpu_threads()`` threads, a constant rather than a share of this host's cores, so
    its reductions split alike on any machine.
    """
    ctx = rank_start.context(rank_start.choose(start_method))
    results = ctx.Queue()
    threads = runtime_env.cpu_threads()
    inherited = rank_start.Inherited()
    with tempfile.TemporaryDirectory(prefix="mars-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store_path, threads, inherited, fn, args, results),
                daemon=False,
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
                    codes = _died_silently(procs, set(outputs))
                    if codes:
                        raise RuntimeError(_died_message(codes)) from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"distributed run timed out after {timeout_s}s") from None
                    continue
                if not ok:
                    failed = f"rank {rank} of {world_size} failed:\n{payload}"
                    # a rank's peers see its death as a broken connection, often before this process
                    # sees its exit status: name the rank that died, not only the peer that reported
                    grace_s = _EXIT_GRACE_S if world_size > 1 else 0.0
                    codes = _died_silently(procs, {*outputs, rank}, grace_s)
                    if codes:
                        failed = f"{_died_message(codes)}; then {failed}"
                    raise RuntimeError(failed)
                outputs[rank] = pickle.loads(payload)  # bytes a rank of this launch pickled
        finally:
            for p in procs:
                p.join(timeout=30 if len(outputs) == world_size else 1)
                if p.is_alive():
                    p.terminate()
                    p.join()
    return [outputs[r] for r in range(world_size)]
