"""One engine call as it crosses Ray: its requests and its outputs as columns, not one object each.

A paper step makes about 15,000 segment requests in some 250 calls. Pickled one object at a time, each
request (its dataclass, its sampling params, its token array) and each output (its dataclass, two arrays,
its routing reference) costs Ray's serialiser a few microseconds per object on both sides, 100 µs and more
a sample in the driver (``tools/bench/control_plane.py``). As columns a call is a few objects whatever
its size: every request's tokens in one ``int32`` array with offsets, the budgets and seeds as tuples of
Python ints (which pickle without a reducer), the sampling shared by the call once; every output's tokens
and log-probs in one array each. Each side unpacks views, so the engines keep their
``generate(list[GenerationRequest])`` and the records their per-output appends.

A segment that continues a sequence need not carry its context again: its prompt was in an earlier
call's ``RequestBatch`` and its tokens so far in earlier calls' ``OutputBatch`` es, all still in Ray's
object store. Such a request names them (``sources``: the objects' references; ``spans``: which tokens
of which), and the engine's side fetches them from the store (:meth:`RequestBatch.requests`): nothing
of the context passes through the driver again (:class:`~mars_megatron.pipeline.contexts.ContextIndex`
keeps where each context is). A paper step sends about 1.8 times its trained tokens inline without this
(each segment's whole context), and only the first segments' prompts with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mars_megatron.agents.sample import RoutingRef, logprob_array, token_array
from mars_megatron.rollout.engine import FinishReason, GenerationOutput, GenerationRequest, SamplingParams


def _offsets(lengths: Sequence[int]) -> tuple[int, ...]:
    return (0, *np.cumsum(lengths, dtype=np.int64).tolist())


Span = tuple[int, int, int]
"""``(source, start, stop)``: tokens ``start:stop`` of the token array that ``RequestBatch.sources[source]``
carries (:func:`carried_tokens`)."""

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
    """References (Ray ``ObjectRef`` s) of earlier calls' ``RequestBatch`` es and results."""
    spans: tuple[tuple[Span, ...], ...] = ()
    """Per request, the parts of its context after its inline tokens; empty: every context is inline."""

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
        for rid, spans in zip(self.request_ids, self.spans, strict=True):
            for source, start, stop in spans:
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
        spans: Sequence[tuple[Span, ...]] = (),
    ) -> RequestBatch:
        """``prompts[i]``: request ``i``'s inline prompt as consecutive parts (a segment's input, then the
        tokens decoded so far), copied once into the batch's array; ``spans[i]``: what follows it, by
        reference."""
        lengths = [sum(len(p) for p in parts) for parts in prompts]
        pieces = [token_array(p) for parts in prompts for p in parts]
        tokens = np.concatenate(pieces) if pieces else token_array([])
        return cls(
            tuple(request_ids),
            tokens,
            _offsets(lengths),
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
        """The requests (for the engine): each prompt a view of the batch's array, or, where it continues
        from earlier objects, those fetched from the object store and joined (a copy in the engine's
        process, not the driver's)."""
        carried = fetch_sources(self.sources, self.request_ids) if self.sources else []
        o, columns = self.offsets, zip(self.request_ids, self.max_tokens, self.seeds, strict=True)
        out = []
        for i, (rid, budget, seed) in enumerate(columns):
            prompt = self.tokens[o[i] : o[i + 1]]
            if self.spans and self.spans[i]:
                prompt = np.concatenate([prompt, *(carried[s][a:b] for s, a, b in self.spans[i])])
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

    @classmethod
    def of(cls, outputs: Sequence[GenerationOutput], routing_by_reference: bool) -> OutputBatch:
        """An engine's outputs for the driver. With ``routing_by_reference`` (a Ray actor) each output's
        R3 routing is left in this process's object store (:class:`RoutingRef`): the trainer rank that
        trains the sample fetches it, and the driver never holds it."""
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
        return cls(
            tuple(o.request_id for o in outputs),
            np.concatenate(ids) if ids else token_array([]),
            np.concatenate(lps) if lps else logprob_array([]),
            _offsets([len(i) for i in ids]),
            tuple(o.finish_reason for o in outputs),
            routing,
            tuple(o.extra for o in outputs) if any(o.extra for o in outputs) else (),
        )

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


def carried_tokens(obj: Any) -> np.ndarray:
    """The token array of an object a request can continue from: a ``RequestBatch`` (the prompts it
    carried), an ``OutputBatch``, or an engine call's result whose first item is one."""
    if isinstance(obj, tuple) and obj:
        obj = obj[0]
    if not isinstance(obj, RequestBatch | OutputBatch):
        raise TypeError(f"a request continues from a {type(obj).__name__}, which carries no tokens")
    return obj.tokens


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
