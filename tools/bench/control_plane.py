"""The control plane of one MarsRL step at paper shape, with no model: driver CPU per step and the bytes
each trainer rank receives against its share.

What runs is the trainer's own code from the scheduler to the packs; only the work of the models is
simulated:

* **real**: the :class:`~mars_megatron.pipeline.scheduler.Scheduler` built as the trainer builds it from
  ``examples/qwen3_30b_a3b.yaml`` (128 problems per step, G = 8, 5 positions, 2 inputs per later
  position, segments of 16k), in ``pipeline.mode=sync`` so that one step trains every output of its 128
  problems; the driver's segment requests (a continuing segment names its context in the object store:
  :class:`~mars_megatron.pipeline.contexts.ContextIndex`),
  ``record_outputs``, ``score_request``s scored by a real :class:`~mars_megatron.pipeline.facades.RewardPool`
  actor (math-verify and the verdict reader), ``on_scored``; the driver's ``_training_data``
  (``assign_advantages``, ``balance_roles``, ``TrainerGroup.split``); the dispatch
  ``TrainerGroup.submit`` (the batch cut into data-parallel shares, each mini-batch planned once:
  ``rl/shares.py``) on a real
  :class:`~mars_megatron.training.ray_group.RayWorkerGroup` of 8 rank actors (gloo world, one torch rank
  each); on every rank ``PolicyWorker.train`` and ``PolicyWorker._pack`` with ``check_sample_routing``
  and ``MegatronEngine.pack_micro_batches`` (``build_pack``, ``pack_routing``) bound to a model-less
  engine.
* **simulated**: decoding. A stand-in engine writes each segment: response lengths log-normal around 16k
  tokens (sigma 0.6, capped at 64k: seeded per sample as pipeline/simulate.py draws them), random token ids
  of Qwen3's vocabulary, log-probs, and the R3 routing of every position the call fed ([positions, 48
  layers, top-8] uint8, Qwen3-30B-A3B's shape from examples/hf_configs); whether an output is right is a
  seeded coin flip per role (as simulate.py). Text is a stand-in for the tokenizer's decode (4 characters
  a token) ending in a boxed answer and a Correctness verdict, which the real checker scores. Prompts are
  the problem (1k tokens) plus the outputs they carry (solution, report), cut to 32k as the chat codec
  cuts them. The stand-in engine runs in a Ray actor of its own and answers as
  ``RolloutActor.generate_versioned`` does (``OutputBatch``): tokens and log-probs as columns, the
  routing put in the actor's object store (``RoutingRef``), which each rank fetches for its own
  samples. What it must know of each sample (role, length so far, the judged solution's outcome) is sent
  to it before each call, outside the driver's figures.

Counted: driver CPU is ``time.process_time`` of this process inside the driver's phases only (schedule,
rollout I/O, record, rewards, advantages, dispatch, wait), less what the process burns idle over each
phase's wall time (Ray's own threads poll: the rate is measured with every actor up and the driver asleep,
and printed); the simulated engine, the reward actor and the byte counting are left out. Bytes are the
pickle protocol 5 size with out-of-band buffers counted (in-band stream + raw numpy buffers: what Ray's
serialiser writes): ``total`` is the update's whole batch, measured on the driver, the routing it holds by
reference counted at its size; ``received`` is what reached a rank's ``train``, its routing fetched
included, measured on the rank, so a ``submit`` that shards is measured without editing this file;
``share`` is the samples of the rank's own packs. Rank CPU: receiving (the rank process's CPU from just
before the dispatch to the call's first line: Ray's fetch and deserialisation; then fetching its samples'
routing), the routing check, and the plan and packs. Not in the figures: the real tokenizer (decoding
every output, templating every prompt: the stand-ins here are a string repeat and an array copy).

Points. A paper step holds about 9,200 outputs and 380M tokens (prompts carry earlier outputs), and R3
routing is 384 bytes a token: a batch of about 140 GiB, not a 24 GiB machine. So each step is measured at
a *point*, ``scale:problems``: every token count (lengths, caps, segments, pack length) times ``scale``,
with ``problems`` problems (the paper's 128 unless named). The default points are 128 problems at token
scales 1/1024 and 1/128 (a paper step's samples, groups and schedule with short arrays), then 8 and 2
problems at scale 1/4 and 2 problems at scale 1 (a paper step's own array sizes: a 16k-token segment
crosses Ray through the object store, where a 16-token one travels inline). The last three pin the parts
at those sizes: 8 and 2 problems at 1/4 differ in their samples at the same lengths, 2 problems at 1/4
and at 1 only in their tokens (four times as many). Each figure is the median of ``--steps`` steps per
point, fitted by least squares relative to each point's own figure as ``per step + per sample x samples
+ per token x tokens`` (no part negative: :class:`Cost`), and the paper column is that fit at a paper
step's samples and tokens. That column is an extrapolation, never a measurement; wall times and the
simulated engine are not extrapolated (2 shared cores say nothing of a cluster's wall time). Ratios
are judged at the points of 128 problems (a few problems balance worse over 8 ranks).

With no arguments it runs 3 steps at each default point on 8 ranks (after an unreported warm-up step of
one problem) and prints the driver's CPU seconds per phase, wall seconds, bytes per rank against total / DP
and against the rank's share, the ranks' CPU, peak memory, and the paper-scale extrapolation beside the
goals (driver <= 5 s per step, bytes per rank <= 1.1 x total / DP): about 4 minutes on 2 cores, with
about 11 GiB of the machine's memory in use at the peak (a paper-length point's routing is 2.2 GiB in the
object store, and again on the ranks).

Starts Ray: run it inside a loopback-only network namespace, e.g.
    unshare -n bash -c 'ip link set lo up && python tools/bench/control_plane.py'
    python tools/bench/control_plane.py --scales 1/1024,1/256,1:4 --steps 5 agents.inputs_per_agent=1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pickle
import random
import resource
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
PAPER_CONFIG = REPO / "examples" / "qwen3_30b_a3b.yaml"
MEDIAN_RESPONSE = 16384
"""The issue's shape: responses log-normal around 16k tokens (capped by rollout.max_response_tokens)."""
SIGMA = 0.6
PROMPT_TOKENS = 1024
"""The problem and instructions, before any carried output."""
ACCURACY = {"solver": 0.7, "verifier": 0.8, "corrector": 0.5}
"""Chance an output is right (an answer that matches, a verdict that is true), as tools/bench/pipeline.py."""
FILLER = "tok "
"""A token's text: 4 characters, about what a tokenizer's token of English and maths decodes to."""
YES, NO, FIRST_ID = 1, 2, 3
"""Token ids: an output's last token says whether it answers right / accepts; the rest are >= FIRST_ID."""
ENDINGS = {
    YES: "\n\nThe answer is \\boxed{1}.\n\n**Correctness**: Correct",
    NO: "\n\nThe answer is \\boxed{0}.\n\n**Correctness**: Wrong",
}
REFERENCE = "1"
DRIVER_PHASES = ("schedule", "rollout I/O", "record", "rewards", "advantages", "dispatch", "wait")
GOAL_DRIVER_S = 5.0
GOAL_BYTES_RATIO = 1.1


