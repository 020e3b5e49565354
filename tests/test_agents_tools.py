"""The tool protocol: calls parsed from model text, the sandboxed calculator, observations."""

from __future__ import annotations

from pathlib import Path

import pytest

from mars_megatron.agents import tools
from mars_megatron.agents.tools import (
    MAX_DIGEST_CHARS,
    MAX_EXPRESSION_CHARS,
    MAX_OUTPUT_CHARS,
    MAX_QUERY_CHARS,
    TOOLS,
    CalcError,
    Tool,
    ToolCall,
    calc,
    calculate,
    format_number,
    lookup,
    observation,
    parse_call,
    run_tool,
)


# ------------------------------------------------------------------------------------------ parse_call
@pytest.mark.parametrize(
    "call",
    [
        ToolCall("calc", "37+45", "the sum"),
        ToolCall("calc", "(3 + 4) * 2 ** 10", "the area in square metres"),
        ToolCall("lookup", "boiling point of water", "the temperature for the kettle"),  # purpose says for
        ToolCall("calc_2", "-7 // 2", "x"),
    ],
)
def test_call_round_trips(call: ToolCall) -> None:
    assert parse_call(call.text()) == call
    assert parse_call(f"Let me add these.\n{call.text()}\n") == call
    assert parse_call(f"<think>use calc 1+1 for a draft</think>\n{call.text()}") == call


def test_the_last_call_counts() -> None:
    text = "use calc 1+1 for two\nthen\nuse calc 2+2 for four"
    assert parse_call(text) == ToolCall("calc", "2+2", "four")


def test_a_malformed_last_call_is_no_call_even_after_a_good_one() -> None:
    assert parse_call("use calc 1+1 for two\nuse calc 2+2") is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "The sum is 82. \\boxed{82}",
        "use calc 37+45",  # no purpose
        "use calc  for the sum",  # no input
        "use calc 37+45 for ",  # empty purpose
        "use Calc 37+45 for the sum",  # tool names are lower case
        "So use calc 37+45 for the sum",  # a call starts its line
        "USE calc 37+45 for the sum",
        "<think>use calc 37+45 for the sum</think>\nno call here",  # only the visible text counts
        "<think>use calc 37+45 for the sum",  # unfinished thinking: nothing visible
        f"use calc {'1+' * 600}1 for the sum",  # input over MAX_INPUT_CHARS
        f"use calc 1+1 for {'x' * 300}",  # purpose over MAX_PURPOSE_CHARS
    ],
)
def test_no_call(text: str) -> None:
    assert parse_call(text) is None


