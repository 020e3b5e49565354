"""Where the trainer ranks and the rollout engines run: bundles of one Ray placement group, and what each
engine actor is started with.

* ``colocated``: trainer ranks and rollout engines share bundles, each asking for half of one. The
  engines sleep while the trainer updates (their memory freed on GPUs) and wake for the weight sync, so
  rollouts and training take turns on the same devices.
* ``disaggregated``: separate bundles — trainer ranks on the first ones, engines on the rest — so
  rollouts continue while the trainer trains (the agentic pipeline's overlap).
* ``none`` (no placement group): Ray places every actor; :func:`unplaced_launch` still gives each engine
  GPUs of its own on a GPU cluster.

Every bundle is one device: ``{"CPU": cpus, "GPU": 1}`` when the cluster has GPUs, ``{"CPU": cpus}``
otherwise. An engine of ``rollout.tp`` GPUs spans that many bundles, one per vLLM worker, because vLLM's
Ray executor refuses bundles of more than one GPU (``vllm/v1/executor/ray_utils.py``,
``initialize_ray_cluster``). Such an engine's actor holds no GPU itself: it runs vLLM's engine core, and
the ``VLLM_RAY_BUNDLE_INDICES`` / ``VLLM_RAY_PER_WORKER_GPUS`` variables of its environment tell vLLM's
executor which bundles of the (current) placement group its workers take and what share of each GPU (the
layout of vLLM's own RLHF colocation example). An engine of one GPU holds its share of its bundle and
runs the model in its own process.

Ray's GPUs are logical resources, so ``ray.init(num_gpus=N)`` on a CPU machine checks a placement exactly
as a GPU node would (the tests do, and run vLLM's own bundle check against it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

PlacementMode = Literal["colocated", "disaggregated"]


@dataclass(frozen=True)
class EngineLaunch:
    """How to start one rollout engine actor: its own resources and its environment (its bundle, when
    placed, is the first of :attr:`Placement.engine_bundles`)."""

    num_cpus: float
    num_gpus: float
    """GPUs the actor itself holds: its share of one GPU for a one-GPU engine, 0 when vLLM's workers
    hold them (``rollout.tp`` > 1) or when the engine runs on the host."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of the actor (Ray ``runtime_env``): for a multi-GPU engine, where vLLM's Ray executor
    puts its workers (:func:`worker_env`)."""


def worker_env(bundles: tuple[int, ...], share: float) -> dict[str, str]:
    """The variables vLLM's Ray executor reads to place a multi-GPU engine's workers (vLLM 0.32
    ``envs.py``): one worker per listed bundle, each taking ``share`` of that bundle's GPU."""
    return {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundles)), "VLLM_RAY_PER_WORKER_GPUS": str(share)}


@dataclass
class Placement:
    mode: PlacementMode
    group: Any
    """The Ray placement group."""
    trainer_bundles: list[int]
    engine_bundles: list[tuple[int, ...]]
    """Per engine, the bundles of its ``rollout.tp`` devices (the first one also holds its actor)."""
    share: float
    """Fraction of a bundle each actor asks for (1/2 colocated, 1 disaggregated)."""
    bundle: dict[str, float]
    """Every bundle of the group (one device and its CPUs)."""

    def resources(self) -> dict[str, float]:
        """``num_cpus``/``num_gpus`` of one trainer rank on its bundle."""
        return {
            "num_cpus": self.bundle["CPU"] * self.share,
            "num_gpus": self.bundle.get("GPU", 0.0) * self.share,
        }

    def engine_launch(self, index: int) -> EngineLaunch:
        """How to start engine ``index`` on its bundles."""
        bundles = self.engine_bundles[index]
        own = self.resources()
        if len(bundles) == 1:
            return EngineLaunch(own["num_cpus"], own["num_gpus"])
        return EngineLaunch(own["num_cpus"], 0.0, worker_env(bundles, self.share))

    def strategy(self, bundle_index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=bundle_index
        )

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def layout(
    mode: PlacementMode, trainer_ranks: int, engines: int, engine_gpus: int
) -> tuple[int, list[int], list[tuple[int, ...]]]:
    """(bundles in the group, trainer ranks' bundles, each engine's bundles). Pure.

    Colocated: engine ``k`` shares devices ``k*tp .. k*tp+tp-1`` with the trainer ranks there; the group
    has as many bundles as the larger side needs. Disaggregated: trainer ranks first, then each engine's
    ``tp`` devices."""
    if trainer_ranks < 1 or engines < 1:
        raise ValueError(f"place: need >= 1 trainer rank and engine, got {trainer_ranks} and {engines}")
    if engine_gpus < 1:
        raise ValueError(f"place: engines take >= 1 device each, got engine_gpus={engine_gpus}")
    if mode == "colocated":
        first = 0
        n = max(trainer_ranks, engines * engine_gpus)
    elif mode == "disaggregated":
        first = trainer_ranks
        n = trainer_ranks + engines * engine_gpus
    else:
        raise ValueError(f"pipeline.placement must be 'colocated' or 'disaggregated', got {mode!r}")
    engine_bundles = [
        tuple(range(first + k * engine_gpus, first + (k + 1) * engine_gpus)) for k in range(engines)
    ]
    return n, list(range(trainer_ranks)), engine_bundles


