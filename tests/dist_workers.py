"""Module-level functions that tests run on spawned torch.distributed ranks via ``parallel.launch``.

Spawned processes import the function they run by module path, so these cannot live in a test file's
fixtures or closures. Arguments and results are plain picklable data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist

from mars_megatron.config import ParallelConfig
from mars_megatron.convert import hf_to_mcore, mcore_to_hf
from mars_megatron.training import parallel

Layout = tuple[int, int, int, int | None]  # (tp, pp, ep, etp); etp None = same as tp


@dataclass(frozen=True)
class Op:
    """One conversion run on every rank: ``to_mcore`` (HF ``src`` → Megatron ``dst``) or ``to_hf``
    (Megatron ``src`` → HF ``dst``), in layout ``(tp, pp, ep, etp)``."""

    kind: str  # "to_mcore" | "to_hf"
    src: str
    dst: str
    layout: Layout


def _config(layout: Layout) -> ParallelConfig:
    tp, pp, ep, etp = layout
    return ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp)


def _run(op: Op) -> None:
    if op.kind == "to_mcore":
        hf_to_mcore(op.src, op.dst, _config(op.layout))
    elif op.kind == "to_hf":
        mcore_to_hf(op.src, op.dst, _config(op.layout), progress=False)
    else:
        raise ValueError(f"unknown op kind {op.kind!r}")


def run_ops(ops: list[Op], seed: int = 1234) -> list[float]:
    """Run ``ops`` in order, re-initialising megatron's parallel state whenever the layout changes.

    Returns each op's wall time in seconds as seen by this rank. Any failure propagates, so ``launch``
    raises a RuntimeError carrying the failing rank's traceback.
    """
    current: Layout | None = None
    seconds = []
    for op in ops:
        if op.layout != current:
            parallel.init_model_parallel(_config(op.layout), seed)
            current = op.layout
        start = time.perf_counter()
        _run(op)
        seconds.append(time.perf_counter() - start)
    return seconds


def run_expecting_errors(ops: list[Op], seed: int = 1234) -> list[tuple[str, str]]:
    """Run each op and catch what it raises: ``(exception type name, message)`` per op, ``("", "")`` for
    an op that succeeded.

    Single-rank worlds only: in a larger world a rank that raises alone would leave the others waiting
    in a collective.
    """
    assert dist.get_world_size() == 1, "run_expecting_errors needs a world of one rank"
    results = []
    for op in ops:
        parallel.init_model_parallel(_config(op.layout), seed)
        try:
            _run(op)
        # torch.distributed.checkpoint raises CheckpointException, a BaseException subclass.
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            results.append((type(e).__name__, str(e)))
        else:
            results.append(("", ""))
    return results


def collective_round() -> dict[str, object]:
    """Every wrapper of :mod:`mars_megatron.comm.collectives` once, on a world of 2 (gloo)."""
    import torch

    from mars_megatron.comm import collectives

    rank = dist.get_rank()
    device = collectives.comm_device()
    gathered = collectives.all_gather(torch.full((2,), float(rank + 1)))
    mine = torch.tensor([rank + 1.0, 10.0])
    reduced = collectives.all_reduce(mine)
    maxed = collectives.all_reduce(torch.tensor([float(rank)]), op=dist.ReduceOp.MAX)
    strided = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: reduced as a copy
    strided_sum = collectives.all_reduce(strided)
    if rank == 1:
        collectives.send(torch.arange(6, dtype=torch.int64).reshape(2, 3) * 7, dst=0)
        received = None
    else:
        received = collectives.recv((2, 3), torch.int64, src=1).tolist()
    return {
        "device": str(device),
        "gathered": [t.tolist() for t in gathered],
        "reduced_in_place": reduced is mine,
        "reduced": mine.tolist(),
        "max": maxed.tolist(),
        "strided_sum": strided_sum.tolist(),
        "strided_untouched": strided.tolist() == torch.arange(6.0).reshape(2, 3).t().tolist(),
        "values": collectives.all_reduce_values([rank + 0.5, 2.0]),
        "received": received,
    }
