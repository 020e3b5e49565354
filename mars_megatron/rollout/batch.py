"""One engine call as it crosses Ray: its requests and its outputs as columns, not one object each.

A paper step makes about 15,000 segment requests in some 250 calls. Pickled one object at a time, each
request (its dataclass, its sampling params, its token array) and each output (its dataclass, two arrays,
its routing reference) costs Ray's serialiser a few microseconds per object on both sides, 100 µs and more
a sample in the driver (``tools/bench/control_plane.py``). As columns a call is a few objects whatever
its size: every request's tokens in one ``int32`` array with offsets, the budgets and seeds as tuples of
Python ints (which pickle without a reducer), the sampling shared by the call once; every output's tokens
and log-probs in one array each. Each side unpacks views, so the engines keep their
``generate(list[GenerationRequest])`` and the records their per-output appends.

A segment that continues a sequence need not carry its context again. The engine's side hands back,
with each output its token budget cut short, that request's whole context followed by the output
(``OutputBatch.carried``): the next segment's context, left in Ray's object store with the call's result.
The next request names it (``sources``: the results' references; ``spans``: which tokens of which), and
the engine's side fetches it from the store (:meth:`RequestBatch.requests`), so no decoded token goes
back through the driver (:class:`~mars_megatron.pipeline.contexts.ContextIndex` keeps where each context
is). A paper step's requests carried 1.8 times its trained tokens inline without this (each segment's
whole context) and 0.8 times with it (the first segments' prompts). One span, in the latest result, per
continuing request, rather than the prompt and every segment in the objects that first held them: each
reference an object carries costs the driver some 30 µs to put and to have resolved, about what 15,000
tokens cost to copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mars_megatron.agents.sample import RoutingRef, logprob_array, token_array
from mars_megatron.rollout.engine import FinishReason, GenerationOutput, GenerationRequest, SamplingParams


def _offsets(lengths: Sequence[int]) -> tuple[int, ...]:
    return (0, *np.cumsum(lengths, dtype=np.int64).tolist())


def _joined(items: Sequence[Sequence[Any]]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Each item's token parts, one after another in one ``int32`` array (one copy), and the offsets
    where each item starts (one more than the items)."""
    pieces = [token_array(p) for parts in items for p in parts]
    tokens = np.concatenate(pieces) if pieces else token_array([])
    return tokens, _offsets([sum(len(p) for p in parts) for parts in items])


Span = tuple[int, int, int]
"""``(source, start, stop)``: tokens ``start:stop`` of the token array that ``RequestBatch.sources[source]``
carries (:func:`carried_tokens`)."""

CARRIED: tuple[FinishReason, ...] = ("length",)
"""The outputs whose next context a call hands back: those its token budget cut (the others ended)."""

FETCH_TIMEOUT_S = 300.0
"""How long an engine waits for the objects a call's requests continue from: they are in the object
store already (or lost), so the wait is a transfer between nodes at most."""


class ContextLostError(RuntimeError):
    """An object a request's context was in is gone (its node died, or it was freed): the driver sends
    those requests again with their tokens."""


