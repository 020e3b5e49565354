"""Reading an agent graph: where a graph file is (a shipped name or a path), parsing it (every key
checked, each error naming the file and the field), validating it (:mod:`.graph_check`) and checking
it against a run's config (:func:`graph_for`, the one check every command runs before anything
starts). ``yaml.safe_load`` only, and prompt files only from the folders beside the graph file."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from mars_megatron.agents.graph import (
    MAX_REWARD_TIMEOUT_S,
    REWARD_TIMEOUT_S,
    SHIPPED,
    VARIABLES,
    AgentGraph,
    GraphError,
    LoopBudgets,
    LoopSpec,
    LoopStepSpec,
    MessageRole,
    OutputKind,
    PositionSpec,
    RewardFunction,
    RewardKind,
    RoleSpec,
    Strategy,
    Template,
    ToolSpec,
    Trigger,
    VerdictReader,
    When,
)
from mars_megatron.agents.graph_check import validate
from mars_megatron.agents.graph_size import (
    MAX_POSITIONS,
    check_loop_calls,
    check_run_size,
    loop_calls_per_problem,
    run_size,
)
from mars_megatron.yaml_file import decode_text, read_yaml

if TYPE_CHECKING:
    from mars_megatron.config import MarsConfig


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
    path = graph_path(name_or_path)
    try:  # at most MAX_GRAPH_BYTES (YAML reads ~4 s per MB here); UTF-8; no duplicate keys or alias bombs
        data = read_yaml(path, MAX_GRAPH_BYTES)
    except ValueError as err:
        raise GraphError(str(err), "graph", path) from None
    except OSError as err:
        raise GraphError(f"cannot read it: {err.strerror or err}", "graph", path) from None
    graph = parse_graph(data, path)
    validate(graph, max_steps=max_steps)
    # the graph's own loop (mars eval runs it without a run config; graph_for checks evaluation.* too)
    calls = loop_calls_per_problem(graph, LoopBudgets.of(graph))
    check_loop_calls(calls, graph.name, "loop.max_iterations", str(path))
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


MAX_PROMPT_BYTES = 2**20
"""Largest prompt file read (1 MiB): a template is a few hundred words, and a prompt reaches every
request, log line and checkpoint of a run."""
MAX_GRAPH_BYTES = 256 * 2**10
"""Largest graph file read: a graph at the position cap (256) of 100-byte positions is 25 KB; a
20,000-position chain (1 MB) took 5 s of YAML parsing before its refusal."""
MAX_INPUTS = 65_536
"""Most inputs a position may take (``inputs``): above any group a run can hold (the fan-out is checked
as a whole by :func:`~mars_megatron.agents.graph_size.check_run_size`)."""
MAX_TOOL_CALLS = 256
"""Most tool calls one response may make (``tool.max_calls``; the shipped tool_pair: 1)."""
MAX_LOOP_COUNT = 10_000
"""Most of any loop count (``max_iterations``, ``accept_after``, ``give_up_after``, ``start_retries``;
the shipped loops: at most 30): 10,000 verdicts per problem already take days."""


def _int(value: Any, where: str, path: Path, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GraphError(f"expected an integer >= {minimum}, got {value!r}", where, path)
    if maximum is not None and value > maximum:
        raise GraphError(f"is {value}; the most it may be is {maximum:,}", where, path)
    return value


def _inputs(value: Any, where: str, path: Path) -> int | Literal["all"] | None:
    if value is None or value == "all":
        return value
    return _int(value, where, path, maximum=MAX_INPUTS)


def _read_template(folder: Path, name: Any, where: str, path: Path) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise GraphError(f"expected a file name in the prompt folder, got {name!r}", where, path)
    file = folder / name
    if not file.is_file():
        raise GraphError(f"prompt file {str(file)!r} not found", where, path)
    resolved = file.resolve()
    if not resolved.is_relative_to(folder.resolve()):  # a symlink to /etc/passwd, /proc/self/environ...
        raise GraphError(
            f"prompt file {str(file)!r} resolves to {str(resolved)!r}, outside its prompt folder", where, path
        )
    with resolved.open("rb") as f:
        data = f.read(MAX_PROMPT_BYTES + 1)
    if len(data) > MAX_PROMPT_BYTES:
        raise GraphError(
            f"prompt file {str(file)!r} is over {MAX_PROMPT_BYTES // 1024} KiB (prompts are templates of a "
            "few hundred words; the shipped ones are under 4 KB)",
            where,
            path,
        )
    try:
        text = decode_text(data)
    except ValueError as err:
        raise GraphError(f"prompt file {str(file)!r}: {err}", where, path) from None
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
        spec["name"],
        spec["distiller"],
        _int(spec.get("max_calls", 1), f"{where}.max_calls", path, maximum=MAX_TOOL_CALLS),
    )


def parse_graph(data: Any, path: Path) -> AgentGraph:
    """The graph of a parsed ``graph.yaml``: structure errors here, cross-checks in
    :func:`~mars_megatron.agents.graph_check.validate`."""
    top = _mapping(data, "graph", path)
    _unknown(top, _TOP_KEYS, "", path)
    folders = _parse_prompt_sets(top.get("prompts"), path)
    for name in folders:
        path_name(name, f"prompts.{name}", path)
    roles = {
        path_name(name, f"roles.{name}", path): _parse_role(str(name), spec, folders, path)
        for name, spec in _mapping(top.get("roles"), "roles", path).items()
    }
    trajectory = top.get("trajectory")
    if not isinstance(trajectory, list) or not trajectory:
        raise GraphError("expected a list of positions", "trajectory", path)
    if len(trajectory) > MAX_POSITIONS:  # before parsing: checks of a position look at the others
        raise GraphError(
            f"{len(trajectory):,} positions; the most a trajectory may have is {MAX_POSITIONS}",
            "trajectory",
            path,
        )
    policies = top.get("policies") or {"shared": list(roles)}
    policies = {
        path_name(k, f"policies.{k}", path): tuple(v) if isinstance(v, list) else v
        for k, v in _mapping(policies, "policies", path).items()
    }
    balance = top.get("balance") or []
    if not isinstance(balance, list):
        raise GraphError(f"expected a list of roles, got {balance!r}", "balance", path)
    return AgentGraph(
        name=path_name(top.get("name") or path.parent.name, "name", path),
        roles=roles,
        positions=tuple(_parse_position(spec, f"trajectory[{i}]", path) for i, spec in enumerate(trajectory)),
        loop=_parse_loop(top.get("loop"), path),
        policies=policies,
        prompt_sets=tuple(folders),
        balance=tuple(balance),
        source=str(path),
    )


_PATH_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def path_name(value: Any, where: str, source: str | Path) -> str:
    """A name that becomes part of a path or a metric key (a role, a policy: checkpoint folders are named
    after them; a prompt set; the graph): letters, digits, '_', '.', '-', starting with a letter or digit,
    at most 64. So ``../../x``, an absolute path, an empty name or one with a newline never reach a path."""
    if not isinstance(value, str) or not _PATH_NAME.fullmatch(value) or value in (".", ".."):
        raise GraphError(
            f"{str(value)[:80]!r} is not a name: letters, digits, '_', '.' and '-', starting with a letter "
            "or digit, at most 64 (it names folders and metrics)",
            where,
            source,
        )
    return value


def _parse_prompt_sets(value: Any, path: Path) -> dict[str, Path]:
    """Prompt set name -> its folder, which must lie beside the graph file."""
    prompt_dirs = _mapping(value, "prompts", path)
    if not prompt_dirs:
        raise GraphError("declare at least one prompt set (name: folder)", "prompts", path)
    folders = {}
    for set_name, folder in prompt_dirs.items():
        where = f"prompts.{set_name}"
        if not isinstance(folder, str) or folder.startswith("/") or ".." in Path(folder).parts:
            raise GraphError(f"expected a folder beside the graph file, got {folder!r}", where, path)
        if not (path.parent / folder).is_dir():
            raise GraphError(f"folder {str(path.parent / folder)!r} not found", where, path)
        resolved = (path.parent / folder).resolve()
        if not resolved.is_relative_to(path.parent.resolve()):  # a symlink out of the graph's folder
            raise GraphError(
                f"folder {str(path.parent / folder)!r} resolves to {str(resolved)!r}, outside the graph "
                "file's folder",
                where,
                path,
            )
        folders[str(set_name)] = path.parent / folder
    return folders


def _parse_role(name: str, spec: Any, folders: Mapping[str, Path], path: Path) -> RoleSpec:
    where = f"roles.{name}"
    spec = _mapping(spec, where, path)
    _unknown(spec, _ROLE_KEYS, where, path)
    output = _choice(spec.get("output"), get_args(OutputKind), f"{where}.output", path)
    if "reward" not in spec:
        raise GraphError(
            "every role needs a reward (answer, verdict, outcome or {function: ...})", f"{where}.reward", path
        )
    function = None
    if isinstance(spec["reward"], dict):
        function = reward_function(spec["reward"], f"{where}.reward", path, path.parent)
        reward = "function"
    else:
        kinds = tuple(k for k in get_args(RewardKind) if k != "function")
        reward = _choice(spec["reward"], kinds, f"{where}.reward", path)
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
    prompts = {
        set_name: _parse_messages(messages, folder, where, path) for set_name, folder in folders.items()
    }
    tool = _parse_tool(spec.get("tool"), f"{where}.tool", path)
    return RoleSpec(name, output, reward, verdict, tuple(variables), prompts, tool, function)


_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def reward_target(text: Any, where: str, source: str | Path, base: Path) -> str:
    """A reward function's ``package.module:name`` as written, or ``path/to/file.py:name`` with the file
    made absolute (relative to ``base``: the graph file's folder, or the working directory for the config)
    and checked to exist: the reward workers may run elsewhere, with another working directory."""
    if not isinstance(text, str) or text.count(":") != 1:
        raise GraphError(
            f"expected 'package.module:function' or 'path/to/file.py:function', got {str(text)[:200]!r}",
            where,
            source,
        )
    module, name = text.split(":")
    if not _NAME.match(name):
        raise GraphError(
            f"{name[:100]!r} is not a Python name (after the ':' of {text[:200]!r})", where, source
        )
    if module.endswith(".py"):
        file = (base / module).resolve()
        if not file.is_file():
            raise GraphError(f"reward function file {str(file)!r} not found", where, source)
        return f"{file}:{name}"
    if not _MODULE.match(module):
        raise GraphError(
            f"{module[:200]!r} is neither a module path (package.module) nor a .py file", where, source
        )
    return text


def reward_function(spec: Mapping[str, Any], where: str, source: str | Path, base: Path) -> RewardFunction:
    """``{function: TARGET, timeout_s: SECONDS}`` of a role's reward."""
    _unknown(spec, {"function", "timeout_s"}, where, Path(source))
    if "function" not in spec:
        raise GraphError("a reward mapping needs function: package.module:name", where, source)
    timeout = spec.get("timeout_s", REWARD_TIMEOUT_S)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= MAX_REWARD_TIMEOUT_S
    ):
        raise GraphError(
            f"timeout_s must be a number of seconds in (0, {MAX_REWARD_TIMEOUT_S:g}], got {timeout!r}",
            f"{where}.timeout_s",
            source,
        )
    target = reward_target(spec["function"], f"{where}.function", source, base)
    return RewardFunction(target, float(timeout), f"{source}: {where}" if source else where)


