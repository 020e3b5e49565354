"""The bucket plan of a weight transfer: which HF tensors travel together, from which sender, in which order.

Pure and deterministic: every trainer rank and every engine worker computes or receives the same plan, so
the only thing that crosses the wire during a transfer is tensor bytes. Buckets are cut on layer
boundaries (a layer's tensors from one sender stay in one bucket unless the layer alone is larger than a
bucket): vLLM's in-place reload processes a module (a fused QKV, a layer's ``FusedMoE`` with all of its
experts) only once all of its weights have arrived and keeps what arrived aside until then, so what a
receiver stages across buckets is set by how the plan splits layers. Two more cuts keep that to one
layer at a time (:attr:`TransferPlan.staging_bytes`):

* a layer that several senders send (expert parallelism: each EP rank sends its own experts of every
  layer) closes each sender's bucket at the end of its part of the layer, so the parts arrive back to
  back and the layer completes before the next one starts (otherwise every layer of a sender's bucket
  would wait for the other senders' buckets);
* a sender's last bucket is due right after its last tensor, not at the end of the export, so the tail
  of a pipeline stage's last layer does not wait behind the later stages.

Order: each sender fills its own open bucket while walking the export order; a bucket is *due* at the
export position where the next tensor no longer fits (or at the end). Buckets are broadcast in the order
they fall due, so a sender broadcasts only after it took part in every gather of earlier positions: no
sender can wait on a receiver that waits on a gather that waits on that sender.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 64
"""Byte alignment of every tensor in a bucket: a view of any dtype at any offset is then legal (and
aligned for vectorised copies)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    """One HF tensor of the transfer: its name, shape, dtype and the global trainer rank that sends it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    sender: int

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch_dtype(self.dtype).itemsize

    @property
    def layer(self) -> int | None:
        """Decoder layer index of an HF name (None for embeddings, final norm and head)."""
        m = _LAYER.match(self.name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Bucket:
    """Tensors broadcast together by ``sender`` as one flat byte buffer of ``nbytes``."""

    sender: int
    tensors: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    due: int  # the export position (index into the plan's tensors) at which the sender broadcasts it


@dataclass(frozen=True)
class TransferPlan:
    """Every tensor of a policy in export order, cut into buckets; ``senders`` in ascending rank order."""

    tensors: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int

    @property
    def senders(self) -> tuple[int, ...]:
        return tuple(sorted({b.sender for b in self.buckets}))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def largest_bucket(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def staging_bytes(self) -> int:
        """The most bytes of incomplete layers a receiver holds between buckets when it takes the buckets
        in plan order and a layer's weights can only be used once the whole layer arrived (vLLM's
        layerwise reload: :mod:`mars_megatron.rollout.vllm_transfer`). An upper bound of what vLLM stages,
        which waits per module, not per layer. :func:`plan_buckets` keeps it within the largest layer."""
        total: dict[int, int] = {}
        for t in self.tensors:
            if t.layer is not None:
                total[t.layer] = total.get(t.layer, 0) + t.nbytes
        arrived: dict[int, int] = {}
        most = 0
        for b in self.buckets:
            for t in b.tensors:
                if t.layer is not None:
                    arrived[t.layer] = arrived.get(t.layer, 0) + t.nbytes
            most = max(most, sum(n for layer, n in arrived.items() if n < total[layer]))
        return most

    def buckets_of(self, sender: int) -> list[Bucket]:
        return [b for b in self.buckets if b.sender == sender]


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _bucket(sender: int, specs: list[TensorSpec], due: int) -> Bucket:
    offsets, at = [], 0
    for s in specs:
        offsets.append(at)
        at = _aligned(at + s.nbytes)
    return Bucket(sender, tuple(specs), tuple(offsets), at, due)


def plan_buckets(tensors: Sequence[TensorSpec], bucket_bytes: int) -> TransferPlan:
    """Cut ``tensors`` (export order) into buckets of at most ``bucket_bytes`` per sender, on layer
    boundaries where a layer fits; a tensor larger than ``bucket_bytes`` travels alone. A layer sent by
    several senders ends each sender's bucket; a sender's last bucket is due after its last tensor
    (module docstring)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError("plan_buckets: duplicate tensor names")
    # units: runs of consecutive tensors of one sender and one layer (kept together when they fit)
    units: list[tuple[int, list[TensorSpec]]] = []
    for i, t in enumerate(tensors):
        last = units[-1][1][-1] if units else None
        if last is not None and last.sender == t.sender and last.layer == t.layer and t.layer is not None:
            units[-1][1].append(t)
        else:
            units.append((i, [t]))
    senders_of: dict[int, set[int]] = {}
    for t in tensors:
        if t.layer is not None:
            senders_of.setdefault(t.layer, set()).add(t.sender)
    final = {t.sender: i for i, t in enumerate(tensors)}  # each sender's last position
    open_: dict[int, list[TensorSpec]] = {}
    size: dict[int, int] = {}
    out: list[Bucket] = []

    def flush(sender: int, position: int) -> None:
        out.append(_bucket(sender, open_.pop(sender), position))
        size[sender] = 0

    def add(position: int, spec: TensorSpec) -> None:
        n = _aligned(spec.nbytes)
        if open_.get(spec.sender) and size[spec.sender] + n > bucket_bytes:
            flush(spec.sender, position)
        open_.setdefault(spec.sender, []).append(spec)
        size[spec.sender] = size.get(spec.sender, 0) + n

    for position, unit in units:
        s = unit[0].sender
        unit_bytes = sum(_aligned(t.nbytes) for t in unit)
        if unit_bytes <= bucket_bytes:
            if open_.get(s) and size[s] + unit_bytes > bucket_bytes:
                flush(s, position)
            for t in unit:
                add(position, t)
        else:  # a layer larger than a bucket: tensor by tensor
            for k, t in enumerate(unit):
                add(position + k, t)
        end = position + len(unit)
        layer = unit[0].layer
        if (layer is not None and len(senders_of[layer]) > 1) or final[s] < end:
            flush(s, end)  # its part of a shared layer, or its last tensor, is in: out it goes
    return TransferPlan(tuple(tensors), tuple(out), bucket_bytes)


def unpack(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of ``buffer`` (bytes, ``bucket.nbytes``) as the bucket's named tensors: no copy."""
    out = []
    for spec, off in zip(bucket.tensors, bucket.offsets, strict=True):
        raw = buffer[off : off + spec.nbytes]
        out.append((spec.name, raw.view(torch_dtype(spec.dtype)).view(spec.shape)))
    return out
