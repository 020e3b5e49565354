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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from mars_megatron.config import EvalConfig, MarsConfig

OutputKind = Literal["solution", "report", "judgement", "digest"]
RewardKind = Literal["answer", "verdict", "outcome"]
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


@dataclass(frozen=True)
class AgentGraph:
    """A whole agent system. Build with :func:`load_graph`, which validates it."""

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
    """Roles whose sample counts an update balances (MARS): each keeps as many as the rarest has."""
    source: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

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
        (the distiller's digests) are trained; calls are served whether or not one is in the cut."""
        return [p for p in self.trajectory(max_steps) if p.input == position and p.trigger == "tool_call"]

    def distiller_roles(self) -> set[str]:
        """The roles that distil some role's tool output."""
        return {r.tool.distiller for r in self.roles.values() if r.tool is not None}

    @property
    def start_role(self) -> str:
        return self.loop.steps[self.loop.start].role

    def policy_names(self, mode: str) -> list[str]:
        """``algorithm.policies``: ``shared`` (one model), ``per_role`` or ``graph`` (its grouping)."""
        if mode == "shared":
            return ["shared"]
        if mode == "per_role":
            return list(self.roles)
        return list(self.policies)

    def policy_of(self, role: str, names: Sequence[str]) -> str:
        """The policy serving ``role`` among ``names`` (from :meth:`policy_names`)."""
        if list(names) == ["shared"]:
            return "shared"
        if role in names and role not in self.policies:
            return role
        for policy, roles in self.policies.items():
            if role in roles and policy in names:
                return policy
        return role


# ------------------------------------------------------------------------------------------- loading
def graph_path(name_or_path: str) -> Path:
    """The ``graph.yaml`` of a shipped graph name, or the file ``name_or_path`` points to."""
    shipped = SHIPPED / name_or_path / "graph.yaml"
    if "/" not in name_or_path and not name_or_path.endswith((".yaml", ".yml")):
        if not shipped.is_file():
            names = ", ".join(shipped_graphs())
            raise GraphError(f"no shipped graph {name_or_path!r}; shipped: {names}", "agents.graph")
        return shipped
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "graph.yaml"
    if not path.is_file():
        raise GraphError(f"file {str(path)!r} not found", "agents.graph")
    return path


def shipped_graphs() -> list[str]:
    return sorted(p.parent.name for p in SHIPPED.glob("*/graph.yaml"))


def load_graph(name_or_path: str, *, max_steps: int | None = None) -> AgentGraph:
    """Read and validate a graph (:func:`validate`); ``max_steps`` (``agents.max_steps``) is checked
    against its trajectory. Every error names the file and the field."""
    import yaml

    path = graph_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise GraphError(f"not valid YAML: {err}", "graph", path) from None
    graph = parse_graph(data, path)
    validate(graph, max_steps=max_steps)
    return graph


def _mapping(value: Any, where: str, path: Path) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise GraphError(f"expected a mapping, got {type(value).__name__}", where, path)
    return value


def _choice(value: Any, options: tuple[str, ...], where: str, path: Path) -> Any:
    if value not in options:
        raise GraphError(f"{value!r} is not one of {', '.join(map(str, options))}", where, path)
    return value


_ROLE_KEYS = {"output", "reward", "verdict", "variables", "messages", "tool"}
_SELECTION_KEYS = ("when", "inputs", "strategy", "prefer", "positive_share")
_POSITION_KEYS = {"name", "role", "input", "trigger", *_SELECTION_KEYS}
_TOOL_KEYS = {"name", "distiller", "max_calls"}
_LOOP_KEYS = {"start", "steps", "accept_after", "give_up_after", "max_iterations", "start_retries"}
_TOP_KEYS = {"name", "description", "prompts", "roles", "trajectory", "loop", "policies", "balance"}


def _unknown(data: Mapping[str, Any], allowed: set[str], where: str, path: Path) -> None:
    extra = sorted(str(k) for k in set(data) - allowed)
    if extra:
        prefix = f"{where}." if where else ""
        # YAML reads a bare on/off/yes/no key as a boolean
        hint = " (a bare on/off/yes/no key is read as a boolean)" if extra[0] in ("True", "False") else ""
        raise GraphError(
            f"unknown key{hint} (allowed: {', '.join(sorted(allowed))})", prefix + extra[0], path
        )


def _int(value: Any, where: str, path: Path, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GraphError(f"expected an integer >= {minimum}, got {value!r}", where, path)
    return value


def _inputs(value: Any, where: str, path: Path) -> int | Literal["all"] | None:
    if value is None or value == "all":
        return value
    return _int(value, where, path)


def _read_template(folder: Path, name: Any, where: str, path: Path) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise GraphError(f"expected a file name in the prompt folder, got {name!r}", where, path)
    file = folder / name
    if not file.is_file():
        raise GraphError(f"prompt file {str(file)!r} not found", where, path)
    text = file.read_text(encoding="utf-8")
    # A text file's last line ends with a newline that is not part of the template.
    return text[:-1] if text.endswith("\n") else text


def _parse_tool(spec: Any, where: str, path: Path) -> ToolSpec | None:
    if spec is None:
        return None
    spec = _mapping(spec, where, path)
    _unknown(spec, _TOOL_KEYS, where, path)
    for key in ("name", "distiller"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise GraphError(f"expected a name, got {spec.get(key)!r}", f"{where}.{key}", path)
    return ToolSpec(
        spec["name"], spec["distiller"], _int(spec.get("max_calls", 1), f"{where}.max_calls", path)
    )


def parse_graph(data: Any, path: Path) -> AgentGraph:
    """The graph of a parsed ``graph.yaml``: structure errors here, cross-checks in :func:`validate`."""
    top = _mapping(data, "graph", path)
    _unknown(top, _TOP_KEYS, "", path)
    name = top.get("name") or path.parent.name
    prompt_dirs = _mapping(top.get("prompts"), "prompts", path)
    if not prompt_dirs:
        raise GraphError("declare at least one prompt set (name: folder)", "prompts", path)
    folders = {}
    for set_name, folder in prompt_dirs.items():
        where = f"prompts.{set_name}"
        if not isinstance(folder, str) or folder.startswith("/") or ".." in Path(folder).parts:
            raise GraphError(f"expected a folder beside the graph file, got {folder!r}", where, path)
        if not (path.parent / folder).is_dir():
            raise GraphError(f"folder {str(path.parent / folder)!r} not found", where, path)
        folders[str(set_name)] = path.parent / folder
    roles: dict[str, RoleSpec] = {}
    for role_name, spec in _mapping(top.get("roles"), "roles", path).items():
        where = f"roles.{role_name}"
        spec = _mapping(spec, where, path)
        _unknown(spec, _ROLE_KEYS, where, path)
        output = _choice(spec.get("output"), get_args(OutputKind), f"{where}.output", path)
        if "reward" not in spec:
            raise GraphError(
                "every role needs a reward (answer, verdict or outcome)", f"{where}.reward", path
            )
        reward = _choice(spec["reward"], get_args(RewardKind), f"{where}.reward", path)
        verdict = spec.get("verdict")
        if verdict is not None:
            verdict = _choice(verdict, get_args(VerdictReader), f"{where}.verdict", path)
        variables = spec.get("variables", ["problem"])
        if not isinstance(variables, list) or not all(isinstance(v, str) for v in variables):
            raise GraphError(f"expected a list of names, got {variables!r}", f"{where}.variables", path)
        for v in variables:
            _choice(v, VARIABLES, f"{where}.variables", path)
        messages = spec.get("messages")
        if not isinstance(messages, list) or not messages:
            raise GraphError("expected a list of {system|user|assistant: file}", f"{where}.messages", path)
        prompts: dict[str, tuple[Template, ...]] = {}
        for set_name, folder in folders.items():
            templates = []
            for i, message in enumerate(messages):
                mwhere = f"{where}.messages[{i}]"
                if not isinstance(message, dict) or len(message) != 1:
                    raise GraphError("expected one {system|user|assistant: file}", mwhere, path)
                ((speaker, file_name),) = message.items()
                _choice(speaker, get_args(MessageRole), mwhere, path)
                text = _read_template(folder, file_name, mwhere, path)
                templates.append(Template(speaker, text, f"{folder.name}/{file_name}"))
            prompts[set_name] = tuple(templates)
        tool = _parse_tool(spec.get("tool"), f"{where}.tool", path)
        roles[str(role_name)] = RoleSpec(
            str(role_name), output, reward, verdict, tuple(variables), prompts, tool
        )
    positions = []
    trajectory = top.get("trajectory")
    if not isinstance(trajectory, list) or not trajectory:
        raise GraphError("expected a list of positions", "trajectory", path)
    for i, spec in enumerate(trajectory):
        where = f"trajectory[{i}]"
        spec = _mapping(spec, where, path)
        _unknown(spec, _POSITION_KEYS, where, path)
        for key in ("name", "role"):
            if not isinstance(spec.get(key), str):
                raise GraphError(f"expected a name, got {spec.get(key)!r}", f"{where}.{key}", path)
        strategy = spec.get("strategy")
        if strategy is not None:
            _choice(strategy, get_args(Strategy), f"{where}.strategy", path)
        trigger = _choice(spec.get("trigger", "output"), get_args(Trigger), f"{where}.trigger", path)
        if trigger == "tool_call":
            for key in _SELECTION_KEYS:
                if key in spec:
                    raise GraphError(
                        "a position spawned per tool call serves every call; it selects nothing",
                        f"{where}.{key}",
                        path,
                    )
        share = spec.get("positive_share", 0.5)
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise GraphError(f"expected a number in [0, 1], got {share!r}", f"{where}.positive_share", path)
        positions.append(
            PositionSpec(
                name=spec["name"],
                role=spec["role"],
                input=spec.get("input"),
                when=_choice(spec.get("when", "any"), get_args(When), f"{where}.when", path),
                inputs=_inputs(spec.get("inputs"), f"{where}.inputs", path),
                strategy=strategy,
                prefer=_choice(
                    spec.get("prefer", "negative"), ("positive", "negative"), f"{where}.prefer", path
                ),
                positive_share=float(share),
                trigger=trigger,
            )
        )
    loop = _mapping(top.get("loop"), "loop", path)
    _unknown(loop, _LOOP_KEYS, "loop", path)
    steps = {}
    for step_name, spec in _mapping(loop.get("steps"), "loop.steps", path).items():
        where = f"loop.steps.{step_name}"
        spec = _mapping(spec, where, path)
        _unknown(spec, {"role", "next", "on_pass", "on_fail"}, where, path)
        steps[str(step_name)] = LoopStepSpec(
            str(step_name),
            spec.get("role", step_name),
            spec.get("next"),
            spec.get("on_pass"),
            spec.get("on_fail"),
        )
    if not isinstance(loop.get("start"), str):
        raise GraphError("expected the name of the first step", "loop.start", path)
    loop_spec = LoopSpec(
        start=loop["start"],
        steps=steps,
        accept_after=_int(loop.get("accept_after", 4), "loop.accept_after", path),
        give_up_after=_int(loop.get("give_up_after", 10), "loop.give_up_after", path),
        max_iterations=_int(loop.get("max_iterations", 10), "loop.max_iterations", path),
        start_retries=_int(loop.get("start_retries", 3), "loop.start_retries", path, minimum=0),
    )
    policies = top.get("policies") or {"shared": list(roles)}
    policies = {
        str(k): tuple(v) if isinstance(v, list) else v
        for k, v in _mapping(policies, "policies", path).items()
    }
    balance = top.get("balance") or []
    if not isinstance(balance, list):
        raise GraphError(f"expected a list of roles, got {balance!r}", "balance", path)
    return AgentGraph(
        name=str(name),
        roles=roles,
        positions=tuple(positions),
        loop=loop_spec,
        policies=policies,
        prompt_sets=tuple(folders),
        balance=tuple(balance),
        source=str(path),
    )


# ---------------------------------------------------------------------------------------- validation
def _available(chain_kinds: Sequence[str], *, served_call: bool = False) -> set[str]:
    """Variables a prompt can be given after outputs of ``chain_kinds`` (oldest first): the latest
    solution, and a report only if one judged that solution (came after it); a distiller serving a tool
    call (``served_call``) is given the call's purpose and the tool's output."""
    if served_call:
        return {"problem", *TOOL_VARIABLES}
    out, report = {"problem"}, False
    for kind in chain_kinds:
        if kind == "solution":
            out.add("solution")
            report = False
        elif kind == "report":
            report = True
    return out | {"report", "bug_report"} if report else out


def validate(graph: AgentGraph, *, max_steps: int | None = None) -> None:
    """Everything that would otherwise fail mid-run, each as a :class:`GraphError` naming the field:
    unknown roles and positions, a role without a reward or with a reward its output cannot earn,
    prompts that use variables the role did not declare or cannot be given, loop cycles that no
    verdict can stop, an outcome-rewarded role whose outputs are not all followed, and a trajectory cut
    (``agents.max_steps``) beyond the trajectory."""
    src = graph.source
    _validate_tools(graph, src)
    for role in graph.roles.values():
        where = f"roles.{role.name}"
        if role.reward == "answer" and role.output != "solution":
            raise GraphError("an answer reward needs output: solution", f"{where}.reward", src)
        if role.reward == "verdict" and role.verdict is None:
            raise GraphError("a verdict reward needs a verdict reader (verdict: ...)", f"{where}.reward", src)
        if role.output == "judgement" and role.verdict is None:
            raise GraphError("a judgement needs a verdict reader (verdict: ...)", f"{where}.verdict", src)
        if role.output in ("solution", "digest") and role.verdict is not None:
            raise GraphError(f"a {role.output} carries no verdict", f"{where}.verdict", src)
        for templates in role.prompts.values():
            for i, template in enumerate(templates):
                try:
                    used = template.fields()
                except ValueError as err:
                    raise GraphError(str(err), f"{where}.messages[{i}]", src) from None
                undeclared = sorted(set(used) - set(role.variables))
                if undeclared:
                    raise GraphError(
                        f"{template.source} uses {{{undeclared[0]}}}, which the role does not declare "
                        f"(variables: {', '.join(role.variables)})",
                        f"{where}.messages[{i}]",
                        src,
                    )
    _validate_trajectory(graph, src)
    _validate_loop(graph, src)
    for policy, roles in graph.policies.items():
        if not isinstance(roles, tuple) or not roles:
            raise GraphError("expected a list of roles", f"policies.{policy}", src)
        for r in roles:
            if r not in graph.roles:
                raise GraphError(f"unknown role {r!r}", f"policies.{policy}", src)
    served = [r for roles in graph.policies.values() for r in roles]
    for r in graph.roles:
        if served.count(r) != 1:
            raise GraphError(
                f"role {r!r} is served by {served.count(r)} policies, expected 1", "policies", src
            )
    for r in graph.balance:
        if r not in graph.roles:
            raise GraphError(f"unknown role {r!r}", "balance", src)
    if max_steps is not None and max_steps > len(graph.positions):
        raise GraphError(
            f"is {max_steps}, beyond the {len(graph.positions)} positions of graph {graph.name!r}",
            "agents.max_steps",
        )


def _validate_tools(graph: AgentGraph, src: str) -> None:
    """A tool must exist, be called by a role that writes solutions and be served by another role that
    writes digests (so a distiller calls no tool); only a distiller writes digests or may use
    ``purpose`` and ``tool_output``."""
    from mars_megatron.agents.tools import TOOLS

    distillers = graph.distiller_roles()
    for role in graph.roles.values():
        where = f"roles.{role.name}"
        if role.tool is not None:
            tool = role.tool
            if tool.name not in TOOLS:
                raise GraphError(
                    f"unknown tool {tool.name!r} (tools: {', '.join(sorted(TOOLS))})",
                    f"{where}.tool.name",
                    src,
                )
            if role.output != "solution":
                raise GraphError("only a role that writes solutions calls tools", f"{where}.tool", src)
            if tool.distiller not in graph.roles:
                raise GraphError(f"unknown role {tool.distiller!r}", f"{where}.tool.distiller", src)
            if tool.distiller == role.name:
                raise GraphError("a role cannot distil its own tool's output", f"{where}.tool.distiller", src)
            if graph.roles[tool.distiller].output != "digest":
                raise GraphError(
                    f"the distiller {tool.distiller!r} must have output: digest",
                    f"{where}.tool.distiller",
                    src,
                )
        if role.output == "digest" and role.name not in distillers:
            raise GraphError(
                "a digest is written only by a tool's distiller (roles.<role>.tool.distiller)",
                f"{where}.output",
                src,
            )
        used = sorted(set(role.variables) & set(TOOL_VARIABLES))
        if used and role.name not in distillers:
            raise GraphError(
                f"{{{used[0]}}} is given only to a tool's distiller, and {role.name!r} distils no tool",
                f"{where}.variables",
                src,
            )


def _validate_trajectory(graph: AgentGraph, src: str) -> None:
    seen: dict[str, PositionSpec] = {}
    kinds: dict[str, list[str]] = {}
    for i, p in enumerate(graph.positions):
        where = f"trajectory[{i}]"
        if p.name in seen:
            raise GraphError(f"position {p.name!r} is declared twice", f"{where}.name", src)
        if p.role not in graph.roles:
            raise GraphError(f"unknown role {p.role!r}", f"{where}.role", src)
        role = graph.roles[p.role]
        if i == 0 and p.input is not None:
            raise GraphError("the first position takes no input", f"{where}.input", src)
        if i > 0:
            if p.input is None:
                raise GraphError("every later position needs an input position", f"{where}.input", src)
            if p.input not in seen:
                later = p.input == p.name or any(q.name == p.input for q in graph.positions[i:])
                what = "a cycle: inputs must come from earlier positions" if later else "unknown position"
                raise GraphError(f"{what} ({p.input!r})", f"{where}.input", src)
            if seen[p.input].trigger == "tool_call":
                raise GraphError(
                    f"{p.input!r} is spawned per tool call and feeds no position", f"{where}.input", src
                )
            source = graph.roles[seen[p.input].role]
            if p.trigger == "tool_call" and (source.tool is None or source.tool.distiller != p.role):
                raise GraphError(
                    f"trigger: tool_call needs the distiller of {p.input!r}'s tool, not {p.role!r}",
                    f"{where}.role",
                    src,
                )
            if p.trigger == "output" and p.role in graph.distiller_roles():
                raise GraphError(
                    f"role {p.role!r} is a tool's distiller: its position takes trigger: tool_call",
                    f"{where}.trigger",
                    src,
                )
            if p.when != "any" and not source.decides:
                raise GraphError(
                    f"{p.input!r} reads no verdict, so 'when: {p.when}' never holds", f"{where}.when", src
                )
            if source.reward == "outcome" and (p.inputs != "all" or p.when != "any"):
                raise GraphError(
                    f"{p.input!r} is rewarded by the outcome of what follows it, so every one of its outputs "
                    "must be followed: take inputs: all (and when: any)",
                    f"{where}.inputs",
                    src,
                )
        chain = [*kinds.get(p.input, []), graph.roles[seen[p.input].role].output] if p.input else []
        missing = sorted(set(role.variables) - _available(chain, served_call=p.trigger == "tool_call"))
        if missing:
            raise GraphError(
                f"role {p.role!r} declares {{{missing[0]}}}, which nothing before this position provides",
                f"{where}.role",
                src,
            )
        kinds[p.name] = chain
        seen[p.name] = p
    distillers = graph.distiller_roles()
    for role in graph.roles.values():
        # a distiller's outcome is the reward of the response it served, not of a later position
        if (
            role.reward == "outcome"
            and role.name not in distillers
            and not any(
                q.input is not None and graph.position(q.input).role == role.name for q in graph.positions
            )
        ):
            raise GraphError(
                "an outcome reward needs a position that takes this role's outputs",
                f"roles.{role.name}.reward",
                src,
            )
    start = graph.loop.steps.get(graph.loop.start)
    if start is not None and graph.positions[0].role != start.role:
        raise GraphError(
            "the trajectory and the loop must start with the same role", "trajectory[0].role", src
        )


def _validate_loop(graph: AgentGraph, src: str) -> None:
    loop = graph.loop
    if loop.start not in loop.steps:
        raise GraphError(f"unknown step {loop.start!r}", "loop.start", src)
    for step in loop.steps.values():
        where = f"loop.steps.{step.name}"
        if step.role not in graph.roles:
            raise GraphError(f"unknown role {step.role!r}", f"{where}.role", src)
        decides = graph.roles[step.role].decides
        targets = {"next": step.next, "on_pass": step.on_pass, "on_fail": step.on_fail}
        if decides and (step.next is not None or step.on_pass is None or step.on_fail is None):
            raise GraphError("a role that decides goes on_pass and on_fail, not next", where, src)
        if not decides and (step.on_pass or step.on_fail):
            raise GraphError(
                "a role that reads no verdict goes to one next step (or none: the end)", where, src
            )
        for key, target in targets.items():
            if target is not None and target not in loop.steps:
                raise GraphError(f"unknown step {target!r}", f"{where}.{key}", src)
    # A step without ``next`` (and no verdict) ends the loop: its solution is the answer.
    if not any(graph.roles[s.role].decides or s.next is None for s in loop.steps.values()):
        raise GraphError(
            "no step reads a verdict or ends the loop (no next), so the loop can neither accept nor stop",
            "loop.steps",
            src,
        )
    # A cycle that passes no deciding step never meets a stop rule (they all count verdicts).
    plain = {s.name: s.next for s in loop.steps.values() if not graph.roles[s.role].decides}
    for first in plain:
        seen, step = [first], plain[first]
        while step in plain:
            if step in seen:
                cycle = " -> ".join([*seen[seen.index(step) :], step])
                raise GraphError(
                    f"the cycle {cycle} passes no step that reads a verdict, so nothing stops it",
                    f"loop.steps.{step}.next",
                    src,
                )
            seen.append(step)
            step = plain[step]
    if graph.roles[loop.steps[loop.start].role].output != "solution":
        raise GraphError("the first step must write a solution", "loop.start", src)
    writes_report = any(graph.roles[s.role].output == "report" for s in loop.steps.values())
    for step in loop.steps.values():
        given = {"problem"} if step.name == loop.start else {"problem", "solution"}
        if writes_report and step.name != loop.start:
            given |= {"report", "bug_report"}
        missing = sorted(set(graph.roles[step.role].variables) - given)
        if missing:
            raise GraphError(
                f"{{{missing[0]}}} is not available to step {step.name!r}", f"loop.steps.{step.name}", src
            )


# ------------------------------------------------------------------------------------------- the config
def graph_for(cfg: MarsConfig) -> AgentGraph:
    """The run's graph, loaded, validated and checked against the config's role-keyed settings
    (``agents.prompts``, ``agents.max_steps``, ``pipeline.staleness_per_role``,
    ``algorithm.role_weights``): the one check every command runs before anything starts."""
    graph = load_graph(cfg.agents.graph, max_steps=cfg.agents.max_steps)
    prompts = cfg.agents.prompts
    if prompts is not None and prompts not in graph.prompt_sets:
        raise GraphError(
            f"graph {graph.name!r} has no prompt set {prompts!r}; it has {', '.join(graph.prompt_sets)}",
            "agents.prompts",
        )
    for where, keyed in (
        ("pipeline.staleness_per_role", cfg.pipeline.staleness_per_role),
        ("algorithm.role_weights", cfg.algorithm.role_weights),
    ):
        for role in keyed:
            if role not in graph.roles:
                raise GraphError(
                    f"graph {graph.name!r} has no role {role!r}; its roles: {', '.join(graph.roles)}",
                    f"{where}.{role}",
                )
    return graph


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