def _parse_messages(messages: list[Any], folder: Path, where: str, path: Path) -> tuple[Template, ...]:
    templates = []
    for i, message in enumerate(messages):
        mwhere = f"{where}.messages[{i}]"
        if not isinstance(message, dict) or len(message) != 1:
            raise GraphError("expected one {system|user|assistant: file}", mwhere, path)
        ((speaker, file_name),) = message.items()
        _choice(speaker, get_args(MessageRole), mwhere, path)
        text = _read_template(folder, file_name, mwhere, path)
        templates.append(Template(speaker, text, f"{folder.name}/{file_name}"))
    return tuple(templates)


def _parse_position(spec: Any, where: str, path: Path) -> PositionSpec:
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
    return PositionSpec(
        name=spec["name"],
        role=spec["role"],
        input=spec.get("input"),
        when=_choice(spec.get("when", "any"), get_args(When), f"{where}.when", path),
        inputs=_inputs(spec.get("inputs"), f"{where}.inputs", path),
        strategy=strategy,
        prefer=_choice(spec.get("prefer", "negative"), ("positive", "negative"), f"{where}.prefer", path),
        positive_share=float(share),
        trigger=trigger,
    )


def _parse_loop(value: Any, path: Path) -> LoopSpec:
    loop = _mapping(value, "loop", path)
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
    return LoopSpec(
        start=loop["start"],
        steps=steps,
        accept_after=_int(loop.get("accept_after", 4), "loop.accept_after", path, maximum=MAX_LOOP_COUNT),
        give_up_after=_int(loop.get("give_up_after", 10), "loop.give_up_after", path, maximum=MAX_LOOP_COUNT),
        max_iterations=_int(
            loop.get("max_iterations", 10), "loop.max_iterations", path, maximum=MAX_LOOP_COUNT
        ),
        start_retries=_int(
            loop.get("start_retries", 3), "loop.start_retries", path, minimum=0, maximum=MAX_LOOP_COUNT
        ),
    )