@dataclass(frozen=True)
class RequestBatch:
    """The requests of one engine call. Every request shares ``sampling`` but for its token budget and
    seed (a segment's); request ``i``'s prompt is ``tokens[offsets[i]:offsets[i + 1]]`` followed by the
    tokens its ``spans[i]`` name in ``sources`` (none when ``spans`` is empty)."""

    request_ids: tuple[str, ...]
    tokens: np.ndarray
    offsets: tuple[int, ...]
    max_tokens: tuple[int, ...]
    seeds: tuple[int | None, ...]
    sampling: SamplingParams
    sources: tuple[Any, ...] = ()
    """References (Ray ``ObjectRef`` s) of earlier calls' results that contexts are in."""
    spans: tuple[Span | None, ...] = ()
    """Per request, the context it continues after its inline tokens (None: none); empty: every context
    is inline."""

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if not (len(self.offsets) == n + 1 and len(self.max_tokens) == n and len(self.seeds) == n):
            raise ValueError(
                f"RequestBatch: {n} request ids, {len(self.offsets)} offsets, {len(self.max_tokens)} "
                f"budgets, {len(self.seeds)} seeds (offsets must be one more)"
            )
        if self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens):
            raise ValueError(
                f"RequestBatch: offsets span {self.offsets[0]}..{self.offsets[-1]}, "
                f"tokens hold {len(self.tokens)}"
            )
        if not self.spans:
            return
        if len(self.spans) != n:
            raise ValueError(f"RequestBatch: {n} request ids, spans for {len(self.spans)}")
        for rid, span in zip(self.request_ids, self.spans, strict=True):
            if span is None:
                continue
            source, start, stop = span
            if not (0 <= source < len(self.sources) and 0 <= start <= stop):
                raise ValueError(
                    f"RequestBatch: request {rid} names tokens {start}:{stop} of source {source} "
                    f"({len(self.sources)} sources)"
                )

    @classmethod
    def of(
        cls,
        request_ids: Sequence[str],
        prompts: Sequence[Sequence[np.ndarray]],
        max_tokens: Sequence[int],
        seeds: Sequence[int | None],
        sampling: SamplingParams,
        sources: Sequence[Any] = (),
        spans: Sequence[Span | None] = (),
    ) -> RequestBatch:
        """``prompts[i]``: request ``i``'s inline prompt as consecutive parts (a segment's input, then the
        tokens decoded so far), copied once into the batch's array; ``spans[i]``: what follows it, by
        reference."""
        tokens, offsets = _joined(prompts)
        return cls(
            tuple(request_ids),
            tokens,
            offsets,
            tuple(max_tokens),
            tuple(seeds),
            sampling,
            tuple(sources),
            tuple(spans),
        )

    @classmethod
    def of_requests(cls, requests: Sequence[GenerationRequest]) -> RequestBatch:
        """Requests made one by one, which must share their sampling but for budget and seed."""
        if not requests:
            raise ValueError("RequestBatch.of_requests: no requests")
        shared = requests[0].sampling
        for r in requests:
            if r.sampling.with_budget(shared.max_tokens, shared.seed) != shared:
                raise ValueError(
                    f"RequestBatch: request {r.request_id} samples with {r.sampling}, the call with "
                    f"{shared}: one call shares its sampling but for budget and seed"
                )
        return cls.of(
            [r.request_id for r in requests],
            [(np.asarray(r.prompt_ids),) for r in requests],
            [r.sampling.max_tokens for r in requests],
            [r.sampling.seed for r in requests],
            shared,
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    def requests(self) -> list[GenerationRequest]:
        """The requests (for the engine): each prompt a view of the batch's array or, where it continues
        a context, of that context fetched from the object store (views of its read-only buffer, or a
        copy in the engine's process where a request has both)."""
        carried = fetch_sources(self.sources, self.request_ids) if self.sources else []
        o, columns = self.offsets, zip(self.request_ids, self.max_tokens, self.seeds, strict=True)
        out = []
        for i, (rid, budget, seed) in enumerate(columns):
            prompt = self.tokens[o[i] : o[i + 1]]
            span = self.spans[i] if self.spans else None
            if span is not None:
                source, start, stop = span
                more = carried[source][start:stop]
                prompt = np.concatenate((prompt, more)) if len(prompt) else more
            out.append(GenerationRequest(rid, prompt, self.sampling.with_budget(budget, seed)))
        return out


@dataclass(frozen=True)
class OutputBatch:
    """The outputs of one engine call, in request order: output ``i``'s tokens and log-probs are
    ``tokens[offsets[i]:offsets[i + 1]]`` and the same slice of ``logprobs`` (the record's types)."""

    request_ids: tuple[str, ...]
    tokens: np.ndarray
    logprobs: np.ndarray
    offsets: tuple[int, ...]
    finish_reasons: tuple[FinishReason, ...]
    routing: tuple[np.ndarray | RoutingRef | None, ...]
    extras: tuple[dict[str, Any], ...] = field(default=())
    """Per output; empty when no output has any (the usual case: nothing to pickle)."""
    carried: np.ndarray | None = None
    """The next context of each output in :data:`CARRIED` (its request's prompt, then the output), at
    ``carried[carried_offsets[i]:carried_offsets[i + 1]]`` (empty for the others); None: not carried."""
    carried_offsets: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        outputs: Sequence[GenerationOutput],
        routing_by_reference: bool,
        prompts: Sequence[np.ndarray] | None = None,
    ) -> OutputBatch:
        """An engine's outputs for the driver. With ``routing_by_reference`` (a Ray actor) each output's
        R3 routing is left in this process's object store (:class:`RoutingRef`): the trainer rank that
        trains the sample fetches it, and the driver never holds it. With the requests' ``prompts``, each
        output the budget cut carries its next context (:attr:`carried`)."""
        ids = [token_array(o.token_ids) for o in outputs]
        lps = [logprob_array(o.logprobs) for o in outputs]
        for o, i, lp in zip(outputs, ids, lps, strict=True):
            if len(i) != len(lp):
                raise ValueError(f"output {o.request_id}: {len(i)} tokens but {len(lp)} log-probs")
        routing = tuple(
            RoutingRef.put(o.routed_experts)
            if routing_by_reference and isinstance(o.routed_experts, np.ndarray)
            else o.routed_experts
            for o in outputs
        )
        carried, carried_offsets = None, ()
        if prompts is not None:
            carried, carried_offsets = _joined(
                [
                    (p, i) if o.finish_reason in CARRIED and len(i) else ()
                    for o, p, i in zip(outputs, prompts, ids, strict=True)
                ]
            )
        return cls(
            tuple(o.request_id for o in outputs),
            np.concatenate(ids) if ids else token_array([]),
            np.concatenate(lps) if lps else logprob_array([]),
            _offsets([len(i) for i in ids]),
            tuple(o.finish_reason for o in outputs),
            routing,
            tuple(o.extra for o in outputs) if any(o.extra for o in outputs) else (),
            carried,
            carried_offsets,
        )

    def next_context(self, i: int) -> tuple[int, int] | None:
        """Where output ``i``'s next context is in :attr:`carried` (None: not carried)."""
        if self.carried is None or self.carried_offsets[i + 1] == self.carried_offsets[i]:
            return None
        return self.carried_offsets[i], self.carried_offsets[i + 1]

    def __len__(self) -> int:
        return len(self.request_ids)

    def outputs(self) -> list[GenerationOutput]:
        """The outputs, tokens and log-probs views of the batch's arrays (a record keeps a first segment
        as such a view, and copies later ones onto it)."""
        o = self.offsets
        return [
            GenerationOutput(
                rid,
                self.tokens[o[i] : o[i + 1]],
                self.logprobs[o[i] : o[i + 1]],
                finish,
                dict(self.extras[i]) if self.extras else {},
                routed,
            )
            for i, (rid, finish, routed) in enumerate(
                zip(self.request_ids, self.finish_reasons, self.routing, strict=True)
            )
        ]


