"""Routing replay for Megatron-Core's MoE routers (``moe.routing_replay``).

A MoE model's log-prob of a token depends on which experts each position was routed to, and that choice
is a top-k over router logits: a tiny numerical difference between the rollout engine and the trainer
(other kernels, bf16, FP8, a different TP layout) flips near-ties and sends a token through other
experts. The trainer then scores tokens with a network the engine never ran, and its log-probs drift
from the engine's. Replay removes that source of mismatch:

* **R3** (rollout routing replay): the trainer uses the experts the engine picked for every position
  (``GenerationOutput.routed_experts``), in every forward of the batch (old, reference and new
  log-probs). The gate weights are still the trainer's: the router's scores of the replayed experts,
  renormalised as its top-k would be, so the router keeps its gradient.
* **R2** (trainer routing replay): the first forward of a batch (the old log-probs) records the
  trainer's own routing, and later forwards of the same packs (reference, and every update of
  ``train.updates_per_batch``) replay it, so the old/new/ref ratios compare one network.

Megatron's router calls ``router_replay.get_replay_topk`` when its ``router_replay`` is set; this module
puts a :class:`RouterReplay` on every ``TopKRouter`` of a model chunk (instead of Megatron's class, whose
process-global instance list mixes the policy's routers with the reference model's), each knowing its MoE
layer from the router's global ``layer_number``, so pipeline stages replay their own layers.

Shapes: routing for a micro-batch is ``[b, s, moe_layers, k]`` in its full layout, ``ROUTE_FREE`` where
none is given (pad tokens, each sample's last token, which the engine never fed back). A rank takes the
same columns as its tokens (context parallelism), then its sequence-parallel slice (``s / tp``), and
flattens it the way the router flattens its ``[s, b, h]`` input. Positions marked free are routed by
the trainer's router as usual.

Full recompute runs each layer's forward twice in a training step: once without grad (the checkpointed
forward) and once with grad during the backward. The second must see the same routing, but by then later
micro-batches may have set theirs (pipeline 1F1B), so each router queues what it replayed in the first
pass and the recompute takes from that queue, in order (backward order is forward order per stage).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

ROUTE_FREE = -1
"""A position with no routing to replay: the trainer's router chooses."""
RoutingReplayMode = Literal["off", "R2", "R3"]
ROUTING_REPLAY_MODES: tuple[RoutingReplayMode, ...] = ("off", "R2", "R3")
RoutingStore = dict[int, dict[int, torch.Tensor]]
"""R2's recorded routing: per pack (``id(micro_batch.pack)``), per MoE layer, this rank's
``[local tokens, k]`` expert ids."""

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class RoutingError(ValueError):
    """Routing that cannot be replayed (wrong shape, expert ids out of range); names the sample."""


def check_routing(
    sample_id: str, routed: np.ndarray, tokens: int, moe_layers: int, topk: int, num_experts: int
) -> None:
    """A sample's routing must cover every position the engine fed (``tokens - 1``), every MoE layer
    and the router's top-k, with expert ids in ``[0, num_experts)``."""
    expected = (tokens - 1, moe_layers, topk)
    if tuple(routed.shape) != expected:
        raise RoutingError(
            f"sample {sample_id!r}: routed_experts has shape {tuple(routed.shape)}, expected {expected} "
            f"(positions = {tokens} tokens - 1, MoE layers, top-k)"
        )
    if routed.size and (int(routed.min()) < 0 or int(routed.max()) >= num_experts):
        raise RoutingError(
            f"sample {sample_id!r}: routed_experts holds expert ids in [{int(routed.min())}, "
            f"{int(routed.max())}], the model has experts 0..{num_experts - 1}"
        )
    ordered = np.sort(routed.reshape(-1, topk), axis=-1) if routed.size else routed
    if routed.size and topk > 1 and bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise RoutingError(
            f"sample {sample_id!r}: routed_experts names one expert twice among a token's top-{topk} (a "
            "router picks distinct experts)"
        )


def pack_routing(
    routing: Sequence[np.ndarray | None],
    spans: Sequence[tuple[int, int]],
    length: int,
    moe_layers: int,
    topk: int,
) -> torch.Tensor:
    """Routing of one pack, ``[1, length, moe_layers, k]`` (int16): sample j's rows at its span (as many
    as the span holds: a truncated sample keeps its first ones), ``ROUTE_FREE`` elsewhere."""
    out = torch.full((1, length, moe_layers, topk), ROUTE_FREE, dtype=torch.int16)
    for rows, (start, end) in zip(routing, spans, strict=True):
        if rows is None:
            continue
        n = min(end - start, rows.shape[0])
        out[0, start : start + n] = torch.from_numpy(np.ascontiguousarray(rows[:n]).astype(np.int16))
    return out


def batch_routing(
    routing: Sequence[np.ndarray | None], length: int, moe_layers: int, topk: int
) -> torch.Tensor:
    """Routing of a padded micro-batch (one sequence per row, from position 0): ``[b, length, L, k]``."""
    return torch.cat(
        [pack_routing([rows], [(0, length)], length, moe_layers, topk) for rows in routing], dim=0
    )


