"""Where the trainer ranks and the rollout engines run: bundles of one Ray placement group.

* ``colocated``: trainer rank ``i`` and rollout engine ``i`` share bundle ``i`` (one device each bundle),
  each asking for half of it. The engines sleep while the trainer updates (their memory freed on GPUs)
  and wake for the weight sync, so rollouts and training take turns on the same devices.
* ``disaggregated``: separate bundles — trainer ranks on the first ones, engines on the rest — so
  rollouts continue while the trainer trains (the agentic pipeline's overlap).

A bundle is ``{"CPU": cpus, "GPU": 1}`` when the cluster has GPUs, ``{"CPU": cpus}`` otherwise. Ray's
GPUs are logical resources, so ``ray.init(num_gpus=N)`` on a CPU machine checks a placement exactly as
a GPU node would (the tests do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

PlacementMode = Literal["colocated", "disaggregated"]


@dataclass
class Placement:
    mode: PlacementMode
    group: Any
    """The Ray placement group."""
    trainer_bundles: list[int]
    engine_bundles: list[int]
    share: float
    """Fraction of a bundle each actor asks for (1/2 colocated, 1 disaggregated)."""
    bundle: dict[str, float]

    def resources(self) -> dict[str, float]:
        """``num_cpus``/``num_gpus`` of one actor on its bundle."""
        return {
            "num_cpus": self.bundle["CPU"] * self.share,
            "num_gpus": self.bundle.get("GPU", 0.0) * self.share,
        }

    def strategy(self, bundle_index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle_index
        )

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def place(
    mode: PlacementMode,
    trainer_ranks: int,
    engines: int,
    *,
    cpus_per_bundle: float = 1.0,
    timeout_s: float = 300.0,
) -> Placement:
    """Reserve the bundles for ``trainer_ranks`` + ``engines`` actors in ``mode``; raises naming what the
    cluster lacks when it cannot grant them within ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group

    if trainer_ranks < 1 or engines < 1:
        raise ValueError(f"place: need >= 1 trainer rank and engine, got {trainer_ranks} and {engines}")
    if mode not in ("colocated", "disaggregated"):
        raise ValueError(f"pipeline.placement must be 'colocated' or 'disaggregated', got {mode!r}")
    bundle = {"CPU": float(cpus_per_bundle)}
    if ray.cluster_resources().get("GPU", 0) > 0:
        bundle["GPU"] = 1.0
    if mode == "colocated":
        n = max(trainer_ranks, engines)
        trainer, engine_bundles, share = list(range(trainer_ranks)), [i % n for i in range(engines)], 0.5
    else:
        n = trainer_ranks + engines
        trainer, engine_bundles, share = list(range(trainer_ranks)), list(range(trainer_ranks, n)), 1.0
    group = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"pipeline.placement={mode}: the cluster did not grant {n} x {bundle} within {timeout_s:.0f}s "
            f"({trainer_ranks} trainer ranks, {engines} engines); available: {ray.available_resources()}"
        ) from None
    return Placement(mode, group, trainer, engine_bundles, share, bundle)
