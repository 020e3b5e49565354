"""``mars train``: the MarsRL loop, synchronous (``pipeline.mode=sync``) or agentic (``agentic``).

A step is one update: problems → grouped agentic rollout on the engines (the agent graph's positions;
MarsRL: Solver → Verifier → Corrector …) → agent-specific rewards → GRPO advantages per group → packed
Megatron train step on every trainer rank → weight sync into the engines → metrics (and a checkpoint when
due).

Both modes run the one schedule of :mod:`mars_megatron.pipeline` (:class:`~.scheduler.Scheduler` driven
on Ray by :class:`~.driver.PipelineDriver`). ``sync`` sets every staleness bound to 0: an update trains
the whole trajectories of the problems admitted since the last one, and nothing decodes while it trains.
``agentic`` lets rollouts of every role go on during updates, within the bounds.

Processes: this driver holds the data and the schedule; the trainer ranks are Ray actors holding
torch.distributed groups (:class:`~mars_megatron.rl.worker.PolicyWorker`); rollout engines and reward
workers are Ray actors of their own. Everything is checked before any of them starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mars_megatron import runtime_env
from mars_megatron.agents.graph import prompt_set_of
from mars_megatron.agents.graph_file import graph_for, policy_names
from mars_megatron.config import ConfigError, MarsConfig, config_to_dict, dump_config
from mars_megatron.pipeline.tracking import check_trackers, tracker_specs
from mars_megatron.rl.data import ProblemStream
from mars_megatron.rl.worker import PolicyWorker

if TYPE_CHECKING:
    from mars_megatron.pipeline.driver import TrainerLost
    from mars_megatron.pipeline.nodes import Holding

STATE_VERSION = 1
PIPELINE_FILE = "pipeline_state.pt"


@dataclass(frozen=True)
class RunSetup:
    """What a run needs, resolved and validated before anything starts (:func:`prepare`)."""

    model_dir: str
    engine_dir: str
    problems: list[Any]
    world_size: int
    resume_from: Path | None
    eval_problems: list[Any] = field(default_factory=list)
    """Held-out problems of ``evaluation.test_file`` (empty when training evaluates nothing)."""
    data_summary: list[str] = field(default_factory=list)
    """One line per data file read (problems kept, rows filtered, unusable rows by reason), printed when
    the run starts: no row is dropped without a word, and a refused run prints nothing."""


def prepare(
    cfg: MarsConfig, *, nproc: int | None, resume: str | bool | None, check_machine: bool = True
) -> RunSetup:
    """Check the config against the model, the data, the world size and the run directory, then (with
    ``check_machine``) against this machine (:func:`check_this_machine`); raise
    :class:`ConfigError`/``ValueError`` naming the field or file. Starts nothing."""
    from mars_megatron.checkpoint.store import CheckpointStore
    from mars_megatron.jobs import model_arch, tokenizer_dir
    from mars_megatron.models.layout import LayoutError, check_parallel
    from mars_megatron.rewards.functions import check_graph_functions
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
        check_parallel(arch, cfg.parallel, cfg.model.vocab_pad_multiple)
    except LayoutError as e:
        raise ConfigError(e.message, f"parallel.{e.field}") from None
    if cfg.model.fp8 is not None and arch.is_moe and cfg.parallel.moe_token_dispatcher != "alltoall":
        raise ConfigError(
            "model.fp8 with a MoE model pads each expert's tokens for FP8 GEMMs, which Megatron only "
            "supports with the alltoall dispatcher",
            "parallel.moe_token_dispatcher",
        )
    graph = graph_for(cfg)
    check_graph_functions(graph)  # each imports in a process of its own, as its workers will
    # answers are read by math-verify only when some role's reward is it (a function takes any value)
    check_answers = any(role.reward == "answer" for role in graph.roles.values())
    world = nproc or min_world_size(cfg.parallel)
    cfg.check_world_size(world)
    if cfg.data.train_file is None:
        raise ConfigError("no training problems: set data.train_file", "data.train_file")
    if not Path(cfg.data.train_file).exists():
        raise ConfigError(f"{cfg.data.train_file}: no such file or folder", "data.train_file")
    dataset = _read_problems(cfg.data.train_file, cfg.data, "data", check_answers=check_answers)
    if not dataset.problems:
        raise ValueError(f"{dataset.summary(cfg.data.train_file)}: no usable problems")
    eval_problems, eval_summary = _eval_problems(
        cfg, dataset.problems, graph.roles[graph.start_role].reward != "function"
    )
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
    check_trackers(cfg.logging)
    if check_machine:
        check_this_machine(cfg)
    summary = [dataset.summary(f"data: {cfg.data.train_file}"), *eval_summary]
    return RunSetup(
        model_dir, str(tokenizer_dir(model_dir)), dataset.problems, world, resume_from, eval_problems, summary
    )


def _read_problems(
    path: str, section: Any, key: str, limit: int | None = None, *, check_answers: bool = True
) -> Any:
    """The problems of ``path`` mapped by ``section``'s fields and filter; the summary (problems kept,
    rows filtered, unusable rows by reason) is in the dataset (:class:`RunSetup`'s ``data_summary``)."""
    from mars_megatron.problems import FieldMap, load_problems

    try:
        fields = FieldMap.of(section, check_answers=check_answers)
    except ValueError as e:
        raise ConfigError(str(e), f"{key}.fields") from None
    return load_problems(path, limit, fields, split=section.split, key=key)


def _eval_problems(
    cfg: MarsConfig, train: list[Any], check_answers: bool = True
) -> tuple[list[Any], list[str]]:
    """``evaluation.test_file``'s problems (and its summary line), refused when any is also a training
    problem: a held-out score on problems the run trains on would measure memory, not the skill."""
    ev = cfg.evaluation
    if not ev.interval or ev.test_file is None:
        return [], []
    if not Path(ev.test_file).exists():
        raise ConfigError(f"{ev.test_file}: no such file or folder", "evaluation.test_file")
    dataset = _read_problems(ev.test_file, ev, "evaluation", ev.limit, check_answers=check_answers)
    problems = dataset.problems
    if not problems:
        raise ConfigError(f"{ev.test_file}: no usable problems", "evaluation.test_file")
    seen = {p.text.strip() for p in train}
    shared = [p.problem_id for p in problems if p.text.strip() in seen]
    if shared:
        raise ConfigError(
            f"{len(shared)} of its problems are also in data.train_file ({', '.join(shared[:5])}"
            f"{', ...' if len(shared) > 5 else ''}): held-out problems must not be trained on",
            "evaluation.test_file",
        )
    return problems, [dataset.summary(f"evaluation: {ev.test_file}")]


def check_this_machine(cfg: MarsConfig) -> None:
    """What this machine must have for ``cfg``: a GPU and Transformer Engine for FP8 (with its CUDA and
    TE versions), and TE on a GPU for ``transformer_impl`` auto. Checked in the driver before any actor
    starts: a ``mars train`` driver runs on a node like its ranks' (a Slurm job's head node)."""
    from mars_megatron.training.fp8 import check_fp8
    from mars_megatron.training.model_provider import resolve_impl

    check_fp8(cfg.model.fp8)
    try:
        resolve_impl(cfg.model.transformer_impl)
    except RuntimeError as e:
        raise ConfigError(str(e), "model.transformer_impl") from None
    if not os.environ.get("RAY_ADDRESS"):  # a local Ray: every worker is a process on this machine
        check_workers_fit(cfg, len(policy_names(cfg)), os.cpu_count() or 1)


WORKERS_PER_CORE = 4
"""Most rollout and reward workers a run on one machine may start per CPU core. Each is a process with
its own interpreter, model or verifier (hundreds of MiB at least); the CPU examples start 2-3 on 2 cores.
A Ray cluster (``RAY_ADDRESS``) is checked against its own CPUs when the run joins it."""


def check_workers_fit(cfg: MarsConfig, policies: int, cores: int) -> None:
    """Refuse more rollout and reward workers than :data:`WORKERS_PER_CORE` per core of this machine,
    naming the figure and the fields: 10**5 workers would otherwise start until memory runs out."""
    p = cfg.pipeline
    workers = policies * p.rollout_workers + p.reward_workers
    if workers > WORKERS_PER_CORE * cores:
        field = (
            "pipeline.rollout_workers"
            if policies * p.rollout_workers >= p.reward_workers
            else ("pipeline.reward_workers")
        )
        raise ConfigError(
            f"pipeline.rollout_workers={p.rollout_workers} x {policies} policies + pipeline.reward_workers="
            f"{p.reward_workers} = {workers:,} worker processes on this machine of {cores} CPU cores; the "
            f"most a run on one machine may start is {WORKERS_PER_CORE} per core "
            f"({WORKERS_PER_CORE * cores:,}). A cluster is joined through RAY_ADDRESS (`mars launch`)",
            field,
        )


def _start_ray(num_cpus: int, actors: int, cpus: float) -> bool:
    """Start a local Ray with ``num_cpus`` unless this process is already connected to one (a test's),
    or ``RAY_ADDRESS`` names a cluster to join (a Slurm job's); True if started here (then the run shuts
    it down at the end). The run's ``actors`` hold ``cpus`` CPUs (one each, a trainer rank
    ``pipeline.cpus_per_rank``), so a cluster with fewer is refused now rather than after a placement
    timeout. A joined
    cluster's workers get this process's numerics environment through the job's ``runtime_env`` (a local
    one's inherit it: :mod:`mars_megatron.runtime_env`)."""
    import ray

    if not ray.is_initialized() and os.environ.get("RAY_ADDRESS"):
        # A cluster started outside this process (`mars launch --executor slurm`): join it as the driver.
        ray.init(
            log_to_driver=os.environ.get("MARS_RAY_LOGS", "0") == "1",
            configure_logging=False,
            runtime_env=runtime_env.ray_runtime_env(),
        )
    if ray.is_initialized():
        have = ray.cluster_resources().get("CPU", 0.0)
        if have < cpus:
            raise RuntimeError(
                f"the Ray cluster this process is connected to has {have:.0f} CPUs; this run starts {actors} "
                f"actors holding {cpus:g} (trainer ranks of pipeline.cpus_per_rank each, rollout workers and "
                "reward workers of 1)"
            )
        return False
    ray.init(
        address="local",  # a new cluster of this run's, never one a `ray start` left on this machine
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=os.environ.get("MARS_RAY_LOGS", "0") == "1",
        configure_logging=False,
    )
    return True


class MarsRLTrainer:
    """Owns the engines, the trainer ranks and the loop of one run."""

    def __init__(self, cfg: MarsConfig, setup: RunSetup, *, log: Callable[[str], None] = print) -> None:
        from mars_megatron.pipeline.facades import TrainerGroup, TrainerRanks
        from mars_megatron.pipeline.fleet import EngineFleet
        from mars_megatron.pipeline.nodes import NodeWatch
        from mars_megatron.pipeline.placement import place, unplaced_gpus, unplaced_launch
        from mars_megatron.rollout.chat import ChatCodec
        from mars_megatron.training.ray_group import rendezvous_host

        self.cfg, self.setup, self.log = cfg, setup, log
        self.graph = graph_for(cfg)  # the agent system, checked before anything starts
        self.names = policy_names(cfg, self.graph)
        cores = os.cpu_count() or 1
        p = cfg.pipeline
        actors = setup.world_size + len(self.names) * p.rollout_workers + p.reward_workers
        cpus = setup.world_size * p.cpus_per_rank + actors - setup.world_size
        self._own_ray = _start_ray(max(cores, math.ceil(cpus)), actors, cpus)
        self._threads = cfg.rollout.threads or runtime_env.cpu_threads()
        self.placement = None
        engines = len(self.names) * p.rollout_workers
        if p.placement == "none":
            vllm = cfg.rollout.engine == "vllm"
            gpus = unplaced_gpus(self._cluster_gpus(), setup.world_size, engines, cfg.rollout.tp, vllm=vllm)
            self._unplaced = unplaced_launch(cfg.rollout.tp, gpus)
            self._engine_needs = {"CPU": self._unplaced.num_cpus, "GPU": float(gpus)}
        else:
            self.placement = place(p.placement, setup.world_size, engines, engine_gpus=cfg.rollout.tp)
            own = self.placement.resources()  # each actor's share of its bundles
            self._engine_needs = {"CPU": own["num_cpus"], "GPU": own["num_gpus"] * cfg.rollout.tp}
        self.nodes = NodeWatch(self.holdings, log)
        """Asked before a rank, engine or reward worker is started again: a lost node whose work the nodes
        left cannot take stops the run at once, naming it (:mod:`~mars_megatron.pipeline.nodes`)."""
        names = [name for name in self.names for _ in range(p.rollout_workers)]
        # the engines load their models while the trainer ranks build theirs
        starting = [(name, self._launch_engine(i)) for i, name in enumerate(names)]
        self.group = self._new_group()
        workers = [(name, engine.ready()) for name, engine in starting]
        ranks = TrainerRanks.ask(self.group)
        fleet = EngineFleet(
            self.group,
            workers,
            self._start_engine,
            host=rendezvous_host(),  # loopback on one node: the store listens nowhere else
            backend="nccl" if "nccl" in ranks.backend else "gloo",  # the devices the ranks really have
            timeout_s=p.transfer_timeout_s,
            call_timeout_s=p.rollout_timeout_s,
            log=log,
            colocation=self._colocation(),
        )
        self.fleet = fleet
        self.trainers = TrainerGroup(self.group, fleet, self.names, self.graph, cfg.train, ranks)
        self._log_where()
        self.stream: ProblemStream[Any] = ProblemStream(
            setup.problems, seed=cfg.train.seed, shuffle=cfg.data.shuffle
        )
        codec = ChatCodec.from_pretrained(
            setup.engine_dir, max_input_tokens=cfg.rollout.max_input_tokens, truncate=True
        )
        self.step = 0
        self.trainer_restarts = 0
        """Trainer groups rebuilt in this process (:meth:`recover`)."""
        self._codec = codec
        self.driver = self._pipeline(codec)
        self.held_out = None
        if setup.eval_problems:
            from mars_megatron.rl.evaluate import HeldOutEval

            self.held_out = HeldOutEval(cfg, setup.eval_problems, setup.engine_dir)

    def _log_where(self) -> None:
        """One line saying on which nodes the trainer ranks and the engines run (by address, as each
        said at its start), for the operator of a multi-node job; nothing when all is on one node."""
        engines = [engine.process.address for _, engine in self.fleet.engines]
        if len({*self.group.addresses, *engines}) > 1:
            self.log(f"placement: trainer ranks on {', '.join(self.group.addresses)}; rollout engines on "
                     f"{', '.join(engines)}")  # fmt: skip

    def holdings(self) -> list[Holding]:
        """What this run holds on the cluster's nodes: trainer ranks, rollout engines, reward workers."""
        from mars_megatron.pipeline.nodes import Holding

        placed = self._trainer_placement()
        rank = {"CPU": placed["num_cpus_per_rank"], "GPU": placed["num_gpus_per_rank"]}
        held = [Holding("rank", r, f"trainer rank {r}", p, rank) for r, p in enumerate(self.group.processes)]
        held += [
            Holding("engine", i, f"rollout engine {i} ({name})", engine.process, self._engine_needs)
            for i, (name, engine) in enumerate(self.fleet.engines)
        ]
        driver = getattr(self, "driver", None)  # none yet while the first one is built
        if driver is not None:
            held += [
                Holding("reward", w, f"reward worker {w}", p, {"CPU": 1.0})
                for w, p in enumerate(driver.rewards.processes())
            ]
        return held

    def _new_group(self, while_waiting: Callable[[], None] | None = None) -> Any:
        """The trainer ranks: one Ray actor each, every policy's model built (from ``setup.model_dir``).
        ``while_waiting``: asked while the cluster has not granted their resources (it may raise)."""
        from mars_megatron.training.ray_group import RayWorkerGroup

        return RayWorkerGroup(
            PolicyWorker,
            self.setup.world_size,
            self.cfg,
            self.setup.model_dir,
            self.names,
            threads_per_rank=runtime_env.cpu_threads(),  # a constant: reductions split alike on any host
            call_timeout_s=self.cfg.pipeline.train_timeout_s,
            socket_ifname=self.cfg.pipeline.network_interface,
            while_waiting=while_waiting,
            **self._trainer_placement(),
        )

    def _start_engine(self, index: int) -> Any:
        """Rollout engine ``index`` started again as a Ray actor (:meth:`_launch_engine`), built: the
        fleet's replacement of a dead or hung one, once the nodes left have room for it."""
        self.nodes.before_replacing("engine", index)
        return self._launch_engine(index).ready()

    def _launch_engine(self, index: int) -> Any:
        """Rollout engine ``index`` as a Ray actor, started as the placement says
        (:meth:`~mars_megatron.pipeline.placement.Placement.engine_launch`), or without one (placement
        'none') with GPUs of its own on a GPU cluster; not waited for
        (:class:`~mars_megatron.rollout.ray_engine.StartingEngine`)."""
        from mars_megatron.rollout.factory import run_engine_recipe
        from mars_megatron.rollout.ray_engine import launch_rollout_actor

        recipe = run_engine_recipe(self.cfg, self.setup.engine_dir)
        if self.placement is None:
            launch, strategy = self._unplaced, None
        else:
            launch = self.placement.engine_launch(index)
            strategy = self.placement.strategy(self.placement.engine_bundles[index][0])
        ifname = self.cfg.pipeline.network_interface  # NCCL's weight transfer (and vLLM's own groups)
        sockets = {"NCCL_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname} if ifname else {}
        return launch_rollout_actor(
            recipe,
            num_cpus=launch.num_cpus,
            num_gpus=launch.num_gpus,
            threads=self._threads,
            env={**(launch.env or {}), **sockets} or None,
            scheduling_strategy=strategy,
            timeout_s=self.cfg.pipeline.rollout_timeout_s,
        )

    @staticmethod
    def _cluster_gpus() -> float:
        import ray

        return float(ray.cluster_resources().get("GPU", 0))

    def _trainer_placement(self) -> dict[str, Any]:
        if self.placement is None:
            # one GPU per rank on a GPU cluster, whether or not this driver process sees one
            return {
                "num_cpus_per_rank": self.cfg.pipeline.cpus_per_rank,
                "num_gpus_per_rank": 1.0 if self._cluster_gpus() > 0 else 0.0,
            }
        res = self.placement.resources()
        return {
            "num_cpus_per_rank": res["num_cpus"],
            "num_gpus_per_rank": res["num_gpus"],
            "placement": (self.placement.group, self.placement.trainer_bundles),
        }

    def _colocation(self) -> list[list[int]] | None:
        """Colocated engines: per engine, the trainer rank whose device each of its workers shares (the
        weight push hands them buffers by handle, :mod:`mars_megatron.transfer.ipc`)."""
        if self.placement is None or self.placement.mode != "colocated":
            return None
        host = {bundle: rank for rank, bundle in enumerate(self.placement.trainer_bundles)}
        return [[host[b] for b in bundles] for bundles in self.placement.engine_bundles]

    def _pipeline(self, codec: Any, rewards: Any = None) -> Any:
        """The run's schedule on Ray (with ``rewards``, a reward pool kept from an earlier driver; None:
        new reward workers). ``sync`` is the same scheduler with every staleness bound 0: each update
        trains exactly the outputs of the problems admitted since the last one, decoded by the current
        weights, and no rollout runs while it trains."""
        from mars_megatron.pipeline.agents import prompt_builder
        from mars_megatron.pipeline.driver import Deadlines, PipelineDriver
        from mars_megatron.pipeline.facades import ProblemFeed, RewardPool
        from mars_megatron.pipeline.scheduler import Limits, Scheduler
        from mars_megatron.rollout.engine import SamplingParams

        cfg, p, a = self.cfg, self.cfg.pipeline, self.cfg.agents
        g = self.graph
        limits = Limits.from_config(cfg, g)
        prompts = prompt_builder(g, prompt_set_of(g, a.prompts), codec.encode)
        scheduler = Scheduler(a, limits, prompts, g, seed=cfg.train.seed)
        sampling = SamplingParams(
            max_tokens=cfg.rollout.max_response_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
        )
        return PipelineDriver(
            scheduler,
            fleet=self.fleet,
            trainers=self.trainers,
            rewards=rewards or RewardPool(p.reward_workers, self.nodes),
            problems=ProblemFeed(self.stream, cfg.data.problems_per_step),
            codec=codec,
            sampling=sampling,
            max_batch=cfg.rollout.max_batch,
            colocated=p.placement == "colocated",
            shared_reward=cfg.algorithm.reward == "shared",
            filter_zero_variance=cfg.algorithm.filter_zero_variance,
            rollouts_dir=Path(cfg.logging.run_dir) / "rollouts" if cfg.logging.rollouts else None,
            deadlines=Deadlines(p.rollout_timeout_s, p.reward_timeout_s, p.train_timeout_s),
            log=self.log,
        )

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation of the current policies (``eval/*`` metrics), each role answered by the
        engines of its policy that hold the current weights; nothing when no evaluation is configured."""
        from mars_megatron.rl.evaluate import EnginePool

        if self.held_out is None:
            return {}
        pools = {}
        for name in self.names:
            current = [
                self.fleet.engines[i][1] for i in self.fleet.indices(name) if i not in self.fleet.stale
            ]
            if not current:
                self.log(f"held-out evaluation skipped at step {self.step}: no engine of {name!r} is current")
                return {}
            pools[name] = EnginePool(current)
        routed = {role: pools[self.graph.policy_of(role, self.names)] for role in self.graph.roles}
        return self.held_out.run(routed, self.step)

    # ----------------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        import ray

        if self.held_out is not None:
            self.held_out.close()
        self.group.shutdown()
        self.fleet.close()
        self.driver.rewards.close()
        if self.placement is not None:
            self.placement.remove()
        if self._own_ray:
            ray.shutdown()

    def __enter__(self) -> MarsRLTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Fresh weights into the engines, or everything restored from ``setup.resume_from``."""
        if self.setup.resume_from is None:
            self.trainers.push(dict.fromkeys(self.names, 0))
            return
        self.restore(self.setup.resume_from)
        self.log(f"resumed from {self.setup.resume_from} at step {self.step}")

    def restore(self, path: Path) -> None:
        """Everything as checkpoint ``path`` saved it: the ranks' weights and optimizers, the step, the
        data stream, the Python RNG and the schedule; then those weights into every engine."""
        from mars_megatron.checkpoint.rank_state import set_python_rng_state
        from mars_megatron.checkpoint.store import CheckpointStore

        state = CheckpointStore.load_state(path)
        if state.get("state_version") != STATE_VERSION:
            raise ValueError(f"{path}: checkpoint state version {state.get('state_version')}")
        if state["policies"] != self.names:
            raise ConfigError(
                f"the checkpoint holds policies {state['policies']}, this config {self.names}",
                "algorithm.policies",
            )
        self.group.call("load", str(path))
        self.step = int(state["step"])
        self.stream.load_state_dict(state["data"])
        set_python_rng_state(state["python_rng"])
        saved_pipeline = state["unfinished_samples"]
        if saved_pipeline:
            from mars_megatron.checkpoint.safe_load import load_plain

            pipeline_state = load_plain(path / saved_pipeline)
            saved_mode = pipeline_state.get("mode", "agentic")
            if saved_mode != self.cfg.pipeline.mode and in_flight(pipeline_state["scheduler"]):
                raise ConfigError(
                    f"{path} holds outputs of the {saved_mode} schedule still in flight; "
                    f"resume it with pipeline.mode={saved_mode}",
                    "pipeline.mode",
                )
            self.driver.load_state_dict(pipeline_state)
        else:  # a checkpoint of the older synchronous loop: nothing in flight
            self.driver.s.version = max(state["policy_versions"].values())
        self.trainers.push(state["policy_versions"])

    def lost_if_dead(self, error: Exception, what: str) -> Exception:
        """``error`` (raised by ``what``) as :class:`~.driver.TrainerLost` when trainer ranks have died
        or hung (a wait on the group past its deadline, maybe inside a transfer's error), else unchanged:
        a rank can be lost outside an update too (in the weight push, in a checkpoint's save), and the
        error that surfaces is then another rank's or the transfer's."""
        from mars_megatron.pipeline.driver import TrainerLost
        from mars_megatron.pipeline.nodes import NodeLost
        from mars_megatron.training.ray_group import RanksHung

        if isinstance(error, TrainerLost):
            return error
        cause: BaseException | None = error
        for _ in range(16):  # the chain of causes, however it was raised (bounded: a chain may loop)
            if cause is None:
                break
            if isinstance(cause, NodeLost):  # a replacement found no room: the run stops, saying why
                return cause
            if isinstance(cause, RanksHung):
                return TrainerLost(f"{what}: {cause}", cause.ranks, "hung")
            cause = cause.__cause__ or cause.__context__
        dead = self.group.dead_ranks()
        if not dead:
            return error
        said = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        return TrainerLost(f"{what}: trainer rank(s) {dead} died ({said})", dead, "died")

    def recover(self, lost: TrainerLost) -> float:
        """Trainer ranks died or hung in an update (``lost``): build a new group of ranks and go back to
        the last checkpoint, inside this process. The engines and reward workers are kept, under a new
        driver (their calls in flight finish unheard; the weight push waits for the engines to be idle);
        the new ranks load the checkpoint's weights and optimizer state, the schedule and the data stream
        are restored, and the engines take the checkpoint's weights. With the schedule deterministic
        (``pipeline.mode=sync``) the steps that follow are those of a run never interrupted. Re-raises
        ``lost`` (with the reason) when ``pipeline.trainer_restarts`` are used up or no checkpoint
        exists, and raises :class:`~.nodes.NodeLost` when a node of the run's is lost and the nodes left
        cannot hold a new group (with room, the group is rebuilt on them); returns the seconds it took."""
        import time

        from mars_megatron.checkpoint.store import CheckpointStore
        from mars_megatron.pipeline.driver import TrainerLost
        from mars_megatron.pipeline.facades import TrainerRanks
        from mars_megatron.pipeline.nodes import NodeLost

        self.nodes.before_replacing("rank")  # a lost node and no room for the group: NodeLost, now
        c = self.cfg.checkpoint
        latest = CheckpointStore(c.save_dir, c.keep_last).latest() if c.save_dir else None
        if self.trainer_restarts >= self.cfg.pipeline.trainer_restarts or latest is None:
            why = (
                f"pipeline.trainer_restarts = {self.cfg.pipeline.trainer_restarts} used up"
                if latest is not None
                else "no checkpoint to rebuild the trainer from yet (checkpoint.save_dir, save_interval)"
            )
            raise TrainerLost(f"{lost}; the run stops: {why}", lost.ranks, lost.reason) from lost
        started = time.perf_counter()
        self.trainer_restarts += 1
        self.log(f"{lost}: rebuilding the trainer group from {latest.name}")
        self.group.shutdown()  # kills every rank: the survivors may be blocked in a collective

        def room() -> None:  # a node may be lost while the new group waits or builds (a link cut)
            self.nodes.before_replacing("rank")

        try:
            self.group = self._new_group(while_waiting=room)
        except NodeLost:
            raise
        except Exception:
            room()  # the group failed because a node was lost and the nodes left cannot hold it: say so
            raise
        self.fleet.rebind(self.group)
        self.trainers.rebind(self.group, TrainerRanks.ask(self.group))
        self.driver = self._pipeline(self._codec, self.driver.rewards)
        self.restore(latest)
        seconds = time.perf_counter() - started
        self.log(f"trainer group rebuilt in {seconds:.1f} s: the run goes on from step {self.step}")
        return seconds

    def save(self) -> Path:
        from mars_megatron.checkpoint.rank_state import python_rng_state
        from mars_megatron.checkpoint.store import CheckpointStore

        assert self.cfg.checkpoint.save_dir is not None
        store = CheckpointStore(self.cfg.checkpoint.save_dir, self.cfg.checkpoint.keep_last)
        staging = store.begin(self.step)
        try:
            self.group.call("save", str(staging))
            import torch  # the schedule's in-flight sequences, queue and counts

            torch.save({**self.driver.state_dict(), "mode": self.cfg.pipeline.mode}, staging / PIPELINE_FILE)
        except BaseException:
            store.abort(staging)
            raise
        state = {
            "state_version": STATE_VERSION,
            "step": self.step,
            "policies": self.names,
            "policy_versions": self.trainers.versions,
            "data": self.stream.state_dict(),
            "python_rng": python_rng_state(),
            # The agentic schedule carries partial rollouts across steps; they are saved, with the whole
            # schedule, in this file (the synchronous one has nothing in flight between updates).
            "unfinished_samples": PIPELINE_FILE,
        }
        return store.commit(staging, self.step, state)

    # ---------------------------------------------------------------------------------------------- step
    def train_step(self) -> dict[str, float]:
        """One update: the schedule runs until its data is ready and trained (rollouts go on meanwhile
        in agentic mode)."""
        self.step += 1
        return self.driver.run_update(self.step)


def in_flight(scheduler_state: Mapping[str, Any]) -> bool:
    """Whether a saved schedule holds outputs not yet trained (decoding, scoring, or queued)."""
    return bool(scheduler_state["queue"]) or any(q["state"] != "done" for q in scheduler_state["seqs"])


def _due(step: int, cfg: MarsConfig) -> bool:
    c = cfg.checkpoint
    if c.save_dir is None:
        return False
    return step == cfg.train.steps or (c.save_interval > 0 and step % c.save_interval == 0)


def _line(step: int, total: int, m: Mapping[str, float], roles: Sequence[str]) -> str:
    rewards = "  ".join(
        f"{role[0].upper()} {m[f'reward/{role}']:.2f}" for role in roles if f"reward/{role}" in m
    )
    loss = m.get("train/loss", m.get("train/shared/loss", float("nan")))
    return (
        f"step {step:4d}/{total}  reward {rewards}  loss {loss:+.4f}  samples {int(m['samples'])}  "
        f"tokens {int(m['tokens'])}  {m['time/step']:.1f}s"
    )


def _eval_line(step: int, m: Mapping[str, float], start_role: str) -> str:
    acc = "  ".join(
        f"{name} {m[key]:.3f}"
        for name, key in ((start_role, f"eval/{start_role}_acc"), ("system", "eval/system_acc"))
        if key in m
    )
    return f"eval {step:4d}  held-out {acc}  ({m.get('eval/time', 0.0):.1f}s)"


def _log_eval(trainer: MarsRLTrainer, sink: Any) -> dict[str, float]:
    """Evaluate the held-out split now and log it (eval.jsonl, TensorBoard, a line); the metrics, for the
    step's metrics.jsonl line (none when the evaluation was skipped)."""
    from tqdm import tqdm

    evaluated = trainer.evaluate()
    if evaluated:
        assert trainer.held_out is not None
        sink.log_eval(trainer.step, evaluated, files=[trainer.held_out.summary_path(trainer.step)])
        tqdm.write(_eval_line(trainer.step, evaluated, trainer.graph.start_role))
    return evaluated


def train(
    cfg: MarsConfig, *, nproc: int | None = None, resume: str | bool | None = None
) -> list[dict[str, float]]:
    """Run (or resume) ``cfg``'s MarsRL training; returns the metrics of the steps run here. A trainer
    rank that dies or hangs in an update is survived (:meth:`MarsRLTrainer.recover`)."""
    from tqdm import tqdm

    from mars_megatron.metrics import MetricsSink
    from mars_megatron.pipeline.driver import TrainerLost

    graph_for(cfg)  # a graph that cannot run fails here, before models are converted or Ray starts
    setup = prepare(cfg, nproc=nproc, resume=resume)
    for line in setup.data_summary:
        print(line, flush=True)
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    history: list[dict[str, float]] = []
    with MarsRLTrainer(cfg, setup, log=tqdm.write) as trainer:
        trainer.start()
        held_out = trainer.held_out
        recovered_s = 0.0
        while trainer.step < cfg.train.steps:
            # (re)opened at the step the run goes on from: after a rebuilt trainer, the lines of the
            # steps it went back over are dropped, as on --resume
            with MetricsSink(
                run_dir,
                trackers=tracker_specs(cfg.logging),
                config=config_to_dict(cfg),
                total_steps=cfg.train.steps,
                resume_step=trainer.step,
            ) as sink:
                history = [h for h in history if h["step"] <= trainer.step]
                if held_out is not None and trainer.step == 0:  # the start of the curve: the warm start
                    _log_eval(trainer, sink)
                try:
                    recovered_s = _steps(trainer, sink, history, recovered_s)
                except TrainerLost as lost:
                    recovered_s = trainer.recover(lost)
    return history


def _steps(trainer: MarsRLTrainer, sink: Any, history: list[dict[str, float]], recovered_s: float) -> float:
    """Train, log and checkpoint until the run's last step; a lost trainer raises
    :class:`~.driver.TrainerLost` out of here. ``recovered_s``: the seconds of the last recovery, logged
    with the first step after it (``time/recover``)."""
    from tqdm import tqdm

    cfg = trainer.cfg
    while trainer.step < cfg.train.steps:
        try:
            metrics = trainer.train_step()
        except Exception as e:  # a rank lost in the update or its weight push: TrainerLost
            raise trainer.lost_if_dead(e, f"update {trainer.step}") from e
        metrics["pipeline/trainer_restarts"] = float(trainer.trainer_restarts)
        if recovered_s:
            metrics["time/recover"], recovered_s = recovered_s, 0.0
        if trainer.held_out is not None and trainer.held_out.due(trainer.step):
            metrics.update(_log_eval(trainer, sink))
        sink.log(trainer.step, metrics)
        history.append({"step": trainer.step, **metrics})
        if trainer.step % cfg.logging.log_interval == 0:
            tqdm.write(_line(trainer.step, cfg.train.steps, metrics, list(trainer.graph.roles)))
        if _due(trainer.step, cfg):
            try:
                trainer.save()
            except Exception as e:
                raise trainer.lost_if_dead(e, f"the checkpoint of step {trainer.step}") from e
    return recovered_s
