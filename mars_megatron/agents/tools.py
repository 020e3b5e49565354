"""Tools an agent may call while it reasons: the call protocol, the local tools, and the observation that
carries a tool's (distilled) output back into the caller's response.

The design follows the dual-system pair of MARS (arXiv 2510.04935): a deliberate *reasoner* decides when
it needs a tool and says why; the tool runs here, in this process, with no network and no access to
anything but its input; a fast *distiller* reads the tool's raw output together with the stated purpose
and writes a short digest; the digest, not the raw output, goes back into the reasoner's context, so a
long or noisy output does not crowd out the reasoning.

The protocol (one line of plain text, chosen so the tiny tokenizer keeps most of it as whole words:
``use``, `` for``, `` the``, `` sum`` are single tokens there)::

    use calc 37+45 for the sum
    ^^^ ^^^^ ^^^^^     ^^^^^^^
    |   tool input     purpose

A call is a line of the response's visible text (after any thinking) that starts with ``use``, then the
tool's name (lower-case letters, digits, ``_``), then the input, then `` for `` and the purpose. The input
ends at the *first* `` for ``: a purpose may say "for", an input may not. The reasoner ends its turn
right after the call; the caller appends :func:`observation` (``"\\nRESULT <digest>\\n"``) and lets the
reasoner go on from there.

Tools (:data:`TOOLS`): ``calc``, a sandboxed arithmetic evaluator, and ``lookup``, a word search over a
small shipped set of reference notes (``lookup_docs.json``); both local and read-only.

Everything here is pure or local and never raises on model text: a malformed call is ``None``, and a
failing tool (a division by zero, an unknown tool, an input that is too long) answers with a short
``error: ...`` text that the distiller reads like any other output.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from mars_megatron.agents.thinking import strip_thinking

CALL_WORD = "use"
"""The word a call line starts with."""
PURPOSE_WORD = "for"
"""The word between a call's input and its purpose."""
OBSERVATION_WORD = "RESULT"
"""The word an observation line starts with (text the caller inserts, never the model)."""

MAX_INPUT_CHARS = 1000
"""Longest input a call line may carry (each tool has its own, usually smaller, limit)."""
MAX_PURPOSE_CHARS = 200
MAX_OUTPUT_CHARS = 2000
"""A tool's output is cut here, so the distiller's prompt stays bounded whatever the tool returns."""
MAX_DIGEST_CHARS = 1000
"""A digest is cut here before it enters the reasoner's context."""

_CALL_LINE = re.compile(rf"^{CALL_WORD} ([a-z][a-z0-9_]*) (.+)$")


@dataclass(frozen=True)
class ToolCall:
    """One call: which tool, its input, and what the caller wants from the output (the distiller's
    brief)."""

    tool: str
    input: str
    purpose: str

    def text(self) -> str:
        """The call line that :func:`parse_call` reads back as this call."""
        return f"{CALL_WORD} {self.tool} {self.input} {PURPOSE_WORD} {self.purpose}"


def parse_call(text: str) -> ToolCall | None:
    """The last call in the visible part of ``text`` (after the last ``</think>``), or None.

    The last line that starts with ``use <tool> `` decides: if it has no `` for ``, an empty input or
    purpose, or fields over :data:`MAX_INPUT_CHARS` / :data:`MAX_PURPOSE_CHARS`, the text holds no
    call (None), even when an earlier line held a good one: what the model last asked for is what
    counts, and a garbled request is not served.
    """
    for line in reversed(strip_thinking(text).splitlines()):
        match = _CALL_LINE.match(line.strip())
        if match is None:
            continue
        tool, rest = match.groups()
        given, sep, purpose = rest.partition(f" {PURPOSE_WORD} ")
        given, purpose = given.strip(), purpose.strip()
        if not sep or not given or not purpose:
            return None
        if len(given) > MAX_INPUT_CHARS or len(purpose) > MAX_PURPOSE_CHARS:
            return None
        return ToolCall(tool, given, purpose)
    return None


def observation(digest: str) -> str:
    """The text appended to the reasoner's response after its call: the digest's visible part (thinking
    dropped, cut to :data:`MAX_DIGEST_CHARS`) on a line of its own after :data:`OBSERVATION_WORD`.

    Its tokens are context the reasoner did not write: they are masked out of its loss."""
    return f"\n{OBSERVATION_WORD} {strip_thinking(digest)[:MAX_DIGEST_CHARS]}\n"


# ------------------------------------------------------------------------------------------ the tools
@dataclass(frozen=True)
class Tool:
    """A local tool: its name in calls, one line saying what it does, and the function that runs it
    (input text -> output text; it reports its own errors as text)."""

    name: str
    description: str
    run: Callable[[str], str]


def run_tool(call: ToolCall, allowed: Collection[str] | None = None) -> str:
    """The output of ``call``, cut to :data:`MAX_OUTPUT_CHARS`; ``error: ...`` when the tool is unknown,
    not in ``allowed`` (the caller's role may use only its own tool), or fails.

    Why errors are text: a rollout must not die because a model wrote a bad call, and a model that
    reads what went wrong can learn to call better."""
    tool = TOOLS.get(call.tool)
    if tool is None or (allowed is not None and call.tool not in allowed):
        names = ", ".join(sorted(TOOLS if allowed is None else allowed))
        return f"error: no tool {call.tool!r} (tools: {names})"
    return tool.run(call.input)[:MAX_OUTPUT_CHARS]


