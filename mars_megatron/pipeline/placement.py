"""Where the trainer ranks and the rollout engines run: bundles of one Ray placement group.

* ``colocated``: trainer rank ``i`` and rollout engine ``i`` share bundle ``i`` (one device each bundle),
  each asking for half of it. The engines sleep while the trainer updates (their memory freed on GPUs)
  and wake for the weight sync, so rollouts and training take turns on the same devices.
* ``disaggregated``: separate bundles — trainer ranks on the first ones, engines on the rest — so
  rollouts continue while the trainer trains (the agentic pipeline's overlap).

A bundle is ``{"CPU": cpus, "GPU": 1}`` when the cluster has GPUs, ``{"CPU": cpus}`` otherwise; a
disaggregated engine's bundle holds ``engine_gpus`` GPUs (``rollout.tp``: vLLM's tensor-parallel size). Ray's
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
    """A trainer rank's bundle (colocated: shared with an engine)."""
    engine_bundle: dict[str, float]
    """An engine's bundle: ``bundle`` when colocated, its own (maybe several GPUs) when disaggregated."""

    def resources(self) -> dict[str, float]:
        """``num_cpus``/``num_gpus`` of one trainer rank on its bundle."""
        return _share(self.bundle, self.share)

    def engine_resources(self) -> dict[str, float]:
        """``num_cpus``/``num_gpus`` of one rollout engine on its bundle."""
        return _share(self.engine_bundle, self.share)

    def strategy(self, bundle_index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle_index
        )

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def _share(bundle: dict[str, float], share: float) -> dict[str, float]:
    return {"num_cpus": bundle["CPU"] * share, "num_gpus": bundle.get("GPU", 0.0) * share}


def place(
    mode: PlacementMode,
    trainer_ranks: int,
    engines: int,
    *,
    engine_gpus: int = 1,
    cpus_per_bundle: float = 1.0,
    timeout_s: float = 300.0,
) -> Placement:
    """Reserve the bundles for ``trainer_ranks`` + ``engines`` actors in ``mode``, each disaggregated engine
    with ``engine_gpus`` GPUs when the cluster has GPUs; raises naming what the cluster lacks when it
    cannot grant them within ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group

    if trainer_ranks < 1 or engines < 1:
        raise ValueError(f"place: need >= 1 trainer rank and engine, got {trainer_ranks} and {engines}")
    if mode not in ("colocated", "disaggregated"):
        raise ValueError(f"pipeline.placement must be 'colocated' or 'disaggregated', got {mode!r}")
    if engine_gpus < 1 or (mode == "colocated" and engine_gpus != 1):
        raise ValueError(f"place: {mode} engines take 1 device each, got engine_gpus={engine_gpus}")
    bundle = {"CPU": float(cpus_per_bundle)}
    engine_bundle = dict(bundle)
    if ray.cluster_resources().get("GPU", 0) > 0:
        bundle["GPU"], engine_bundle["GPU"] = 1.0, float(engine_gpus)
    if mode == "colocated":
        n = max(trainer_ranks, engines)
        trainer, engine_bundles, share = list(range(trainer_ranks)), [i % n for i in range(engines)], 0.5
        bundles = [dict(bundle) for _ in range(n)]
        engine_bundle = bundle
    else:
        n = trainer_ranks + engines
        trainer, engine_bundles, share = list(range(trainer_ranks)), list(range(trainer_ranks, n)), 1.0
        bundles = [dict(bundle) for _ in range(trainer_ranks)] + [dict(engine_bundle) for _ in range(engines)]
    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        wanted = f"{n} x {bundle}"
        if engine_bundle != bundle:
            wanted = f"{trainer_ranks} x {bundle} + {engines} x {engine_bundle}"
        raise RuntimeError(
            f"pipeline.placement={mode}: the cluster did not grant {wanted} within {timeout_s:.0f}s "
            f"({trainer_ranks} trainer ranks, {engines} engines); available: {ray.available_resources()}"
        ) from None
    return Placement(mode, group, trainer, engine_bundles, share, bundle, engine_bundle)