# ------------------------------------------------------------------------------------------- the config
def graph_for(cfg: MarsConfig) -> AgentGraph:
    """The run's graph, loaded, validated and checked against the config's role-keyed settings
    (``agents.prompts``, ``agents.max_steps``, ``pipeline.staleness_per_role``,
    ``algorithm.role_weights``) and against the size caps of what the two ask for together (samples per
    problem and step, the loop's calls: :mod:`.graph_size`): the one check every command runs before
    anything starts."""
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
        ("algorithm.reward_functions", cfg.algorithm.reward_functions),
    ):
        for role in keyed:
            if role not in graph.roles:
                raise GraphError(
                    f"graph {graph.name!r} has no role {role!r}; its roles: {', '.join(graph.roles)}",
                    f"{where}.{role}",
                )
    a = cfg.agents
    size = run_size(
        graph,
        group_size=a.group_size,
        inputs_per_agent=a.inputs_per_agent,
        max_steps=a.max_steps,
        problems_per_step=cfg.data.problems_per_step,
        budgets=LoopBudgets.of(graph, cfg.evaluation),
    )
    check_run_size(
        size,
        group_size=a.group_size,
        problems_per_step=cfg.data.problems_per_step,
        graph_name=graph.name,
        # load_graph checked the graph's own loop: only an evaluation.* override can pass the cap here
        loop_field="evaluation.max_iterations"
        if cfg.evaluation.max_iterations is not None
        else "evaluation.start_retries",
    )
    return with_reward_functions(graph, cfg.algorithm.reward_functions, cfg.algorithm.reward_timeout_s)


def with_reward_functions(graph: AgentGraph, functions: Mapping[str, str], timeout_s: float) -> AgentGraph:
    """``graph`` with the roles named in ``algorithm.reward_functions`` rewarded by those functions (a
    relative file path is taken from the working directory), checked again as a whole."""
    if not functions:
        return graph
    roles = dict(graph.roles)
    for role, text in functions.items():
        where = f"algorithm.reward_functions.{role}"
        target = reward_target(text, where, "", Path.cwd())
        roles[role] = dataclasses.replace(
            roles[role], reward="function", function=RewardFunction(target, timeout_s, where)
        )
    changed = dataclasses.replace(graph, roles=roles)
    validate(changed)
    return changed


def policy_names(cfg: MarsConfig, graph: AgentGraph | None = None) -> list[str]:
    """The run's policies (models), by ``algorithm.policies``: ``["shared"]``, one per role, or the graph's
    grouping (``graph``: the run's, when already loaded). Free of torch, like this module: the launcher
    counts rollout engines with it in its own environment."""
    return (graph or graph_for(cfg)).policy_names(cfg.algorithm.policies)