# ------------------------------------------------------------------------------------------------ calc
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_MAGNITUDE = 10**30
"""Largest absolute value of any number in a calculation (literals, intermediate and final results)."""

_BINARY: Mapping[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: Mapping[type[ast.unaryop], Callable[[float], float]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


class CalcError(ValueError):
    """An expression the calculator will not or cannot evaluate; the message is what the caller sees."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **``, unary minus and plus, and
    parentheses; nothing else (no names, calls, attributes, subscripts, comparisons, strings).

    Evaluated by walking Python's parse tree, never by ``eval``; bounded so no input can take long or
    use much memory: at most :data:`MAX_EXPRESSION_CHARS` characters, exponents up to
    :data:`MAX_EXPONENT` in size, every number within :data:`MAX_MAGNITUDE`.

    Raises:
        CalcError: saying what is wrong (the caller turns it into an ``error:`` observation).
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not an arithmetic expression") from None
    try:
        return _evaluate(tree.body)
    except RecursionError:
        raise CalcError("expression nested too deeply") from None


def _evaluate(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalcError(f"only numbers are allowed, not {value!r}")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError(f"result larger than {MAX_MAGNITUDE:.0e}") from None
        return _bounded(result)
    what = type(node.op).__name__ if isinstance(node, ast.BinOp | ast.UnaryOp) else type(node).__name__
    raise CalcError(f"{what} is not allowed (numbers, + - * / // % **, parentheses)")


def _check_power(base: float, exponent: float) -> None:
    """Refuse a power before computing it when it would be huge (``9**10**9`` must not even start)."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponent larger than {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalcError(f"result larger than {MAX_MAGNITUDE:.0e}")
    if base < 0 and not float(exponent).is_integer():
        raise CalcError("fractional power of a negative number")


def _bounded(value: object) -> int | float:
    if isinstance(value, complex) or not isinstance(value, int | float):
        raise CalcError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"number larger than {MAX_MAGNITUDE:.0e}")
    return value


def format_number(value: int | float) -> str:
    """An integer as its digits; a float with 12 significant digits, and without ``.0`` when whole
    (``84/2`` reads ``42``, as a person would write it)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


def calc(expression: str) -> str:
    """The ``calc`` tool: ``"<expression> = <value>"``, or ``"error: <why>"``."""
    try:
        value = calculate(expression)
    except CalcError as err:
        return f"error: {err}"
    return f"{' '.join(expression.split())} = {format_number(value)}"


# ---------------------------------------------------------------------------------------------- lookup
DOCUMENTS = Path(__file__).with_name("lookup_docs.json")
"""The document set ``lookup`` searches: a JSON list of ``{"title", "text"}``, shipped with the package."""
MAX_QUERY_CHARS = 200
LOOKUP_HITS = 3
_WORD = re.compile(r"[a-z0-9]+")
_STOP_WORDS = frozenset(
    "a an and are at by for from how in is it many much of on or the to what which with".split()
)
"""Words too common to tell documents apart: they do not count towards a match."""


@functools.lru_cache(maxsize=1)
def _documents() -> tuple[tuple[str, str, frozenset[str]], ...]:
    """The documents as (title, text, their words), read once; a broken file reads as no documents."""
    try:
        data = json.loads(DOCUMENTS.read_text(encoding="utf-8"))
        return tuple(
            (d["title"], d["text"], frozenset(_WORD.findall(f"{d['title']} {d['text']}".lower())))
            for d in data
        )
    except (OSError, ValueError, TypeError, KeyError):
        return ()


def lookup(query: str) -> str:
    """The ``lookup`` tool: the documents sharing most words with ``query`` (at most
    :data:`LOOKUP_HITS`, best first, ties in file order), one ``title: text`` line each; read-only,
    local, no network."""
    if len(query) > MAX_QUERY_CHARS:
        return f"error: query longer than {MAX_QUERY_CHARS} characters"
    words = set(_WORD.findall(query.lower())) - _STOP_WORDS
    if not words:
        return "error: the query has no words to search for"
    documents = _documents()
    if not documents:
        return "error: the document set is unavailable"
    scored = [(len(words & doc_words), i) for i, (_, _, doc_words) in enumerate(documents)]
    hits = sorted((-score, i) for score, i in scored if score > 0)[:LOOKUP_HITS]
    if not hits:
        return f"no document matches {query.strip()!r}"
    return "\n".join(f"{documents[i][0]}: {documents[i][1]}" for _, i in hits)


TOOLS: Mapping[str, Tool] = MappingProxyType(
    {
        "calc": Tool("calc", "an arithmetic calculator: numbers, + - * / // % ** and parentheses", calc),
        "lookup": Tool("lookup", "searches a small shipped set of reference notes by words", lookup),
    }
)
"""Every tool a graph may name (``roles.<role>.tool.name``)."""
