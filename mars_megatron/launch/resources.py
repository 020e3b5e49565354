"""GPUs of a MarsRL run: how many the rollout engines hold and how many trainer ranks the rest make.

``pipeline.placement=disaggregated`` gives every engine ``rollout.tp`` GPUs of its own, so the trainer gets
what is left; so does ``none`` for vLLM engines (Ray places them, but on GPUs of their own:
:func:`~mars_megatron.pipeline.placement.unplaced_gpus`; the transformers engine runs on the host).
``colocated`` engines share the trainer's devices, so there every GPU is a trainer rank.
"""

from __future__ import annotations

from mars_megatron.config import ConfigError, MarsConfig


def rollout_engines(cfg: MarsConfig) -> int:
    """Rollout engines of a run: ``pipeline.rollout_workers`` per policy."""
    from mars_megatron.agents.graph_file import policy_names

    return cfg.pipeline.rollout_workers * len(policy_names(cfg))


def engine_gpus(cfg: MarsConfig) -> int:
    """GPUs the rollout engines hold: every engine ``rollout.tp`` of them."""
    return rollout_engines(cfg) * cfg.rollout.tp


def trainer_world_size(cfg: MarsConfig, gpus: int) -> int:
    """Trainer ranks on ``gpus`` GPUs: all of them when colocated, otherwise what the engines leave.
    Raises :class:`ConfigError` naming the field when nothing is left or the layout does not divide it."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive int, got {gpus!r}")
    world = gpus
    placement, engines, held = cfg.pipeline.placement, rollout_engines(cfg), engine_gpus(cfg)
    if placement == "disaggregated" or (placement == "none" and cfg.rollout.engine == "vllm"):
        if held >= gpus:
            raise ConfigError(
                f"{engines} rollout engines x rollout.tp {cfg.rollout.tp} = {held} GPUs leave no trainer "
                f"rank of {gpus} GPUs (pipeline.placement={placement})",
                "pipeline.rollout_workers",
            )
        world = gpus - held
    elif placement == "colocated" and held > gpus:
        raise ConfigError(
            f"{engines} colocated engines x rollout.tp {cfg.rollout.tp} = {held} GPUs, more than the {gpus} "
            "trainer GPUs they share",
            "pipeline.rollout_workers",
        )
    try:
        cfg.check_world_size(world)
    except ConfigError as err:
        engines = "" if world == gpus else f" ({gpus} GPUs - {gpus - world} engine GPUs)"
        raise ConfigError(f"{world} trainer ranks{engines}: {err.message}", err.path) from None
    return world
