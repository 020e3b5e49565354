"""Where each decoding sequence's context already is in Ray's object store, so that a segment that
continues a sequence is sent as references rather than tokens.

A sequence's first segment carries its context (the input prompt) inline, in the call's
:class:`~mars_megatron.rollout.batch.RequestBatch`, which the driver puts in the store itself. Each
segment's tokens come back in the call's :class:`~mars_megatron.rollout.batch.OutputBatch`, also in the
store. So the context of the next segment (prompt, then every segment so far) is a few spans of objects
that are already there, and the request names them; the engine's side fetches them. Without this every
segment re-sent its whole context: a paper step's driver copied about 1.8 times its trained tokens into
the store for the engines (``tools/bench/control_plane.py``).

The driver holds the references, so the objects stay while a sequence decodes; a sequence that finishes,
is requeued, or is no longer decoding is forgotten, and one whose record no longer matches its spans (a
tool's observation was appended, or the run resumed from a checkpoint, which keeps no references) is sent
inline again. Nothing here changes what an engine sees: the same tokens, joined on the engine's side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mars_megatron.pipeline.scheduler import Scheduler, SegmentJob, SeqState
from mars_megatron.rollout.batch import OutputBatch, RequestBatch, Span
from mars_megatron.rollout.engine import SamplingParams

_Placed = tuple[Any, int, int]
"""``(object reference, start, stop)``: tokens ``start:stop`` of the array that object carries."""


class ContextIndex:
    """Per decoding sequence, the spans of stored objects its context is made of, in order."""

    def __init__(self) -> None:
        self._placed: dict[str, list[_Placed]] = {}

    def __len__(self) -> int:
        return len(self._placed)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._placed

    def request_batch(self, jobs: Sequence[SegmentJob], sampling: SamplingParams) -> RequestBatch:
        """One engine call's requests: a job whose whole context is placed names it by reference; any other
        carries it inline (its input, then the tokens decoded so far)."""
        sources: dict[Any, int] = {}
        inline: list[tuple[Any, ...]] = []
        spans: list[tuple[Span, ...]] = []
        for job in jobs:
            placed = self._placed.get(job.sample_id)
            if placed is not None and _length(placed) == len(job.prompt_ids) + len(job.prefix):
                inline.append(())
                spans.append(tuple((sources.setdefault(ref, len(sources)), a, b) for ref, a, b in placed))
            else:
                self._placed.pop(job.sample_id, None)
                inline.append((job.prompt_ids, job.prefix))
                spans.append(())
        return RequestBatch.of(
            [j.sample_id for j in jobs],
            inline,
            [j.max_tokens for j in jobs],
            [j.seed for j in jobs],
            sampling,
            sources=tuple(sources),
            spans=tuple(spans) if sources else (),
        )

    def sent(self, batch: RequestBatch, ref: Any) -> None:
        """``batch`` is in the store as ``ref``: each context it carried inline is placed there."""
        o = batch.offsets
        for i, sample_id in enumerate(batch.request_ids):
            if o[i + 1] > o[i]:
                self._placed[sample_id] = [(ref, o[i], o[i + 1])]

    def received(self, outputs: OutputBatch, ref: Any, scheduler: Scheduler) -> None:
        """The call's result is in the store as ``ref`` and its outputs are recorded: a sequence that goes
        on decoding has its new tokens placed there too, when its record is exactly what is placed plus
        them; any other is forgotten."""
        o = outputs.offsets
        for i, sample_id in enumerate(outputs.request_ids):
            placed = self._placed.get(sample_id)
            if placed is None:
                continue
            seq = scheduler.samples.get(sample_id)
            continuing = seq is not None and scheduler.state(sample_id) is SeqState.READY
            if continuing and _length(placed) + o[i + 1] - o[i] == len(seq.prompt_ids) + seq.response_len:
                placed.append((ref, o[i], o[i + 1]))
            else:
                del self._placed[sample_id]

    def forget(self, sample_ids: Sequence[str]) -> None:
        """These sequences are sent inline next time (their work was lost, or their objects were)."""
        for sample_id in sample_ids:
            self._placed.pop(sample_id, None)

    def prune(self, scheduler: Scheduler) -> None:
        """Forget every sequence that is no longer waiting for or decoding a segment (after an update:
        the references of trained or dropped records are let go)."""
        live = (SeqState.READY, SeqState.DECODING)
        gone = [s for s in self._placed if s not in scheduler.samples or scheduler.state(s) not in live]
        self.forget(gone)


def _length(placed: Sequence[_Placed]) -> int:
    return sum(b - a for _, a, b in placed)