# ------------------------------------------------------------------------------------------------ shape
@dataclass(frozen=True)
class Shape:
    """One measured point: the paper's config with every token count times ``scale``."""

    scale: Fraction
    cfg: Any
    """The MarsConfig the ranks and the scheduler read (scaled token fields, a dp-only layout)."""
    lengths: Any
    """simulate.Lengths: the response lengths drawn, prompt size and input cap, scaled."""


@dataclass(frozen=True, order=True)
class Point:
    """Where a step is measured: every token count times ``scale``, with ``problems`` problems."""

    scale: Fraction
    problems: int

    def __str__(self) -> str:
        return f"{self.scale} x {self.problems}"


def scaled(tokens: int, scale: Fraction) -> int:
    return max(1, round(tokens * scale))


def paper_shape(scale: Fraction, overrides: Sequence[str] = ()) -> Shape:
    """The paper config at ``scale``. ``pipeline.mode=sync`` makes one step every output of its 128
    problems (the issue's 128 x G x 5 positions); the layout is dp only (``parallel.* = 1``): the ranks
    here are data-parallel replicas, as the issue's bytes goal (total / DP) assumes. The pack length is
    the paper's 32k input + 64k response, so no sample is cut at any scale."""
    from mars_megatron.config import load_config
    from mars_megatron.pipeline.simulate import Lengths

    max_in, max_out = scaled(32768, scale), scaled(65536, scale)
    cfg = load_config(
        PAPER_CONFIG,
        [
            "pipeline.mode=sync",
            *(f"parallel.{k}=1" for k in ("tp", "pp", "cp", "ep", "etp")),
            "parallel.sequence_parallel=false",
            f"rollout.max_input_tokens={max_in}",
            f"rollout.max_response_tokens={max_out}",
            f"pipeline.segment_tokens={scaled(16384, scale)}",
            f"train.pack_length={max_in + max_out}",
            f"model.hf_dir={REPO / 'examples/hf_configs/qwen3-30b-a3b'}",
            *overrides,
        ],
    )
    roles = ("solver", "verifier", "corrector")
    lengths = Lengths(
        dict.fromkeys(roles, MEDIAN_RESPONSE * float(scale)),
        sigma=SIGMA,
        prompt_tokens=scaled(PROMPT_TOKENS, scale),
        max_input_tokens=max_in,
    )
    return Shape(scale, cfg, lengths)


def arch_of(cfg: Any) -> Any:
    """Qwen3-30B-A3B's architecture (48 MoE layers, 128 experts, top-8) from the shipped config.json."""
    from mars_megatron.models.hf_config import load_hf_config

    return load_hf_config(cfg.model.hf_dir)