def place(
    mode: PlacementMode,
    trainer_ranks: int,
    engines: int,
    *,
    engine_gpus: int = 1,
    cpus_per_bundle: float = 1.0,
    timeout_s: float = 300.0,
) -> Placement:
    """Reserve the bundles for ``trainer_ranks`` + ``engines`` actors in ``mode``, each engine over
    ``engine_gpus`` devices (:func:`layout`); raises naming what the cluster lacks when it cannot grant
    them within ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group

    n, trainer, engine_bundles = layout(mode, trainer_ranks, engines, engine_gpus)
    bundle = {"CPU": float(cpus_per_bundle)}
    if ray.cluster_resources().get("GPU", 0) > 0:
        bundle["GPU"] = 1.0
    group = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"pipeline.placement={mode}: the cluster did not grant {n} x {bundle} within {timeout_s:.0f}s "
            f"({trainer_ranks} trainer ranks, {engines} engines of {engine_gpus} devices); available: "
            f"{ray.available_resources()}"
        ) from None
    return Placement(mode, group, trainer, engine_bundles, 0.5 if mode == "colocated" else 1.0, bundle)


def unplaced_gpus(
    cluster_gpus: float, trainer_ranks: int, engines: int, engine_gpus: int, *, vllm: bool
) -> int:
    """``pipeline.placement=none``: how many GPUs each engine needs of its own. Pure.

    On a cluster with GPUs every trainer rank holds one, and a vLLM engine ``engine_gpus`` more: an actor
    that asks Ray for no GPU sees every device of its node (Ray leaves ``CUDA_VISIBLE_DEVICES`` unset),
    so vLLM would start on GPU 0 beside trainer rank 0 and take 90 % of it. Too few GPUs for both is an
    error naming the way to share them. The transformers engine and CPU clusters need none."""
    if cluster_gpus <= 0 or not vllm:
        return 0
    need = trainer_ranks + engines * engine_gpus
    if cluster_gpus < need:
        from mars_megatron.config import ConfigError

        raise ConfigError(
            f"'none' on a Ray cluster of {cluster_gpus:g} GPUs: {trainer_ranks} trainer ranks and {engines} "
            f"vLLM engines of rollout.tp={engine_gpus} need {need} GPUs of their own; set "
            "pipeline.placement=colocated to share the trainer's GPUs with the engines",
            "pipeline.placement",
        )
    return engine_gpus


def unplaced_launch(engine_gpus: int, gpus: int, num_cpus: float = 1.0) -> EngineLaunch:
    """How to start an engine without a placement group that needs ``gpus`` GPUs (:func:`unplaced_gpus`):
    a one-GPU engine holds its GPU; a multi-GPU engine's workers hold theirs (vLLM's Ray executor then
    reserves a placement group of ``engine_gpus`` one-GPU bundles itself)."""
    return EngineLaunch(num_cpus, float(gpus) if engine_gpus == 1 else 0.0)
