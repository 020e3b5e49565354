"""Every torch.distributed collective of the package on tensors, with the device decided in one place.

Why a module of its own: NCCL moves only GPU tensors and gloo only CPU tensors, so where a tensor lives
when it enters a collective is a property of the *group's backend*, not of the code around the call. The
first GPU run of the weight export failed exactly there (each rank's piece was copied to the host, then
all-gathered over an NCCL group). Here :func:`comm_device` reads the backend of the group and every
wrapper puts its tensors on that device before the call, so code elsewhere cannot hand NCCL a host copy.
``tests/test_collectives.py`` keeps the rest of the package from calling ``torch.distributed``'s tensor
collectives directly.

Object collectives (``all_gather_object``, ``broadcast_object_list``) are left to torch: they pick the
current CUDA device themselves for NCCL groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def device_for_backend(backend: str, cuda_index: int | None = None) -> torch.device:
    """The device a collective on a group of ``backend`` takes its tensors on. Pure: every branch is
    tested on CPU.

    ``backend`` is what :func:`torch.distributed.get_backend` reports: ``"nccl"``, ``"gloo"``, or a
    per-device list such as ``"cpu:gloo,cuda:nccl"``; a group that can run on CUDA gets the GPU (NCCL is the
    fast path), any other the host. ``cuda_index``: the CUDA device of this process (its
    ``torch.cuda.current_device()``), needed only for CUDA groups."""
    names = {part.split(":")[-1].strip().lower() for part in backend.split(",")}
    if "nccl" in names:
        if cuda_index is None:
            raise ValueError(f"a process group of backend {backend!r} needs this process's CUDA device index")
        return torch.device("cuda", cuda_index)
    if names & {"gloo", "mpi"}:
        return torch.device("cpu")
    raise ValueError(f"unknown process-group backend {backend!r}: expected nccl, gloo or mpi")


def comm_device(group: Any = None) -> torch.device:
    """The device collectives on ``group`` (default: the world) take their tensors on."""
    backend = str(dist.get_backend(group))
    cuda = torch.cuda.current_device() if "nccl" in backend.lower() else None
    return device_for_backend(backend, cuda)


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` contiguous on ``device`` (the same tensor when it already is)."""
    return tensor.to(device, non_blocking=False).contiguous()


def all_gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks) in group-rank order, on the group's device."""
    device = comm_device(group)
    local = _on(tensor, device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return parts


def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> torch.Tensor:
    """The sum (or ``op``) of ``tensor`` over ``group``. In place when ``tensor`` already lives on the
    group's device (autograd code relies on that for its buffers); otherwise a reduced copy on that
    device is returned and ``tensor`` is left alone."""
    device = comm_device(group)
    target = tensor if tensor.device == device and tensor.is_contiguous() else _on(tensor, device)
    dist.all_reduce(target, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return target


def all_reduce_values(values: Sequence[float], group: Any = None) -> list[float]:
    """Float64 sums of a few Python numbers over ``group`` (losses, token counts, flags)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(t, group=group)
    return t.tolist()


def send(tensor: torch.Tensor, dst: int, group: Any = None) -> None:
    """Point-to-point send to global rank ``dst``."""
    dist.send(_on(tensor, comm_device(group)), dst=dst, group=group)


def recv(shape: Sequence[int], dtype: torch.dtype, src: int, group: Any = None) -> torch.Tensor:
    """A tensor of ``shape``/``dtype`` received from global rank ``src``, on the group's device."""
    out = torch.empty(tuple(shape), dtype=dtype, device=comm_device(group))
    dist.recv(out, src=src, group=group)
    return out