# ----------------------------------------------------------------------------------- simulated decoding
def carried_prompts(lengths: Any, vocab: int) -> Any:
    """The scheduler's prompt function: the problem's tokens, then the outputs the position reads (the
    solution judged, the report), cut in the middle to ``max_input_tokens`` as ``ChatCodec`` truncates.
    Stands in for the chat template: the prompt holds the tokens it would, not their text."""
    heads: dict[str, np.ndarray] = {}

    def prompt_fn(position: str, problem: Any, inputs: Any) -> np.ndarray:
        head = heads.get(problem.problem_id)
        if head is None:
            rng = np.random.default_rng(problem.line)
            head = heads[problem.problem_id] = rng.integers(
                FIRST_ID, vocab, lengths.prompt_tokens, dtype=np.int32
            )
        ids = np.concatenate(
            [head, *(q.response_ids for q in (inputs.solution, inputs.report) if q is not None)]
        )
        cap = lengths.max_input_tokens
        if len(ids) > cap:
            ids = np.concatenate((ids[: cap // 2], ids[len(ids) - (cap - cap // 2) :]))
        return ids

    return prompt_fn


class SimulatedEngine:
    """Stands in for a rollout engine: answers segment requests with random tokens, log-probs and routing
    of the model's shape. How long each output gets and whether it is right are seeded per sample (the
    lengths as :class:`~mars_megatron.pipeline.simulate.Lengths` draws them, the outcome as
    ``Simulation._score`` flips it), from what the scheduler's records say of each sample (its role, its
    length so far, whether the solution it judges is right: the oracle, :func:`oracle_of`)."""

    def __init__(self, shape: Shape, arch: Any, seed: int) -> None:
        from mars_megatron.rollout.engine import routing_dtype

        self.oracle: dict[str, SimpleNamespace] = {}
        self.lengths = shape.lengths
        self.seed = seed
        self.vocab = arch.vocab_size
        rows = 2 * (shape.cfg.rollout.max_input_tokens + shape.cfg.rollout.max_response_tokens)
        layers, k, experts = sum(arch.moe_layers), arch.moe_topk, arch.num_experts
        rng = np.random.default_rng(seed)
        base = rng.integers(0, experts, (rows, layers, 1))
        # distinct experts per position and layer, as a router's top-k: check_routing insists
        self.routing = ((base + np.arange(k) * (experts // k)) % experts).astype(routing_dtype(experts))

    def know(self, oracle: Mapping[str, tuple[str, int, bool | None]]) -> None:
        """What the next call's samples are (the bench's, not an engine's: see :func:`oracle_of`)."""
        self.oracle = {
            sid: SimpleNamespace(sample_id=sid, role=role, response_len=done, judged_right=judged)
            for sid, (role, done, judged) in oracle.items()
        }

    def serve(self, batch: Any, version: int) -> tuple[Any, int, float]:
        """One engine call as ``RolloutActor.generate_versioned`` answers it (``OutputBatch.of``: tokens
        and log-probs as columns, the routing left in this actor's object store, each cut output's next
        context carried back), and the CPU seconds the engine spent (fetching the contexts requests
        continue included)."""
        from mars_megatron.rollout.batch import answer

        start = time.process_time()
        outputs = answer(batch, self.generate, routing_by_reference=True)
        return outputs, version, time.process_time() - start

    def generate(self, requests: Sequence[Any]) -> list[Any]:
        from mars_megatron.rollout.engine import GenerationOutput

        outputs = []
        for r in requests:
            q = self.oracle[r.request_id]
            target = self.lengths.draw(q, self.seed)
            n = max(1, min(r.sampling.max_tokens, target - q.response_len))
            stopped = q.response_len + n >= target
            rng = np.random.default_rng(r.sampling.seed)
            ids = rng.integers(FIRST_ID, self.vocab, n)
            if stopped:
                ids[-1] = YES if self._says_yes(q) else NO
            logprobs = -rng.exponential(1.0, n)
            rows = len(r.prompt_ids) + n - 1
            start = int(rng.integers(0, self.routing.shape[0] - rows + 1))
            routed = self.routing[start : start + rows].copy()
            finish = "stop" if stopped else "length"
            outputs.append(GenerationOutput(r.request_id, ids, logprobs, finish, routed_experts=routed))
        return outputs

    def _says_yes(self, q: Any) -> bool:
        """A solution's answer is right, or a report accepts: right with the role's accuracy."""
        from mars_megatron.seeds import derive_seed

        right = random.Random(derive_seed(self.seed, q.sample_id, "reward")).random() < ACCURACY[q.role]
        if q.judged_right is None or q.role != "verifier":
            return right
        return q.judged_right if right else not q.judged_right


def oracle_of(samples: Mapping[str, Any], jobs: Sequence[Any]) -> dict[str, tuple[str, int, bool | None]]:
    """What the stand-in engine needs to know of each job's sample to decide its length and outcome, as
    plain values (the engine runs in an actor of its own)."""
    return {
        j.sample_id: (j.role, samples[j.sample_id].response_len, samples[j.sample_id].judged_right)
        for j in jobs
    }


def engine_actor(shape: Shape, arch: Any, seed: int) -> Any:
    """:class:`SimulatedEngine` in a Ray actor of its own, as a rollout engine runs: its work and its
    object store are not the driver's."""
    import ray

    return ray.remote(num_cpus=0)(SimulatedEngine).remote(shape, arch, seed)


def decode(ids: Sequence[int]) -> str:
    """Stands in for the tokenizer's decode: 4 characters a token, ending in the output's answer and
    verdict (a response cut by the token budget ends in neither)."""
    return FILLER * (len(ids) - 1) + ENDINGS.get(int(ids[-1]), FILLER) if len(ids) else ""


# ------------------------------------------------------------------------------------------- the ranks
def serialized_bytes(obj: Any) -> int:
    """Bytes of ``obj`` pickled with protocol 5, out-of-band buffers included: the in-band stream plus
    every numpy array's raw bytes, which is what Ray's serialiser writes for a task argument."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(stream) + sum(memoryview(b).nbytes for b in buffers)


def batch_bytes(batches: Mapping[str, Sequence[Any]]) -> int:
    """The update's batch as the driver dispatches it, plus the routing its samples hold by reference
    (``RoutingRef``: in the engines' object stores, each rank fetching its own), at the arrays' size."""
    from mars_megatron.agents.sample import RoutingRef

    referenced = sum(
        int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize
        for samples in batches.values()
        for s in samples
        if isinstance(r := s.routed_experts, RoutingRef)
    )
    return serialized_bytes(dict(batches)) + referenced


def packing_rank_class() -> type:
    """:class:`~mars_megatron.rl.worker.PolicyWorker` without its model: the real ``train`` and ``_pack``,
    with a ``_train_policy`` that stops where the first forward would start, on a model-less engine whose
    ``pack_spec`` and ``pack_micro_batches`` are ``MegatronEngine``'s own. Built in a function so that
    importing this file (``--help``) needs no torch."""
    import torch.distributed as dist

    from mars_megatron.agents.sample import fetch_routing
    from mars_megatron.rl.worker import PolicyWorker, _Policy, check_sample_routing
    from mars_megatron.training.megatron_engine import MegatronEngine

    class PackingEngine:
        """What ``MegatronEngine.pack_spec`` and ``MegatronEngine.pack_micro_batches`` read (the
        data-parallel layout and the architecture), with those methods themselves: a rank packs with the
        engine's own code, whatever it becomes."""

        pack_spec = MegatronEngine.pack_spec
        pack_micro_batches = MegatronEngine.pack_micro_batches
        _seq_multiple = MegatronEngine._seq_multiple
        _sample_multiple = MegatronEngine._sample_multiple

        def __init__(self, cfg: Any, arch: Any, dp: int, dp_rank: int) -> None:
            self.arch, self.parallel = arch, cfg.parallel
            self.impl = cfg.model.transformer_impl
            self.dp, self.dp_rank, self.cp = dp, dp_rank, cfg.parallel.cp
            self.config = SimpleNamespace(sequence_parallel=cfg.parallel.sequence_parallel)

    class PackingRank(PolicyWorker):
        """One trainer rank of the bench; reports what it received and what its packs hold."""

        def __init__(self, cfg: Any, names: Sequence[str]) -> None:  # no super(): it builds the model
            self.names = list(names)
            self.configure(cfg)
            self.mark()

        def configure(self, cfg: Any) -> None:
            """A new scale: its config (pack length) and the engine reading it."""
            self.cfg, self.loss = cfg, cfg.algorithm
            engine = PackingEngine(cfg, arch_of(cfg), dist.get_world_size(), dist.get_rank())
            self.policies = {name: _Policy(engine, None, None) for name in self.names}  # type: ignore[arg-type]

        def rank_info(self) -> dict[str, Any]:
            """As a trainer rank answers it (no Megatron here: the world is data-parallel only)."""
            rank = dist.get_rank()
            return {
                "backend": str(dist.get_backend()),
                "rank": rank,
                "dp_rank": rank,
                "writer": int(rank == 0),
            }

        def mark(self) -> None:
            """Called just before a dispatch: the rank's CPU from here to ``train`` is receiving it."""
            gc.collect()
            self._marked = time.process_time()

        def train(self, batches: Mapping[str, Any]) -> dict[str, float]:
            receive_cpu, arrived = time.process_time() - self._marked, time.time()
            metrics = super().train(batches)
            totals: dict[str, float] = defaultdict(float)
            for key, value in metrics.items():  # summed over policies ("train/" or "train/<name>/")
                totals[key.rsplit("/", 1)[-1]] += value
            totals.update(
                receive_cpu=receive_cpu + totals.pop("fetch_cpu", 0.0),
                arrived=arrived,
                received_bytes=serialized_bytes(dict(batches)),
                received_samples=sum(len(share.own()) for share in batches.values()),
                received_tokens=sum(
                    len(s.prompt_ids) + s.response_len for share in batches.values() for s in share.own()
                ),
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                rank=dist.get_rank(),
            )
            return dict(totals)

        def _train_policy(self, policy: Any, share: Any) -> dict[str, float]:
            """What ``PolicyWorker._train_policy`` does before the model: R3's routing fetched and
            checked, then this rank's packs (``_pack``: the micro-batches of its share's packs)."""
            start = fetched = time.process_time()
            if self.cfg.moe.routing_replay == "R3":
                fetch_routing(share.own())
                fetched = time.process_time()
                check_sample_routing(share.own(), policy.megatron.arch)
            checked = time.process_time()
            updates = self._pack(policy.megatron, share)
            packs_cpu = time.process_time() - checked
            own = [
                u.share[i] for u in updates for mb in u.micro_batches if mb.pack for i in mb.pack.sample_ids
            ]
            return {
                "fetch_cpu": fetched - start,
                "check_cpu": checked - fetched,
                "pack_cpu": packs_cpu,
                "packs": float(sum(len(u.micro_batches) for u in updates)),
                "share_bytes": float(serialized_bytes(own)),
                "share_samples": float(len(own)),
                "share_tokens": float(sum(len(s.prompt_ids) + s.response_len for s in own)),
            }

    return PackingRank


@dataclass
class RankFigures:
    """What one rank received, what its packs hold, and its CPU seconds."""

    rank: int
    received_bytes: int
    share_bytes: int
    received_samples: int
    share_samples: int
    share_tokens: int
    receive_cpu: float
    check_cpu: float
    pack_cpu: float
    receive_wall: float
    """From the driver's submit to the first line of the rank's train (transfer and deserialisation)."""
    peak_rss: int

    @property
    def received_over_share(self) -> float:
        """1.0 when a rank receives exactly its own packs' samples; today about DP (it receives all)."""
        return self.received_bytes / max(1, self.share_bytes)

    @property
    def cpu(self) -> float:
        return self.receive_cpu + self.check_cpu + self.pack_cpu


def rank_figures(result: Mapping[str, float], submitted: float) -> RankFigures:
    return RankFigures(
        rank=int(result["rank"]),
        received_bytes=int(result["received_bytes"]),
        share_bytes=int(result["share_bytes"]),
        received_samples=int(result["received_samples"]),
        share_samples=int(result["share_samples"]),
        share_tokens=int(result["share_tokens"]),
        receive_cpu=result["receive_cpu"],
        check_cpu=result["check_cpu"],
        pack_cpu=result["pack_cpu"],
        receive_wall=result["arrived"] - submitted,
        peak_rss=int(result["peak_rss"]),
    )


# ------------------------------------------------------------------------------------------- the driver
def idle_cpu_rate(seconds: float = 2.0) -> float:
    """CPU seconds a wall second this process spends doing nothing (Ray's own threads: polling, heartbeats;
    about 2 to 3 ms a second here), measured while it sleeps."""
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return max(0.0, (time.process_time() - cpu) / (time.perf_counter() - wall))


class PhaseClock:
    """CPU (``process_time``: every thread, Ray's included) and wall seconds of this process, per named
    phase. A phase's *work* is its CPU less what the process burns idle over the phase's wall time
    (``idle_rate``): on 2 shared cores a driver waits long for 8 ranks, and that idle burn would otherwise
    be charged to the step's data (a wait grows with the ranks' work, so it looked like cost per token)."""

    def __init__(self, idle_rate: float = 0.0) -> None:
        self.idle_rate = idle_rate
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.cpu[name] += time.process_time() - cpu
            self.wall[name] += time.perf_counter() - wall

    def idle(self, name: str) -> float:
        """The part of phase ``name``'s CPU that the process would have burnt idle."""
        return min(self.cpu[name], self.idle_rate * self.wall[name])

    def work(self, name: str) -> float:
        return self.cpu[name] - self.idle(name)

    def driver_cpu(self) -> float:
        """The driver's work over the step: its phases' CPU, the idle burn left out."""
        return sum(self.work(p) for p in DRIVER_PHASES)


@dataclass
class StepFigures:
    """One measured step."""

    point: Point
    samples: int
    tokens: int
    """Prompt + response tokens of the samples trained."""
    total_bytes: int
    """The update's whole batch, serialised (what ``submit`` hands to Ray)."""
    wall: float
    clock: PhaseClock
    ranks: list[RankFigures]
    driver_peak_rss: int = 0

    @property
    def dp(self) -> int:
        return len(self.ranks)

    def over_fair(self, r: RankFigures) -> float:
        """Bytes received against the rank's fair part of the batch, total / DP (the goal: <= 1.1)."""
        return r.received_bytes / (self.total_bytes / self.dp)


class Bench:
    """The driver side of the bench: the scheduler, reward pool, rank group and trainer facade of a run
    at one shape (the ranks and the reward actor are kept across shapes)."""

    def __init__(self, ranks: int, shape: Shape) -> None:
        from mars_megatron.agents.graph_file import graph_for, policy_names
        from mars_megatron.pipeline.facades import RewardPool, TrainerGroup, TrainerRanks
        from mars_megatron.training.ray_group import RayWorkerGroup

        self.graph = graph_for(shape.cfg)
        names = policy_names(shape.cfg, self.graph)
        self.group = RayWorkerGroup(
            packing_rank_class(), ranks, shape.cfg, names, num_cpus_per_rank=1, threads_per_rank=1
        )
        ranks_ = TrainerRanks.ask(self.group)
        # no engines to push to
        self.trainers = TrainerGroup(self.group, None, names, self.graph, shape.cfg.train, ranks_)  # type: ignore[arg-type]
        self.rewards = RewardPool(shape.cfg.pipeline.reward_workers)
        self.problems_seen = 0
        self.idle_rate = idle_cpu_rate()  # every actor up and idle
        self.reshape(shape)

    def reshape(self, shape: Shape) -> None:
        """A new scale: a fresh scheduler and driver, the ranks told the new config."""
        from mars_megatron.pipeline.driver import PipelineDriver
        from mars_megatron.pipeline.scheduler import Limits, Scheduler
        from mars_megatron.rollout.engine import SamplingParams

        cfg = shape.cfg
        self.shape = shape
        arch = arch_of(cfg)
        prompts = carried_prompts(shape.lengths, arch.vocab_size)
        scheduler = Scheduler(
            cfg.agents, Limits.from_config(cfg, self.graph), prompts, self.graph, seed=cfg.train.seed
        )
        sampling = SamplingParams(
            max_tokens=cfg.rollout.max_response_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
        )
        # The trainer's driver, for its _training_data (no fleet, codec or problem feed: this bench decodes
        # and admits itself; see rollout()).
        self.driver = PipelineDriver(
            scheduler,
            fleet=None,  # type: ignore[arg-type]
            trainers=self.trainers,
            rewards=self.rewards,
            problems=None,  # type: ignore[arg-type]
            codec=None,  # type: ignore[arg-type]
            sampling=sampling,
            max_batch=cfg.rollout.max_batch,
            shared_reward=cfg.algorithm.reward == "shared",
            filter_zero_variance=cfg.algorithm.filter_zero_variance,
        )
        if getattr(self, "engine", None) is not None:
            import ray

            ray.kill(self.engine)
        self.engine = engine_actor(shape, arch, cfg.train.seed)
        self.group.call("configure", cfg)
        self.trainers.train = cfg.train  # this scale's pack length

    def close(self) -> None:
        self.rewards.close()
        self.group.shutdown()


def dispatch(trainers: Any, batches: Mapping[str, list[Any]]) -> list[Any]:
    """The update's samples to the ranks, as the driver sends them (``PipelineDriver._start_update``):
    ``TrainerGroup.submit``: each data-parallel rank's share, one ``ray.put`` each (before issue 32, one
    ``ray.put`` of the whole batch that every rank read); the ranks measure what reaches them."""
    return trainers.submit(batches)


def add_problems(bench: Bench, count: int) -> None:
    from mars_megatron.evaluation.data import Problem

    start = bench.problems_seen
    bench.driver.scheduler.add_problems(
        Problem(f"p{i}", f"problem {i}", REFERENCE, i + 1) for i in range(start, start + count)
    )
    bench.problems_seen += count


def rollout(bench: Bench, clock: PhaseClock) -> None:
    """Decode and score until the update is due, as ``PipelineDriver`` does: segments for each of
    ``pipeline.rollout_workers`` engines (``rollout.max_batch`` each), their outputs recorded, the finished
    ones scored by the reward pool and put back on the scheduler."""
    import ray

    from mars_megatron.pipeline.agents import record_outputs

    d, s = bench.driver, bench.driver.scheduler
    while True:
        with clock.phase("schedule"):
            if s.update_ready():
                return
            calls = [s.take_segments(d.max_batch) for _ in range(bench.shape.cfg.pipeline.rollout_workers)]
            calls = [jobs for jobs in calls if jobs]
        if not calls:
            raise RuntimeError(f"the schedule stalled: {s.stats()}")
        finished: list[str] = []
        for jobs in calls:
            with clock.phase("oracle (not the driver's)"):
                bench.engine.know.remote(oracle_of(s.samples, jobs))
            with clock.phase("rollout I/O"):
                call = bench.engine.serve.remote(d.contexts.request_batch(jobs, d.sampling), s.version)
            with clock.phase("engine (not the driver's)"):
                ray.wait([call])
            with clock.phase("rollout I/O"):
                outputs, version, engine_cpu = ray.get(call)
            clock.cpu["engine (simulated)"] += engine_cpu
            with clock.phase("record"):
                finished.extend(record_outputs(s, jobs, outputs.outputs(), decode, version))
                d.contexts.received(outputs, call, s)
        score(bench, finished, clock)


def score(bench: Bench, finished: Sequence[str], clock: PhaseClock) -> None:
    """The finished outputs' rewards, from a real reward actor, onto the records (``_on_reward``). As
    ``PipelineDriver`` does, the driver waits for the result (``ray.wait``: the reward actor's time, not
    the driver's) before it takes it."""
    import ray

    from mars_megatron.pipeline.agents import score_request

    if not finished:
        return
    s = bench.driver.scheduler
    with clock.phase("rewards"):
        requests = [score_request(s, sid) for sid in finished]
        ref = bench.rewards.score(0, requests)
    with clock.phase("reward actor (not the driver's)"):
        ray.wait([ref])
    with clock.phase("rewards"):
        for sid, reward, verdict, info in ray.get(ref):
            s.on_scored(sid, reward, verdict, info)


def run_step(bench: Bench, step: int, problems: int) -> StepFigures:
    """One update: rollouts of ``problems`` problems, advantages, the dispatch to every rank and their
    packs; then the driver's bookkeeping of a finished update."""
    import ray

    from mars_megatron.pipeline.agents import batch_metrics

    clock = PhaseClock(bench.idle_rate)
    add_problems(bench, problems)
    gc.collect()
    start = time.perf_counter()
    rollout(bench, clock)
    s = bench.driver.scheduler
    with clock.phase("schedule"):
        batch = s.take_batch()
        assert batch is not None
    with clock.phase("advantages"):
        batches, stats = bench.driver._training_data(batch, step)
    with clock.phase("measure (not the driver's)"):
        total = batch_bytes(batches)
        bench.group.call("mark")
    submitted = time.time()
    with clock.phase("dispatch"):
        handles = dispatch(bench.trainers, batches)
    with clock.phase("ranks (not the driver's)"):
        ray.wait(list(handles), num_returns=len(handles))
    with clock.phase("wait"):  # the results, once the ranks are done
        results = bench.group.wait(handles)
    with clock.phase("schedule"):
        s.on_trained()
        s.release(batch)
        s.check()
        bench.driver.contexts.prune(s)
        batch_metrics(batch, bench.graph)
    wall = time.perf_counter() - start - clock.wall["measure (not the driver's)"]
    return StepFigures(
        point=Point(bench.shape.scale, problems),
        samples=int(stats["samples/trained"]),
        tokens=int(stats["tokens"]),
        total_bytes=total,
        wall=wall,
        clock=clock,
        ranks=sorted((rank_figures(r, submitted) for r in results), key=lambda r: r.rank),
        driver_peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


# ------------------------------------------------------------------------------------------ the figures
@dataclass(frozen=True)
class Figure:
    """A printed figure: its name, how to read it off a step, and its kind, which says how it scales.
    ``cpu``, ``bytes``: grow with samples and tokens (fitted, extrapolated); ``ratio``: the same at every
    scale (averaged); ``wall``, ``sim``: measured only (wall time on 2 shared cores says nothing about
    paper hardware; the engine is simulated); ``count``: tokens and samples."""

    name: str
    kind: str
    read: Any


def _rank_max(attr: str) -> Any:
    return lambda step: max(getattr(r, attr) for r in step.ranks)


FIGURES = [
    *(Figure(f"driver CPU s: {p}", "cpu", lambda step, p=p: step.clock.work(p)) for p in DRIVER_PHASES),
    Figure("driver CPU s: total", "cpu", lambda step: step.clock.driver_cpu()),
    Figure(
        "driver CPU s: idle burn (left out)",
        "wall",
        lambda step: sum(step.clock.idle(p) for p in DRIVER_PHASES),
    ),
    Figure("driver wall s: step", "wall", lambda step: step.wall),
    Figure("engine CPU s (simulated)", "sim", lambda step: step.clock.cpu["engine (simulated)"]),
    Figure("bytes: total (batch)", "bytes", lambda step: step.total_bytes),
    Figure("bytes: total / DP", "bytes", lambda step: step.total_bytes / step.dp),
    Figure("bytes: received / rank (max)", "bytes", _rank_max("received_bytes")),
    Figure("bytes: share / rank (max)", "bytes", _rank_max("share_bytes")),
    Figure("received / (total/DP) (max)", "ratio", lambda step: max(step.over_fair(r) for r in step.ranks)),
    Figure("received / share (max)", "ratio", _rank_max("received_over_share")),
    Figure("rank CPU s: receive (max)", "cpu", _rank_max("receive_cpu")),
    Figure("rank CPU s: routing check (max)", "cpu", _rank_max("check_cpu")),
    Figure("rank CPU s: plan + packs (max)", "cpu", _rank_max("pack_cpu")),
    Figure("rank CPU s: total (max)", "cpu", _rank_max("cpu")),
    Figure("rank wall s: submit to train (max)", "wall", _rank_max("receive_wall")),
    Figure("tokens", "count", lambda step: step.tokens),
    Figure("samples", "count", lambda step: step.samples),
]


def median_figures(steps: Sequence[StepFigures]) -> dict[str, float]:
    """Each figure's median over the steps of one scale."""
    return {f.name: statistics.median(float(f.read(s)) for s in steps) for f in FIGURES}


RELATIVE_FLOOR = 0.05
"""A point's weight in the fit is one over its figure, or over this fraction of the largest figure if
that is more (a phase that costs next to nothing at some point)."""


@dataclass(frozen=True)
class Cost:
    """``figure = per_step + per_sample * samples + per_token * tokens``, fitted by weighted least squares
    through the measured points. Points of 128 problems at small token scales pin what each sample costs (the
    schedule, the records' fields, Ray's calls); points at or near the paper's own token lengths with a
    few problems pin what a token costs at the array sizes a paper step has (a 16k-token segment crosses
    Ray through the object store, a 16-token one inline), so the per-token part is measured rather than
    read off a slope between tiny arrays; and a step's fixed costs (a call to every rank, the pack plan's
    set-up) are not charged to the tokens of a step with few samples. No part is negative (no cost falls
    as the work grows): the fit is the best over the parts left in, each set tried. Too few points for
    three parts put everything on the tokens: an upper bound.

    Each point is weighted by the inverse of its own figure (:data:`RELATIVE_FLOOR` keeps a figure near
    zero from taking all the weight): the points span 0.1 to 2 s of driver CPU and a step's noise grows
    with it (the same point measured 0.12 to 0.19 s on different runs, a 2 s point 1.75 to 2.24 s).
    Unweighted, the two 2 s points decide the fit and a 30 % miss at a 0.12 s point costs it nothing, so
    the per-token part was read off whatever the 128-problem points' noise left over (fits of two runs of
    the same code: 10.4 and 2.0 s a paper step)."""

    per_step: float
    per_sample: float
    per_token: float

    @classmethod
    def fit(cls, samples: Sequence[float], tokens: Sequence[float], ys: Sequence[float]) -> Cost:
        columns = np.column_stack([np.ones(len(ys)), np.asarray(samples, float), np.asarray(tokens, float)])
        y = np.asarray(ys, float)
        if np.linalg.matrix_rank(columns / columns.max(axis=0)) < 3:
            return cls(0.0, 0.0, float(y.sum() / columns[:, 2].sum()))
        weight = 1.0 / np.maximum(np.abs(y), RELATIVE_FLOOR * max(float(np.abs(y).max()), 1e-300))
        columns, y = columns * weight[:, None], y * weight
        best: tuple[float, np.ndarray] | None = None
        for kept in ((0, 1, 2), (1, 2), (0, 2), (0, 1), (2,), (1,), (0,)):
            x = columns[:, kept]
            part = np.linalg.lstsq(x, y, rcond=None)[0]
            if (part < 0).any():
                continue
            residual = float(((x @ part - y) ** 2).sum())
            if best is None or residual < best[0] - 1e-12 * float(y @ y):
                full = np.zeros(3)
                full[list(kept)] = part
                best = (residual, full)
        parts = best[1] if best is not None else np.zeros(3)
        return cls(float(parts[0]), float(parts[1]), float(parts[2]))

    def at(self, samples: float, tokens: float) -> float:
        return self.per_step + self.per_sample * samples + self.per_token * tokens


@dataclass(frozen=True)
class Extrapolation:
    """Every figure as ``samples x per_sample + tokens x per_token``, and its value at a paper step."""

    samples: float
    """A paper step's samples: the measured samples per problem times the config's problems per step."""
    tokens: float
    """A paper step's tokens: its samples times the tokens per sample at scale 1 (the line of tokens per
    sample through the measured scales)."""
    paper: dict[str, float]
    per_step: dict[str, float]
    per_sample: dict[str, float]
    per_token: dict[str, float]


def extrapolate(points: Mapping[Point, Mapping[str, float]], problems: int) -> Extrapolation:
    """The paper-scale figures (``problems`` per step) from the measured points: a :class:`Cost` per
    figure. Ratios are averaged over the full-size points (:func:`full_size`); wall times and the
    simulated engine are not extrapolated."""
    samples = [p["samples"] for p in points.values()]
    tokens = [p["tokens"] for p in points.values()]
    paper_samples = statistics.fmean(p["samples"] / k.problems for k, p in points.items()) * problems
    per_sample_tokens = [t / n for t, n in zip(tokens, samples, strict=True)]
    scales = [float(k.scale) for k in points]
    if len(set(scales)) < 2:
        at_one = statistics.fmean(per_sample_tokens) / statistics.fmean(scales)
    else:
        slope, intercept = statistics.linear_regression(scales, per_sample_tokens)
        at_one = intercept + slope
    paper_tokens = at_one * paper_samples
    paper: dict[str, float] = {"tokens": paper_tokens, "samples": paper_samples}
    per_step: dict[str, float] = {}
    per_sample: dict[str, float] = {}
    per_token: dict[str, float] = {}
    full = full_size(points, problems)
    for f in FIGURES:
        ys = [p[f.name] for p in points.values()]
        if f.kind == "ratio":  # a few problems over 8 ranks balance worse than a paper step's 128
            paper[f.name] = statistics.fmean(points[k][f.name] for k in full)
        elif f.kind in ("cpu", "bytes"):
            cost = Cost.fit(samples, tokens, ys)
            paper[f.name] = cost.at(paper_samples, paper_tokens)
            per_step[f.name] = cost.per_step
            per_sample[f.name] = cost.per_sample
            per_token[f.name] = cost.per_token
    return Extrapolation(paper_samples, paper_tokens, paper, per_step, per_sample, per_token)


def fmt(kind: str, value: float | None, unit: str = "") -> str:
    """A figure for the table: seconds, bytes (B/KiB/MiB/GiB), ratios, counts."""
    if value is None:
        return "-"
    if kind in ("cpu", "wall", "sim"):
        if unit == "per token":
            return f"{value * 1e9:,.0f} ns"
        if unit == "per sample":
            return f"{value * 1e6:,.1f} us"
        return f"{value:,.3f}"
    if kind == "bytes":
        for size, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= size:
                return f"{value / size:,.1f} {name}"
        return f"{value:,.1f} B"
    if kind == "ratio":
        return f"{value:.2f}x"
    return f"{value:,.0f}"


def goal(name: str, paper: float | None) -> str:
    limits = {"driver CPU s: total": GOAL_DRIVER_S, "received / (total/DP) (max)": GOAL_BYTES_RATIO}
    if name not in limits:
        return ""
    verdict = "" if paper is None else (": met" if paper <= limits[name] else ": not met")
    return f"<= {limits[name]:g}{' s' if 'CPU' in name else 'x'}{verdict}"


def print_table(points: Mapping[Point, Mapping[str, float]], ex: Extrapolation) -> None:
    """Measured figures at each point (scale x problems), their per-sample and per-token parts, the paper
    extrapolation and the goals."""
    scales = sorted(points)
    heads = [str(s) for s in scales] + ["per step", "per sample", "per token", "paper (extrap.)"]
    print(f"\n{'figure':<36}" + "".join(f"{h:>16}" for h in heads) + "  goal")
    for f in FIGURES:
        cells = [fmt(f.kind, points[s][f.name]) for s in scales]
        cells += [
            fmt(f.kind, ex.per_step.get(f.name)),
            fmt(f.kind, ex.per_sample.get(f.name), "per sample"),
            fmt(f.kind, ex.per_token.get(f.name), "per token"),
            fmt(f.kind, ex.paper.get(f.name)),
            goal(f.name, ex.paper.get(f.name)),
        ]
        print(f"{f.name:<36}" + "".join(f"{c:>16}" for c in cells[:-1]) + f"  {cells[-1]}")


def print_ranks(step: StepFigures) -> None:
    """Per rank at one scale: what it received against total/DP and against its own packs, and its CPU."""
    print(
        f"\nper rank at {step.point} (one step): total {step.total_bytes / 2**20:,.1f} MiB, "
        f"total/DP {step.total_bytes / step.dp / 2**20:,.1f} MiB"
    )
    print(
        f"{'rank':>4}{'samples':>9}{'own':>7}{'received MiB':>14}{'share MiB':>11}{'recv/share':>11}"
        f"{'recv/(tot/DP)':>14}{'receive s':>10}{'check s':>9}{'packs s':>9}{'peak RSS':>10}"
    )
    for r in step.ranks:
        print(
            f"{r.rank:>4}{r.received_samples:>9}{r.share_samples:>7}{r.received_bytes / 2**20:>14,.1f}"
            f"{r.share_bytes / 2**20:>11,.1f}{r.received_over_share:>10.2f}x{step.over_fair(r):>13.2f}x"
            f"{r.receive_cpu:>10.3f}{r.check_cpu:>9.3f}{r.pack_cpu:>9.3f}{r.peak_rss / 2**30:>8.2f}G"
        )


# ------------------------------------------------------------------------------------------------ main
def ship_by_value() -> None:
    """Rank actors build the worker class defined here; imported under another name than ``__main__``
    (a test), this file is no module the actors can import, so Ray sends it by value."""
    import ray.cloudpickle

    if __name__ != "__main__" and __name__ in sys.modules:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def measure(
    points: Sequence[Point],
    *,
    ranks: int = 8,
    steps: int = 1,
    warmup: int = 1,
    overrides: Sequence[str] = (),
    log: Any = print,
) -> dict[Point, list[StepFigures]]:
    """Every point's measured steps, on one rank group and reward actor (Ray must be running). A warm-up
    step of ``warmup`` problems at the first point comes first, unreported (first calls import and
    allocate)."""
    ship_by_value()
    bench = Bench(ranks, paper_shape(points[0].scale, overrides))
    out: dict[Point, list[StepFigures]] = {}
    try:
        if warmup:
            run_step(bench, 0, warmup)
        for point in points:
            bench.reshape(paper_shape(point.scale, overrides))
            out[point] = []
            for k in range(steps):
                step = run_step(bench, k + 1, point.problems)
                out[point].append(step)
                log(
                    f"{point} step {k + 1}: {step.samples:,} samples, {step.tokens:,} tokens, "
                    f"driver {step.clock.driver_cpu():.2f} CPU s, wall {step.wall:.1f} s"
                )
    finally:
        bench.close()
    return out


def parse_point(text: str, problems: int) -> Point:
    """``scale`` or ``scale:problems`` (``1/1024``, ``1:2``)."""
    scale_text, _, count = text.partition(":")
    try:
        scale, n = Fraction(scale_text), int(count) if count else problems
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a point is scale[:problems], e.g. 1/1024 or 1:2; got {text!r}"
        ) from None
    if not 0 < scale <= 1:
        raise argparse.ArgumentTypeError(f"a scale is a fraction in (0, 1], got {scale_text}")
    if n < 1:
        raise argparse.ArgumentTypeError(f"a point's problems must be >= 1, got {count}")
    return Point(scale, n)


DEFAULT_POINTS = "1/1024,1/128,1/4:8,1/4:2,1:2"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scales",
        default=DEFAULT_POINTS,
        help="the measured points, comma-separated: a token scale (a fraction of the paper's lengths), "
        "optionally ':problems' (default: --problems); default 1/1024,1/128,1/4:8,1/4:2,1:2 (128 problems "
        "at two small scales, 8 and 2 problems at a quarter of the paper's lengths, 2 at its own)",
    )
    parser.add_argument("--ranks", type=int, default=8, help="trainer ranks, all data-parallel (default 8)")
    parser.add_argument(
        "--steps", type=int, default=3, help="measured steps per point, their medians printed (default 3)"
    )
    parser.add_argument(
        "--problems",
        type=int,
        default=None,
        help="problems per step of a point that names none, and of the extrapolated paper step (default: "
        "the config's, 128)",
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. agents.inputs_per_agent=1")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or (args.problems is not None and args.problems < 1):
        parser.error("--ranks, --steps and --problems must be >= 1")
    if args.problems is None:
        args.problems = paper_shape(Fraction(1, 1024), args.overrides).cfg.data.problems_per_step
    try:
        args.points = [parse_point(t, args.problems) for t in args.scales.split(",")]
    except argparse.ArgumentTypeError as e:
        parser.error(f"--scales: {e}")
    return args


def full_size(runs: Mapping[Point, Any], problems: int) -> list[Point]:
    """The points with a paper step's problems (all points where none has): where the balance of the
    ranks is judged, as a paper step's samples spread over them."""
    return [k for k in runs if k.problems == problems] or list(runs)


def report(runs: Mapping[Point, Sequence[StepFigures]], problems: int, cfg: Any) -> Extrapolation:
    """Print the measured figures, the extrapolation and the ranks of the largest full-size point; the
    extrapolation."""
    points = {point: median_figures(steps) for point, steps in runs.items()}
    ex = extrapolate(points, problems)
    full = full_size(runs, problems)
    a = cfg.agents
    steps = len(next(iter(runs.values())))
    print(
        f"\none MarsRL step (pipeline.mode=sync): {problems} problems x G {a.group_size} x {a.max_steps} "
        f"positions, {a.inputs_per_agent} inputs per later position; {len(runs[full[0]][0].ranks)} ranks, "
        f"all data-parallel; R3 routing uint8 [positions, 48, 8]; median of {steps} step(s) per point "
        f"(token scale x problems); {len(os.sched_getaffinity(0))} cores"
    )
    print_table(points, ex)
    print(
        "per step, per sample, per token: the least-squares fit (relative to each point's figure) figure = "
        "per step + per sample x samples + per token x tokens through the points, no part negative; "
        "paper (extrap.) = that fit at a paper "
        f"step's {ex.samples:,.0f} samples and {ex.tokens / 1e6:,.0f}M tokens; ratios: the mean over the "
        f"points of {problems} problems. "
        "Extrapolated, not measured: a paper step does not fit this machine."
    )
    print_ranks(runs[max(full)][-1])
    rate = next(iter(runs.values()))[0].clock.idle_rate
    print(
        f"driver peak RSS {max(s.driver_peak_rss for r in runs.values() for s in r) / 2**30:.2f} GiB; "
        f"idle burn {rate * 1e3:.1f} ms of CPU a wall second (the driver asleep, every actor up), left out "
        "of each phase over its wall time"
    )
    return ex


def main() -> None:
    import ray

    args = parse_args()
    ray.init(num_cpus=args.ranks + 2, include_dashboard=False, log_to_driver=False)
    try:
        runs = measure(args.points, ranks=args.ranks, steps=args.steps, overrides=args.overrides)
    finally:
        ray.shutdown()
    report(runs, args.problems, paper_shape(max(runs).scale, args.overrides).cfg)


if __name__ == "__main__":
    main()
