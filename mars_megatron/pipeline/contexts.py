"""Where each decoding sequence's context already is in Ray's object store, so that a segment that
continues a sequence is sent as a reference rather than tokens.

A sequence's first segment carries its context (the input prompt) inline. The engine's side hands back,
with an output its token budget cut, that segment's whole context followed by the output
(:attr:`~mars_megatron.rollout.batch.OutputBatch.carried`), left in the store with the call's result: the
next segment's context, which its request names by one span. The engine fetches it; the driver neither
sends it nor reads it. Without this every segment re-sent its whole context: a paper step's driver put
about 1.8 times its trained tokens into the store for the engines (``tools/bench/control_plane.py``).

The driver holds one reference per continuing sequence (its latest result), so each result stays while a
sequence continues from it and goes once none does. A sequence that finishes, is requeued, or is no
longer decoding is forgotten, and one whose record no longer matches what was carried (a tool's
observation was appended; the run resumed from a checkpoint, which keeps no references) is sent inline
again. Nothing here changes what an engine sees: the same tokens, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mars_megatron.pipeline.scheduler import Scheduler, SegmentJob, SeqState
from mars_megatron.rollout.batch import OutputBatch, RequestBatch, Span
from mars_megatron.rollout.engine import SamplingParams

_Placed = tuple[Any, int, int]
"""``(result reference, start, stop)``: a context, tokens ``start:stop`` of that result's carried array."""


class ContextIndex:
    """Per continuing sequence, where its whole context is in the object store."""

    def __init__(self) -> None:
        self._placed: dict[str, _Placed] = {}

    def __len__(self) -> int:
        return len(self._placed)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._placed

    def request_batch(self, jobs: Sequence[SegmentJob], sampling: SamplingParams) -> RequestBatch:
        """One engine call's requests: a job whose context is placed names it by reference; any other
        carries it inline (its input, then the tokens decoded so far)."""
        sources: dict[Any, int] = {}
        inline: list[tuple[Any, ...]] = []
        spans: list[Span | None] = []
        for job in jobs:
            placed = self._placed.get(job.sample_id)
            if placed is not None and placed[2] - placed[1] == len(job.prompt_ids) + len(job.prefix):
                ref, start, stop = placed
                inline.append(())
                spans.append((sources.setdefault(ref, len(sources)), start, stop))
            else:
                self._placed.pop(job.sample_id, None)
                inline.append((job.prompt_ids, job.prefix))
                spans.append(None)
        return RequestBatch.of(
            [j.sample_id for j in jobs],
            inline,
            [j.max_tokens for j in jobs],
            [j.seed for j in jobs],
            sampling,
            sources=tuple(sources),
            spans=tuple(spans) if sources else (),
        )

    def received(self, outputs: OutputBatch, ref: Any, scheduler: Scheduler) -> None:
        """The call's result is in the store as ``ref`` and its outputs are recorded: a sequence that goes
        on decoding is placed at the context its output carried, when its record is exactly that context;
        any other is forgotten."""
        for i, sample_id in enumerate(outputs.request_ids):
            carried = outputs.next_context(i)
            seq = scheduler.samples.get(sample_id)
            if (
                carried is not None
                and seq is not None
                and scheduler.state(sample_id) is SeqState.READY
                and carried[1] - carried[0] == len(seq.prompt_ids) + seq.response_len
            ):
                self._placed[sample_id] = (ref, *carried)
            else:
                self._placed.pop(sample_id, None)

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