def local_routing(routing: torch.Tensor, tp_rank: int, tp: int, sequence_parallel: bool) -> torch.Tensor:
    """This rank's rows of a micro-batch's routing ``[b, s, L, k]`` (its CP columns already selected),
    flattened in the router's token order: ``[s_local * b, L, k]``."""
    if sequence_parallel and tp > 1:
        chunk = routing.shape[1] // tp
        routing = routing[:, tp_rank * chunk : (tp_rank + 1) * chunk]
    return routing.transpose(0, 1).reshape(-1, routing.shape[2], routing.shape[3])


class RouterReplay:
    """Stands in for Megatron's ``RouterReplay`` on one router: chooses the top-k it replays."""

    def __init__(self, moe_layer: int) -> None:
        self.moe_layer = moe_layer
        self.mode: Literal["free", "replay"] = "free"
        self.target: torch.Tensor | None = None  # [tokens, k] long, ROUTE_FREE rows allowed
        self.used: torch.Tensor | None = None  # the experts of the last forward (R2 records these)
        self.recompute = False  # full recompute in a training step: queue targets for the backward
        self.pending: deque[torch.Tensor | None] = deque()
        # A batch's first forward under the pre-update weights (a scoring forward, or the update's own)
        # also counts how often the router's own top-k differs from the replayed one: the routing
        # mismatch that replay removes (replayed rows, rows whose expert set differs).
        self.measure = False
        self.counts = [0, 0]

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        probs, indices = self._topk(scores, topk, num_groups, group_topk, default_compute_topk)
        self.used = indices.detach()
        return probs, indices

    def _topk(
        self, scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None, default: TopK
    ) -> tuple[torch.Tensor, torch.Tensor]:
        default_compute_topk = default
        if self.mode == "free":
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target, measure = self.target, self.measure
        if self.recompute:
            if torch.is_grad_enabled():  # the recompute in the backward: this micro-batch's target
                target, measure = self.pending.popleft(), False  # (counted in its first pass)
            else:
                self.pending.append(target)
        if target is None:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = target.to(scores.device)
        if target.shape != (scores.shape[0], topk):
            raise RoutingError(
                f"MoE layer {self.moe_layer}: replay routing for {tuple(target.shape)} (tokens, k), the "
                f"router sees {scores.shape[0]} tokens with top-{topk}"
            )
        free = target[:, 0] == ROUTE_FREE
        if bool(free.any()) or measure:
            _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if measure:
                differs = (own.sort(dim=1).values != target.sort(dim=1).values).any(dim=1) & ~free
                self.counts[0] += int((~free).sum())
                self.counts[1] += int(differs.sum())
            target = torch.where(free[:, None], own, target)
        return scores.gather(1, target), target


def install(model: Any, moe_layers: Sequence[bool]) -> list[RouterReplay]:
    """Put a :class:`RouterReplay` on every ``TopKRouter`` of ``model`` (this rank's chunk); returns them
    in layer order. The router's global 1-based ``layer_number`` gives its MoE layer index."""
    from megatron.core.transformer.moe.router import TopKRouter

    before = [sum(moe_layers[:i]) for i in range(len(moe_layers))]
    replays = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            if module.config.moe_router_fusion:
                raise RoutingError("routing replay needs moe_router_fusion off (the fused top-k has no hook)")
            replay = RouterReplay(before[module.layer_number - 1])
            module.router_replay = replay
            replays.append(replay)
    return sorted(replays, key=lambda r: r.moe_layer)


class ReplayControl:
    """The routers of one engine and what they do for the next micro-batch."""

    def __init__(self, replays: Sequence[RouterReplay]) -> None:
        self.replays = list(replays)

    def set_recompute(self, on: bool) -> None:
        for r in self.replays:
            r.recompute = on
            r.pending.clear()

    def free(self) -> None:
        for r in self.replays:
            r.mode, r.target = "free", None

    def set_measure(self, on: bool) -> None:
        for r in self.replays:
            r.measure = on

    def changes(self) -> tuple[int, int]:
        """(replayed routing decisions, those where the router's own top-k chose other experts) in the
        forwards that measured (:meth:`set_measure`) since the last call, over this rank's routers;
        resets the counts."""
        replayed = changed = 0
        for r in self.replays:
            replayed, changed = replayed + r.counts[0], changed + r.counts[1]
            r.counts = [0, 0]
        return replayed, changed

    def used(self) -> dict[int, torch.Tensor]:
        """The experts each router used in the forward that just ran (what R2 records)."""
        out = {}
        for r in self.replays:
            if r.used is None:
                raise RuntimeError(f"MoE layer {r.moe_layer}: its router did not run in this forward")
            out[r.moe_layer] = r.used
            r.used = None
        return out

    def replay(self, targets: Mapping[int, torch.Tensor]) -> None:
        for r in self.replays:
            r.mode, r.target = "replay", targets[r.moe_layer].long()
