"""``mars train``: the MarsRL loop, synchronous (``pipeline.mode=sync``) or agentic (``agentic``).

Synchronous, per step: take problems → grouped agentic rollout on the engines (Solver → Verifier →
Corrector …) → agent-specific rewards → GRPO advantages per group → packed Megatron train step on every
trainer rank → weight sync into the engines → metrics (and a checkpoint when due).

Processes: this driver holds the data, the rewards and the loop; the trainer ranks are Ray actors holding
torch.distributed groups (:class:`~mars_megatron.rl.worker.PolicyWorker`); each policy's rollout engine is
a Ray actor of its own. Everything is checked before any of them starts.

Agentic: the same trainer ranks, engines and weight sync, driven by the pipeline
(:mod:`mars_megatron.pipeline`): a step is one update, and rollouts of every role go on while it trains.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars_megatron.agents.roles import Role
from mars_megatron.agents.trajectory import TrainingConfig
from mars_megatron.config import ConfigError, MarsConfig, dump_config
from mars_megatron.rl.data import ProblemStream
from mars_megatron.rl.worker import PolicyWorker, policy_names, policy_of

STATE_VERSION = 1
PIPELINE_FILE = "pipeline_state.pt"


@dataclass(frozen=True)
class Plan:
    """What a run needs, resolved and validated before anything starts."""

    model_dir: str
    engine_dir: str
    problems: list[Any]
    world_size: int
    resume_from: Path | None


def prepare(cfg: MarsConfig, *, nproc: int | None, resume: str | bool | None) -> Plan:
    """Check the config against the model, the data, the world size and the run directory; raise
    :class:`ConfigError`/``ValueError`` naming the field or file. Starts nothing."""
    from mars_megatron.checkpoint.store import CheckpointStore
    from mars_megatron.evaluation.data import load_problems
    from mars_megatron.jobs import model_arch, tokenizer_dir
    from mars_megatron.training.model_provider import LayoutError, check_layout
    from mars_megatron.training.parallel import min_world_size

    model_dir = cfg.model.mcore_dir or cfg.model.hf_dir
    if model_dir is None:
        raise ConfigError("set model.hf_dir or model.mcore_dir", "model")
    if not Path(model_dir).is_dir():
        raise ConfigError(
            f"{model_dir}: no such directory", "model.mcore_dir" if cfg.model.mcore_dir else "model.hf_dir"
        )
    arch = model_arch(model_dir)
    try:
        check_layout(arch, cfg.parallel, cfg.model.vocab_pad_multiple)
    except LayoutError as e:
        raise ConfigError(str(e), "parallel") from None
    world = nproc or min_world_size(cfg.parallel)
    cfg.check_world_size(world)
    if cfg.data.train_file is None:
        raise ConfigError("no training problems: set data.train_file", "data.train_file")
    if not Path(cfg.data.train_file).is_file():
        raise ConfigError(f"{cfg.data.train_file}: no such file", "data.train_file")
    dataset = load_problems(cfg.data.train_file)
    if not dataset.problems:
        raise ValueError(f"{cfg.data.train_file}: no usable problems ({len(dataset.skipped)} bad lines)")
    resume_from = None
    if resume:
        if cfg.checkpoint.save_dir is None:
            raise ConfigError("--resume needs checkpoint.save_dir", "checkpoint.save_dir")
        resume_from = CheckpointStore(cfg.checkpoint.save_dir, cfg.checkpoint.keep_last).resolve(resume)
        if resume_from is None:
            raise FileNotFoundError(f"{cfg.checkpoint.save_dir}: no checkpoint to resume from")
    elif (Path(cfg.logging.run_dir) / "metrics.jsonl").exists():
        raise FileExistsError(
            f"{cfg.logging.run_dir} already holds a run (metrics.jsonl); pass --resume or choose another "
            "logging.run_dir"
        )
    return Plan(model_dir, str(tokenizer_dir(model_dir)), dataset.problems, world, resume_from)


def _start_ray(num_cpus: int) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=os.environ.get("MARS_RAY_LOGS", "0") == "1",
            configure_logging=False,
        )


class MarsRLTrainer:
    """Owns the engines, the trainer ranks and the loop of one run."""

    def __init__(self, cfg: MarsConfig, plan: Plan, *, log: Callable[[str], None] = print) -> None:
        from mars_megatron.agents.prompts import prompt_set
        from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig
        from mars_megatron.rl.rollout import AgenticRollout, RolloutSettings
        from mars_megatron.rollout.chat import ChatCodec
        from mars_megatron.rollout.engine import SamplingParams
        from mars_megatron.training.ray_group import RayWorkerGroup

        self.cfg, self.plan, self.log = cfg, plan, log
        self.names = policy_names(cfg)
        cores = os.cpu_count() or 1
        agentic = cfg.pipeline.mode == "agentic"
        per_policy = cfg.pipeline.rollout_workers if agentic else 1
        actors = (
            plan.world_size + len(self.names) * per_policy + (cfg.pipeline.reward_workers if agentic else 0)
        )
        _start_ray(max(cores, actors))
        self._threads = cfg.rollout.threads or cores
        self.placement = None
        if cfg.pipeline.placement != "none":
            from mars_megatron.pipeline.placement import place

            self.placement = place(cfg.pipeline.placement, plan.world_size, len(self.names) * per_policy)
        names = [name for name in self.names for _ in range(per_policy)]
        self.workers = [(name, self._start_engine(i)) for i, name in enumerate(names)]
        self.engines = {name: next(e for n, e in self.workers if n == name) for name in self.names}
        self.group = RayWorkerGroup(
            PolicyWorker,
            plan.world_size,
            cfg,
            plan.model_dir,
            self.names,
            threads_per_rank=max(1, cores // plan.world_size),
            **self._trainer_placement(),
        )
        self.group.call("attach_engines", self._engine_groups())
        self.writer_rank = next(i for i, info in enumerate(self.group.call("rank_info")) if info["writer"])
        self.checker = AnswerChecker(CheckerConfig(num_workers=max(1, min(4, cores // 2))))
        self.stream: ProblemStream[Any] = ProblemStream(
            plan.problems, seed=cfg.train.seed, shuffle=cfg.data.shuffle
        )
        self.versions = dict.fromkeys(self.names, 0)
        a = cfg.agents
        settings = RolloutSettings(
            agents=TrainingConfig(
                group_size=a.group_size,
                inputs_per_agent=a.inputs_per_agent,
                max_steps=a.max_steps,
                strategy=a.strategy,
            ),
            sampling=SamplingParams(
                max_tokens=cfg.rollout.max_response_tokens,
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                top_k=cfg.rollout.top_k,
            ),
            reward=cfg.algorithm.reward,
        )
        codec = ChatCodec.from_pretrained(
            plan.engine_dir, max_input_tokens=cfg.rollout.max_input_tokens, truncate=True
        )
        self.rollout = AgenticRollout(
            {role: self.engines[policy_of(role, self.names)] for role in Role},
            codec,
            self.checker,
            prompt_set(a.prompts),
            settings,
            lambda role: self.versions[policy_of(role, self.names)],
        )
        self.step = 0
        self.driver = self._pipeline(settings, codec) if agentic else None

    def _start_engine(self, index: int) -> Any:
        from mars_megatron.rollout.factory import engine_recipe
        from mars_megatron.rollout.ray_engine import start_rollout_actor

        cfg = self.cfg
        recipe = engine_recipe(
            cfg.rollout.engine,
            self.plan.engine_dir,
            dtype=cfg.model.dtype,
            seed=cfg.train.seed,
            max_batch=cfg.rollout.max_batch,
        )
        if self.placement is None:
            return start_rollout_actor(recipe, num_cpus=1, threads=self._threads)
        res = self.placement.resources()
        return start_rollout_actor(
            recipe,
            num_cpus=res["num_cpus"],
            num_gpus=res["num_gpus"],
            threads=self._threads,
            scheduling_strategy=self.placement.strategy(self.placement.engine_bundles[index]),
        )

    def _trainer_placement(self) -> dict[str, Any]:
        if self.placement is None:
            return {"num_cpus_per_rank": 1}
        res = self.placement.resources()
        return {
            "num_cpus_per_rank": res["num_cpus"],
            "num_gpus_per_rank": res["num_gpus"],
            "placement": (self.placement.group, self.placement.trainer_bundles),
        }

    def _engine_groups(self) -> dict[str, Any]:
        from mars_megatron.rollout.ray_engine import EngineGroup

        return {name: EngineGroup([e for n, e in self.workers if n == name]) for name in self.names}

    def _pipeline(self, settings: Any, codec: Any) -> Any:
        import ray

        from mars_megatron.agents.prompts import prompt_set
        from mars_megatron.pipeline.driver import PipelineDriver, RewardActor, prompt_builder
        from mars_megatron.pipeline.scheduler import Limits, Scheduler

        cfg, p = self.cfg, self.cfg.pipeline
        bounds = {r: p.staleness_per_role.get(r.value, p.max_staleness) for r in Role}
        limits = Limits(
            max_response_tokens=cfg.rollout.max_response_tokens,
            segment_tokens=p.segment_tokens or cfg.rollout.max_response_tokens,
            max_staleness=bounds,
            problems_per_update=cfg.data.problems_per_step,
            batch_groups=p.batch_groups or cfg.data.problems_per_step,
        )
        scheduler = Scheduler(
            settings.agents,
            limits,
            prompt_builder(prompt_set(cfg.agents.prompts), codec.encode),
            seed=cfg.train.seed,
        )
        return PipelineDriver(
            scheduler,
            engines=self.workers,
            policy_of=lambda role: policy_of(role, self.names),
            start_reward=lambda: ray.remote(RewardActor).options(num_cpus=1).remote(),
            reward_workers=p.reward_workers,
            restart_rollout=self._restart_rollout,
            decode=codec.decode,
            sampling=settings.sampling,
            feed=lambda: self.stream.take(cfg.data.problems_per_step),
            train=lambda batches: self.group.call_async("train", batches),
            finish_train=self._finish_update,
            samples_for=self._samples_for,
            max_batch=cfg.rollout.max_batch,
            colocated=p.placement == "colocated",
        )

    def _restart_rollout(self, index: int) -> Any:
        """A new engine in place of a dead one, holding the current weights and version."""
        name = self.workers[index][0]
        engine = self._start_engine(index)
        self.workers[index] = (name, engine)
        self.engines[name] = next(e for n, e in self.workers if n == name)
        self.group.call("attach_engines", self._engine_groups())
        self._sync(self.versions)
        self.log(f"rollout worker {index} ({name}) died: restarted at policy version {self.versions[name]}")
        return engine

    def _samples_for(self, batch: Any) -> tuple[dict[str, list], dict[str, float]]:
        from mars_megatron.algorithm.advantages import assign_advantages
        from mars_megatron.pipeline.driver import to_sample

        raw = [to_sample(q) for q in batch.seqs]
        samples, adv = assign_advantages(raw, filter_zero_variance=self.cfg.algorithm.filter_zero_variance)
        batches: dict[str, list] = {name: [] for name in self.names}
        for s in samples:
            batches[policy_of(s.role, self.names)].append(s)
        stats = {
            "tokens": float(sum(len(s.prompt_ids) + s.response_len for s in samples)),
            "samples": float(len(raw)),
            "samples/trained": float(len(samples)),
            "groups/filtered": adv["filtered_groups"],
        }
        return batches, stats

    def _finish_update(self, results: list[Any]) -> dict[str, float]:
        metrics: dict[str, float] = dict(results[self.writer_rank])
        metrics.update(self._sync({name: v + 1 for name, v in self.versions.items()}))
        metrics["policy_version"] = float(max(self.versions.values()))
        if len(self.names) > 1:
            metrics.update({f"policy_version/{n}": float(v) for n, v in self.versions.items()})
        return metrics

    # ----------------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        self.checker.close()
        self.group.shutdown()
        for _, engine in self.workers:
            engine.kill()
        if self.placement is not None:
            self.placement.remove()

    def __enter__(self) -> MarsRLTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sync(self, versions: Mapping[str, int]) -> dict[str, float]:
        """Push the trainer's weights into the engines as policy ``versions``."""
        stats = self.group.call("sync_weights", dict(versions))[0]
        self.versions = {name: int(s["version"]) for name, s in stats.items()}
        return {
            "time/sync": sum(s["seconds"] for s in stats.values()),
            "sync/bytes": sum(s["bytes"] for s in stats.values()),
        }

    def start(self) -> None:
        """Fresh weights into the engines, or everything restored from ``plan.resume_from``."""
        from mars_megatron.checkpoint.rank_state import set_python_rng_state
        from mars_megatron.checkpoint.store import CheckpointStore

        if self.plan.resume_from is None:
            self._sync(dict.fromkeys(self.names, 0))
            return
        state = CheckpointStore.load_state(self.plan.resume_from)
        if state.get("state_version") != STATE_VERSION:
            raise ValueError(
                f"{self.plan.resume_from}: checkpoint state version {state.get('state_version')}"
            )
        if state["policies"] != self.names:
            raise ConfigError(
                f"the checkpoint holds policies {state['policies']}, this config {self.names}",
                "algorithm.policies",
            )
        self.group.call("load", str(self.plan.resume_from))
        self.step = int(state["step"])
        self.stream.load_state_dict(state["data"])
        set_python_rng_state(state["python_rng"])
        saved_pipeline = state["unfinished_samples"]
        if saved_pipeline and self.driver is None:
            raise ConfigError(
                f"{self.plan.resume_from} holds an agentic pipeline's in-flight state; resume it with "
                "pipeline.mode=agentic",
                "pipeline.mode",
            )
        if self.driver is not None:
            if saved_pipeline:
                import torch

                self.driver.load_state_dict(
                    torch.load(self.plan.resume_from / saved_pipeline, weights_only=False)
                )
            else:  # a synchronous checkpoint continued by the pipeline: nothing in flight yet
                self.driver.s.version = max(state["policy_versions"].values())
        self._sync(state["policy_versions"])
        self.log(f"resumed from {self.plan.resume_from} at step {self.step}")

    def save(self) -> Path:
        from mars_megatron.checkpoint.rank_state import python_rng_state
        from mars_megatron.checkpoint.store import CheckpointStore

        assert self.cfg.checkpoint.save_dir is not None
        store = CheckpointStore(self.cfg.checkpoint.save_dir, self.cfg.checkpoint.keep_last)
        staging = store.begin(self.step)
        try:
            self.group.call("save", str(staging))
            if self.driver is not None:  # the pipeline's in-flight sequences, queue and counts
                import torch

                torch.save(self.driver.state_dict(), staging / PIPELINE_FILE)
        except BaseException:
            store.abort(staging)
            raise
        state = {
            "state_version": STATE_VERSION,
            "step": self.step,
            "policies": self.names,
            "policy_versions": self.versions,
            "data": self.stream.state_dict(),
            "python_rng": python_rng_state(),
            # The synchronous loop finishes every sample within its step; the agentic pipeline carries
            # partial rollouts across steps and saves them (with its whole schedule) in this file.
            "unfinished_samples": PIPELINE_FILE if self.driver is not None else [],
        }
        return store.commit(staging, self.step, state)

    # ---------------------------------------------------------------------------------------------- step
    def train_step(self) -> dict[str, float]:
        from mars_megatron.algorithm.advantages import assign_advantages

        cfg = self.cfg
        self.step += 1
        if self.driver is not None:
            return self.driver.run_update()
        t0 = time.perf_counter()
        problems = self.stream.take(cfg.data.problems_per_step)
        result = self.rollout.run(problems, step=self.step, seed=cfg.train.seed)
        t1 = time.perf_counter()
        samples, adv_stats = assign_advantages(
            result.samples, filter_zero_variance=cfg.algorithm.filter_zero_variance
        )
        batches: dict[str, list] = {name: [] for name in self.names}
        for s in samples:
            batches[policy_of(s.role, self.names)].append(s)
        train = self.group.call("train", batches)[self.writer_rank]
        t2 = time.perf_counter()
        sync = self._sync({name: v + 1 for name, v in self.versions.items()})
        t3 = time.perf_counter()
        metrics: dict[str, float] = dict(result.metrics)
        metrics.update(train)
        metrics.update(sync)
        metrics.update(
            {
                "tokens": float(sum(len(s.prompt_ids) + s.response_len for s in samples)),
                "samples": float(len(result.samples)),
                "samples/trained": float(len(samples)),
                "groups/filtered": adv_stats["filtered_groups"],
                "time/rollout": t1 - t0,
                "time/train": t2 - t1,
                "time/step": t3 - t0,
                "policy_version": float(max(self.versions.values())),
            }
        )
        if len(self.names) > 1:
            metrics.update({f"policy_version/{n}": float(v) for n, v in self.versions.items()})
        return metrics