def answer(
    batch: RequestBatch,
    generate: Callable[[list[GenerationRequest]], list[GenerationOutput]],
    routing_by_reference: bool,
) -> OutputBatch:
    """One engine call from its batch to its result: the requests (their continued contexts fetched),
    ``generate``, and the outputs as columns, each one the budget cut carrying its next context."""
    requests = batch.requests()
    return OutputBatch.of(generate(requests), routing_by_reference, [r.prompt_ids for r in requests])


def carried_tokens(obj: Any) -> np.ndarray:
    """The contexts an engine call's result carries (an ``OutputBatch``, or a tuple whose first item is
    one: its :attr:`~OutputBatch.carried`)."""
    if isinstance(obj, tuple) and obj:
        obj = obj[0]
    if isinstance(obj, OutputBatch) and obj.carried is not None:
        return obj.carried
    raise TypeError(f"a request continues from a {type(obj).__name__} that carries no contexts")


def fetch_sources(sources: Sequence[Any], request_ids: Sequence[str]) -> list[np.ndarray]:
    """The token arrays ``sources`` (object references) carry, fetched from the object store (views of
    its read-only buffers where they are large). A lost object raises :class:`ContextLostError`, as does
    one not there within :data:`FETCH_TIMEOUT_S`."""
    import ray

    try:
        return [carried_tokens(obj) for obj in ray.get(list(sources), timeout=FETCH_TIMEOUT_S)]
    except (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError) as e:
        raise ContextLostError(
            f"the context of requests {', '.join(request_ids[:4])}{' ...' if len(request_ids) > 4 else ''} "
            f"is not in the object store ({type(e).__name__}): they are sent again with their tokens"
        ) from None
