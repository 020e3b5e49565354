"""An agent system as data: the roles, their prompts, the training trajectory, the inference loop,
the rewards and the policy grouping, read from a graph file and checked before anything starts.

The scheduler, the rewards, input selection, the inference loop, the metrics and the checkpoints read a
:class:`AgentGraph`; none of them names a role. The shipped graphs live in ``agents/graphs/<name>/``
(``graph.yaml`` plus one folder of prompt templates per prompt set); ``agents.graph`` names one of them
or a path to a user's ``graph.yaml``.

Why a role is described by *kinds* rather than by code: what the machinery needs to know about an
output is only what it is (a ``solution`` with a boxed answer, a ``report`` on a solution, a
``judgement`` of a report), whether a pass/fail verdict is read from it and how (``correctness``: the
word after the last "Correctness"; ``yes_no``: a leading yes or no), and how it is rewarded
(``answer``: checked against the reference; ``verdict``: the verdict against the truth of the
solution it judged; ``outcome``: the mean reward of what follows it). Everything else is wording, and
wording is the prompt files'.

Tools (MARS-style pairs): a role that writes solutions may declare ``tool: {name, distiller,
max_calls}``. While it writes, it may call that tool (:mod:`mars_megatron.agents.tools` has the call
protocol and the tools); each served call runs the tool locally, then the ``distiller`` role reads the
tool's output and the call's purpose (variables ``tool_output`` and ``purpose``, available to a
distiller only) and writes a ``digest``, which goes back into the caller's response as an observation
masked out of its loss. A distiller is trained at a trajectory position with ``trigger: tool_call`` (see
:class:`PositionSpec`), is rewarded by the outcome of the response it served, and is no loop step: the
caller's step serves its calls (see :class:`ToolSpec` for the exact semantics).

Templates are rendered with a restricted formatter: only plain ``{name}`` fields of the variables the
role declares, no attribute or index access, no conversions or format specs, so nothing read from a
graph file can reach into the program.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from mars_megatron.config import EvalConfig

OutputKind = Literal["solution", "report", "judgement", "digest"]
RewardKind = Literal["answer", "verdict", "outcome", "function"]
VerdictReader = Literal["correctness", "yes_no"]
Strategy = Literal["random", "balanced", "adaptive", "custom"]
When = Literal["any", "rejected", "accepted"]
MessageRole = Literal["system", "user", "assistant"]
Trigger = Literal["output", "tool_call"]

VARIABLES = ("problem", "solution", "report", "bug_report", "purpose", "tool_output")
"""What a prompt may use: ``problem`` (its text), ``solution`` (the latest solution on the way here,
thinking stripped), ``report`` (the latest report on the way here, thinking stripped) and ``bug_report``
(that report before its final verdict section); a tool's distiller also ``purpose`` (what the call
said it is for) and ``tool_output`` (the tool's raw output)."""

TOOL_VARIABLES = ("purpose", "tool_output")
"""The variables only a role that is some tool's distiller may declare."""

SHIPPED = Path(__file__).with_name("graphs")
"""The shipped graphs: one folder each, named as ``agents.graph`` names them."""


class GraphError(ValueError):
    """A graph file that cannot be run; ``field`` is the dotted path of the offending entry."""

    def __init__(self, message: str, field: str, source: str | Path = "") -> None:
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: {message}")
        self.field = field
        self.source = str(source)


@dataclass(frozen=True)
class Template:
    """One chat message of a role's prompt: who says it and the template text (from ``source``)."""

    role: MessageRole
    text: str
    source: str

    def fields(self) -> list[str]:
        """The ``{name}`` fields of the text; raises on anything but a plain name."""
        names = []
        try:
            parsed = list(string.Formatter().parse(self.text))
        except ValueError as err:
            raise ValueError(f"{self.source}: {err} (write literal braces as {{{{ and }}}})") from None
        for _, name, spec, conversion in parsed:
            if name is None:
                continue
            if not name.isidentifier() or spec or conversion:
                raise ValueError(
                    f"{self.source}: field {{{name}{'!' + conversion if conversion else ''}"
                    f"{':' + spec if spec else ''}}} is not a plain variable name"
                )
            names.append(name)
        return names

    def render(self, variables: Mapping[str, str]) -> str:
        out = []
        for literal, name, _, _ in string.Formatter().parse(self.text):
            out.append(literal)
            if name is not None:
                out.append(variables[name])
        return "".join(out)


@dataclass(frozen=True)
class ToolSpec:
    """A role's tool (``roles.<role>.tool``): which tool it may call, which role distils the output,
    and how many calls one response may make.

    Semantics the scheduler and the inference loop implement (the role's step *serves* its calls):

    1. The role writes a segment (generation until its end-of-turn token). If the segment finished
       by itself (not cut by the token budget), ``tools.parse_call`` finds a call in the segment's
       text (only the text written since the last observation), and fewer than ``max_calls`` calls
       were served in this response, the call is served; otherwise the response is complete.
    2. Serving: ``output = tools.run_tool(call, allowed=[name])`` (local, never raises); the
       ``distiller`` role is prompted with ``purpose=call.purpose``, ``tool_output=output`` (and
       ``problem``), sampled once with the distiller's policy, and its visible text
       (``strip_thinking``; empty when it was cut inside its thinking) is the digest.
    3. ``tools.observation(digest)`` is tokenised and appended to the response right after the
       segment's end-of-turn token (which stays in the response and is trained: the model learns to
       stop after a call); the role continues from prompt + response so far (a segment rollout) with
       the response's token budget less the tokens it already holds (none left: the response is
       cut, finish reason ``length``). Observation tokens have loss_mask 0 (and no log-probs to
       score); the role's own segments, end-of-turn tokens included, have loss_mask 1.
    4. The response's text (for its reward, for later prompts' ``solution``, for the loop's answer) is
       its segments and observations in order, end-of-turn tokens left out. Its reward is its role's
       reward on that text (``answer``: the last ``\\boxed{}``). Each distiller sample is a sample
       of the distiller role whose reward is that reward (``outcome``: the reward of the response it
       served); its gradient covers its own tokens only. Advantages of the distiller samples are
       normalised among the distiller samples served to one group (one problem); a group whose
       responses made no call gives none.
    """

    name: str
    distiller: str
    max_calls: int = 1


REWARD_TIMEOUT_S = 10.0
"""How long a reward function may take on one output by default (``timeout_s``): its process is killed
and replaced after that, and the output scores 0 (reason ``timeout``)."""
MAX_REWARD_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class RewardFunction:
    """A role rewarded by a function of the user's (``reward: {function: ...}`` in the graph file, or
    ``algorithm.reward_functions``): where it is and how long it may take. Only the name travels (to
    the reward workers, which import it in processes of their own); the function is never pickled, nor
    saved in or read from a checkpoint."""

    target: str
    """``package.module:name``, or the absolute path of a ``.py`` file then ``:name``."""
    timeout_s: float = REWARD_TIMEOUT_S
    source: str = ""
    """Where it was declared (the graph file's ``roles.<name>.reward`` or the config field), for
    messages."""


@dataclass(frozen=True)
class RoleSpec:
    """One agent: what it writes, how it is read and rewarded, and its prompt in each prompt set."""

    name: str
    output: OutputKind
    reward: RewardKind
    verdict: VerdictReader | None
    variables: tuple[str, ...]
    prompts: Mapping[str, tuple[Template, ...]]
    """Prompt set name -> the messages, in order; an empty template file drops its message."""
    tool: ToolSpec | None = None
    """The tool this role may call while it writes (None: no tool)."""
    function: RewardFunction | None = None
    """``reward: function``: the user's function that scores this role's outputs."""

    @property
    def decides(self) -> bool:
        """Whether a pass/fail verdict is read from this role's output."""
        return self.verdict is not None

    def messages(self, prompt_set: str, variables: Mapping[str, str]) -> list[dict[str, str]]:
        """The role's chat for ``prompt_set``, rendered with ``variables`` (only the declared ones)."""
        return [{"role": t.role, "content": t.render(variables)} for t in self.prompts[prompt_set] if t.text]


@dataclass(frozen=True)
class PositionSpec:
    """A step of the training trajectory: which role writes it, from which earlier position's outputs
    (``input``), which of them qualify (``when``) and how many are picked and how."""

    name: str
    role: str
    input: str | None = None
    when: When = "any"
    inputs: int | Literal["all"] | None = None
    """Outputs of ``input`` it takes; ``all``: every one that qualifies; None: ``agents.inputs_per_agent``."""
    strategy: Strategy | None = None
    """None: ``agents.strategy``."""
    prefer: Literal["positive", "negative"] = "negative"
    """``adaptive``: the inputs picked first (reward > 0 or reward 0); the rest only fill up."""
    positive_share: float = 0.5
    """``custom``: the share of the picks taken from reward-positive inputs."""
    trigger: Trigger = "output"
    """``output``: a group of samples per selected output of ``input`` (the chain above).
    ``tool_call``: one sample per tool call that ``input``'s role makes, written by that role's tool
    distiller while ``input``'s step runs (see :class:`ToolSpec`); such a position selects nothing
    (no ``when``/``inputs``/``strategy``/``prefer``/``positive_share``) and feeds no position."""


@dataclass(frozen=True)
class LoopStepSpec:
    """A step of the inference loop: the role that speaks and where the loop goes after it (``next``,
    or ``on_pass``/``on_fail`` after a role that decides). A step of a role that reads no verdict and
    has no ``next`` ends the loop: the latest solution is the answer (a loop may be that single step).
    A step whose role has a tool serves the role's tool calls within the step (:class:`ToolSpec`);
    distillers are no steps."""

    name: str
    role: str
    next: str | None = None
    on_pass: str | None = None
    on_fail: str | None = None


@dataclass(frozen=True)
class LoopSpec:
    """The inference loop: the first step, the steps, and the stop and accept rules (each ``evaluation``
    setting of the same name, when set, overrides the graph's)."""

    start: str
    steps: Mapping[str, LoopStepSpec]
    accept_after: int
    give_up_after: int
    max_iterations: int
    start_retries: int = 3


SHARED = "shared"
"""The one policy's name when every role shares a model (``algorithm.policies=shared``, MarsRL's)."""


@dataclass(frozen=True)
class AgentGraph:
    """A whole agent system. Build with :func:`~mars_megatron.agents.graph_file.load_graph`, which
    validates it (:mod:`mars_megatron.agents.graph_check`)."""

    name: str
    roles: Mapping[str, RoleSpec]
    """In declaration order: metrics and per-role policies follow it."""
    positions: tuple[PositionSpec, ...]
    loop: LoopSpec
    policies: Mapping[str, tuple[str, ...]]
    """Policy name -> the roles it serves (``algorithm.policies=graph``)."""
    prompt_sets: tuple[str, ...]
    """The first is the default of ``agents.prompts``."""
    balance: tuple[str, ...] = ()
    """Roles whose sample counts an update balances (MARS): each after the first keeps at most as many
    samples as the first has (:func:`~mars_megatron.algorithm.advantages.balance_roles`)."""
    source: str = ""
    """The graph file it was read from (errors name it)."""

    # --------------------------------------------------------------------------------------- views
    def role_of(self, position: str) -> RoleSpec:
        return self.roles[self.position(position).role]

    def position(self, name: str) -> PositionSpec:
        for p in self.positions:
            if p.name == name:
                return p
        raise KeyError(f"graph {self.name!r} has no position {name!r}")

    def trajectory(self, max_steps: int | None) -> tuple[PositionSpec, ...]:
        """The positions of a trajectory cut to ``agents.max_steps`` (None: all of them)."""
        return self.positions if max_steps is None else self.positions[:max_steps]

    def next_positions(self, position: str, max_steps: int | None) -> list[PositionSpec]:
        """The positions fed by ``position``'s outputs within the cut trajectory (not those spawned
        by its tool calls: :meth:`tool_positions`)."""
        return [p for p in self.trajectory(max_steps) if p.input == position and p.trigger == "output"]

    def tool_positions(self, position: str, max_steps: int | None) -> list[PositionSpec]:
        """The positions spawned per tool call of ``position`` within the cut trajectory: their samples
        are the distiller's digests (a cut that keeps ``position`` keeps them: graph_check)."""
        return [p for p in self.trajectory(max_steps) if p.input == position and p.trigger == "tool_call"]

    def distiller_roles(self) -> set[str]:
        """The roles that distil some role's tool output."""
        return {r.tool.distiller for r in self.roles.values() if r.tool is not None}

    @property
    def start_role(self) -> str:
        return self.loop.steps[self.loop.start].role

    def policy_names(self, mode: str) -> list[str]:
        """``algorithm.policies``: ``shared`` (one model), ``per_role`` or ``graph`` (its grouping)."""
        if mode == SHARED:
            return [SHARED]
        if mode == "per_role":
            return list(self.roles)
        return list(self.policies)

    def policy_of(self, role: str, names: Sequence[str]) -> str:
        """The policy serving ``role`` among ``names`` (from :meth:`policy_names`)."""
        if list(names) == [SHARED]:
            return SHARED
        if role in names and role not in self.policies:
            return role
        for policy, roles in self.policies.items():
            if role in roles and policy in names:
                return policy
        return role


# ------------------------------------------------------------------------------------------- the config
def prompt_set_of(graph: AgentGraph, prompts: str | None) -> str:
    """``agents.prompts`` resolved: the graph's first prompt set when null."""
    if prompts is None:
        return graph.prompt_sets[0]
    if prompts not in graph.prompt_sets:
        raise GraphError(
            f"graph {graph.name!r} has no prompt set {prompts!r}; it has {', '.join(graph.prompt_sets)}",
            "agents.prompts",
        )
    return prompts


@dataclass(frozen=True)
class LoopBudgets:
    """The inference loop's stop and accept rules: the graph's, each overridden by the ``evaluation``
    setting of the same name where that is set."""

    start_retries: int
    max_iterations: int
    accept_after: int
    give_up_after: int

    @classmethod
    def of(cls, graph: AgentGraph, evaluation: EvalConfig | None = None) -> LoopBudgets:
        loop = graph.loop

        def pick(value: int | None, default: int) -> int:
            return default if value is None else value

        e = evaluation
        return cls(
            start_retries=pick(e.start_retries if e else None, loop.start_retries),
            max_iterations=pick(e.max_iterations if e else None, loop.max_iterations),
            accept_after=pick(e.accept_after if e else None, loop.accept_after),
            give_up_after=pick(e.give_up_after if e else None, loop.give_up_after),
        )