def _due(step: int, cfg: MarsConfig) -> bool:
    c = cfg.checkpoint
    if c.save_dir is None:
        return False
    return step == cfg.train.steps or (c.save_interval > 0 and step % c.save_interval == 0)


def _line(step: int, total: int, m: Mapping[str, float]) -> str:
    rewards = "  ".join(
        f"{role[0].upper()} {m[f'reward/{role}']:.2f}"
        for role in ("solver", "verifier", "corrector")
        if f"reward/{role}" in m
    )
    loss = m.get("train/loss", m.get("train/shared/loss", float("nan")))
    return (
        f"step {step:4d}/{total}  reward {rewards}  loss {loss:+.4f}  samples {int(m['samples'])}  "
        f"tokens {int(m['tokens'])}  {m['time/step']:.1f}s"
    )


def train(
    cfg: MarsConfig, *, nproc: int | None = None, resume: str | bool | None = None
) -> list[dict[str, float]]:
    """Run (or resume) ``cfg``'s MarsRL training; returns the metrics of the steps run here."""
    from tqdm import tqdm

    from mars_megatron.metrics import MetricsSink

    plan = prepare(cfg, nproc=nproc, resume=resume)
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    history = []
    with MarsRLTrainer(cfg, plan, log=tqdm.write) as trainer:
        trainer.start()
        with MetricsSink(
            run_dir,
            tensorboard=cfg.logging.tensorboard,
            total_steps=cfg.train.steps,
            resume_step=trainer.step,
        ) as sink:
            while trainer.step < cfg.train.steps:
                metrics = trainer.train_step()
                sink.log(trainer.step, metrics)
                history.append({"step": trainer.step, **metrics})
                if trainer.step % cfg.logging.log_interval == 0:
                    tqdm.write(_line(trainer.step, cfg.train.steps, metrics))
                if _due(trainer.step, cfg):
                    trainer.save()
    return history