# ------------------------------------------------------------------------------------------------ calc
@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37+45", 82),
        ("  372 + 45 ", 417),
        ("(3+4)*2", 14),
        ("-5 + 2", -3),
        ("+5", 5),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("84 / 2", 42.0),
        ("1.5 * 4", 6.0),
        ("10 ** 30", 10**30),
        ("1_000 + 1", 1001),
        ("-" * 150 + "1", 1),  # deep but short: fine
    ],
)
def test_calculate(expression: str, value: float) -> None:
    result = calculate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("abs(-3)", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("[1, 2][0]", "Subscript is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("~5", "Invert is not allowed"),
        ("5 << 2", "LShift is not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j * 2", "only numbers are allowed"),
        ("9 ** 9 ** 9", "exponent larger than 100"),
        ("2 ** 101", "exponent larger than 100"),
        ("10 ** 31", "result larger than"),
        ("99 ** 99", "result larger than"),
        ("10**20 * 10**20", "number larger than"),
        ("1" * 40, "number larger than"),
        ("1e999", "not a finite number"),
        ("(-8) ** 0.5", "fractional power of a negative number"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1; 2", "not an arithmetic expression"),
        ("(" * 300 + "1" + ")" * 300, f"longer than {MAX_EXPRESSION_CHARS}"),
        ("(" * 99 + "1" + ")" * 99, ""),  # nested deep within the length limit: a value or an error
        ("1\x00", "not an arithmetic expression"),
    ],
)
def test_calculate_refuses(expression: str, reason: str) -> None:
    try:
        calculate(expression)
    except CalcError as err:
        assert reason in str(err)
    else:
        assert reason == "", f"{expression!r} was evaluated"


def test_calc_answers_in_text_and_never_raises() -> None:
    assert calc("37+45") == "37+45 = 82"
    assert calc("84 /  2") == "84 / 2 = 42"
    assert calc("1/3") == "1/3 = 0.333333333333"
    assert calc("open('/etc/passwd')") == "error: Call is not allowed (numbers, + - * / // % **, parentheses)"
    assert calc("1/0") == "error: division by zero"
    assert calc("1" * 500).startswith("error: expression longer than")


def test_format_number() -> None:
    assert [format_number(v) for v in (82, 42.0, -3.0, 0.5, 1e20, 2 / 3)] == [
        "82",
        "42",
        "-3",
        "0.5",
        "1e+20",
        "0.666666666667",
    ]


# ---------------------------------------------------------------------------------------------- lookup
def test_lookup_finds_the_notes_that_share_most_words() -> None:
    assert lookup("boiling point of water") == (
        "boiling point of water: At sea-level pressure water boils at 100 degrees Celsius, which is 212 "
        "degrees Fahrenheit."
    )
    hits = lookup("sum of the first n squares").splitlines()
    assert [h.split(":")[0] for h in hits][:2] == [
        "sum of the first n squares",
        "sum of the first n integers",
    ]
    assert len(lookup("n a b c 2 3 5 10 100 sum area")) <= 3 * 300
    assert len(lookup("n a b c 2 3 5 10 100 sum area").splitlines()) == 3  # at most LOOKUP_HITS


def test_lookup_misses_and_bad_queries_are_text() -> None:
    assert lookup("zebra") == "no document matches 'zebra'"
    assert lookup("the of how") == "error: the query has no words to search for"
    assert lookup("x" * (MAX_QUERY_CHARS + 1)) == f"error: query longer than {MAX_QUERY_CHARS} characters"


def test_lookup_without_its_documents_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "docs.json"
    broken.write_text('[{"title": "no text"}]')
    monkeypatch.setattr(tools, "DOCUMENTS", broken)
    tools._documents.cache_clear()
    try:
        assert lookup("text") == "error: the document set is unavailable"
    finally:
        tools._documents.cache_clear()


# ------------------------------------------------------------------------------------ registry, observations
def test_run_tool_reports_unknown_and_forbidden_tools_as_text() -> None:
    assert run_tool(ToolCall("calc", "2*21", "x")) == "2*21 = 42"
    assert run_tool(ToolCall("shell", "ls", "files")) == "error: no tool 'shell' (tools: calc, lookup)"
    assert (
        run_tool(ToolCall("lookup", "leap", "x"), allowed=["calc"]) == "error: no tool 'lookup' (tools: calc)"
    )
    assert run_tool(ToolCall("calc", "1+1", "x"), allowed=()) == "error: no tool 'calc' (tools: )"


def test_tool_output_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # a tool that talks too much is cut, whatever it is
    chatty = Tool("chatty", "repeats its input", lambda text: text * 10_000)
    monkeypatch.setattr(tools, "TOOLS", {**TOOLS, "chatty": chatty})
    assert len(run_tool(ToolCall("chatty", "ab", "noise"))) == MAX_OUTPUT_CHARS


def test_observation_wraps_the_visible_digest_on_its_own_line() -> None:
    assert observation("the sum is 82.") == "\nRESULT the sum is 82.\n"
    assert observation("<think>read it</think> 82 ") == "\nRESULT 82\n"
    assert observation("9" * 5000) == f"\nRESULT {'9' * MAX_DIGEST_CHARS}\n"
