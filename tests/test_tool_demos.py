"""The tool pair's task (sums of two- and three-digit numbers) and its warm-start demonstrations."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.tools import parse_call, run_tool
from mars_megatron.config import ConfigError
from mars_megatron.models.tokenizer import build_tiny_tokenizer
from mars_megatron.rollout.chat import ChatCodec
from mars_megatron.tasks.arith import load_arith_file, operands
from mars_megatron.tasks.demos import DemoConfig
from mars_megatron.tasks.tool_demos import (
    TEST_FILE,
    TRAIN_FILE,
    ToolDemo,
    build_tool_demos,
    encode_tool_demo,
    sum_problems,
    train_test_split,
    write_task_files,
)

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


@pytest.fixture(scope="module")
def graph() -> AgentGraph:
    return load_graph("tool_pair")


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tiny_tokenizer(1024))


# ------------------------------------------------------------------------------------------------ task
def test_sum_problems_are_distinct_seeded_and_in_range() -> None:
    problems = sum_problems(300, seed=3)
    assert problems == sum_problems(300, seed=3) and problems != sum_problems(300, seed=4)
    assert len({p.problem_id for p in problems}) == 300
    assert [p.line for p in problems] == list(range(1, 301))
    for p in problems:
        a, b = operands(p)
        assert 10 <= a <= 999 and 10 <= b <= 999 and p.reference == a + b
    with pytest.raises(ValueError, match=r"n must be in 1\.\.4"):
        sum_problems(5, low=1, high=2)


def test_split_is_disjoint() -> None:
    train, test = train_test_split(50, 20)
    assert len(train) == 50 and len(test) == 20
    assert not {p.problem_id for p in train} & {p.problem_id for p in test}
    assert [p.line for p in test] == list(range(1, 21))


def test_shipped_files_are_what_the_generator_writes(tmp_path: Path) -> None:
    written = write_task_files(tmp_path)
    for name, path in zip((TRAIN_FILE, TEST_FILE), written, strict=True):
        assert (DATA / name).read_bytes() == path.read_bytes()
    train, test = load_arith_file(DATA / TRAIN_FILE), load_arith_file(DATA / TEST_FILE)
    assert (len(train), len(test)) == (400, 100)


# ----------------------------------------------------------------------------------------------- demos
def _demos(graph: AgentGraph, cfg: DemoConfig, n: int = 2000) -> list[ToolDemo]:
    return build_tool_demos(sum_problems(400), graph, "compact", cfg, n)


def test_demos_are_deterministic(graph: AgentGraph) -> None:
    cfg = DemoConfig(seed=5)
    assert _demos(graph, cfg, 50) == _demos(graph, cfg, 100)[:50]


def test_demo_mix_is_what_the_config_says(graph: AgentGraph) -> None:
    demos = _demos(graph, DemoConfig(careful={"reasoner": 0.3, "distiller": 0.6}, weights={"distiller": 3}))
    roles = Counter(d.role for d in demos)
    assert roles["distiller"] / len(demos) == pytest.approx(0.75, abs=0.03)
    for role, share in (("reasoner", 0.3), ("distiller", 0.6)):
        mine = [d for d in demos if d.role == role]
        assert sum(d.careful for d in mine) / len(mine) == pytest.approx(share, abs=0.04)


def test_demo_modes_look_as_documented(graph: AgentGraph) -> None:
    demos = _demos(graph, DemoConfig(input_accuracy=0.7))
    careful_reasoners = [d for d in demos if d.role == "reasoner" and d.careful]
    for d in demos:
        a, b = operands(d.messages[-1]["content"].splitlines()[0]) if d.role == "reasoner" else (0, 0)
        if d.role == "reasoner" and d.careful:
            call = parse_call(d.turns[0])
            assert call is not None and (call.tool, call.input, call.purpose) == (
                "calc",
                f"{a}+{b}",
                "the sum",
            )
            (obs,) = d.observations
            assert obs.startswith("\nRESULT ") and obs.endswith("\n")
            value = obs.split()[-1].rstrip(".")
            assert d.turns[1] == f"\\boxed{{{value}}}"  # copied from the digest, right or not
            assert d.rewarded == (int(value) == a + b)
        elif d.role == "reasoner":
            assert len(d.turns) == 1 and d.turns[0].startswith("\\boxed{") and not d.observations
            assert d.rewarded == (d.turns[0] == f"\\boxed{{{a + b}}}")
        else:
            output = d.messages[-1]["content"].splitlines()[0]
            a, b = (int(x) for x in output.split(" = ")[0].split("+"))
            assert output == run_tool(parse_call(f"use calc {a}+{b} for the sum"))  # type: ignore[arg-type]
            if d.careful:
                assert d.turns == (f"the sum is {a + b}.",) and d.rewarded
            else:
                assert d.turns[0].endswith(".") and d.turns[0] != f"{a + b}." and not d.rewarded
    right = sum(d.rewarded for d in careful_reasoners) / len(careful_reasoners)
    assert right == pytest.approx(0.7, abs=0.08)


def test_modes_are_told_apart_by_the_first_token(graph: AgentGraph, codec: ChatCodec) -> None:
    first: dict[tuple[str, bool], set[str]] = {}
    for d in _demos(graph, DemoConfig(default_careful=0.5), 400):
        token = codec.tokenizer(d.turns[0], add_special_tokens=False)["input_ids"][0]
        first.setdefault((d.role, d.careful), set()).add(codec.tokenizer.decode([token]))
    assert first[("reasoner", True)] == {"use"} and first[("reasoner", False)] == {"\\"}
    assert first[("distiller", True)] == {"the"}
    assert first[("distiller", False)] <= set("0123456789")


def test_encoded_reasoner_demo_trains_its_turns_and_masks_the_observation(
    graph: AgentGraph, codec: ChatCodec
) -> None:
    demo = next(d for d in _demos(graph, DemoConfig(careful={"reasoner": 1.0}), 20) if d.role == "reasoner")
    a, b = operands(demo.messages[-1]["content"].splitlines()[0])
    ids, mask = encode_tool_demo(demo, codec)
    prompt = codec.encode(demo.messages)
    assert tuple(ids[: len(prompt)]) == prompt and len(mask) == len(ids) - 1
    tok = codec.tokenizer
    response = tok.decode(ids[len(prompt) :])
    value = demo.turns[1][len("\\boxed{") : -1]
    assert response == (
        f"use calc {a}+{b} for the sum<|im_end|>{demo.observations[0]}\\boxed{{{value}}}<|im_end|>"
    )
    assert demo.response == f"use calc {a}+{b} for the sum{demo.observations[0]}\\boxed{{{value}}}"
    trained = tok.decode([t for t, m in zip(ids[1:], mask, strict=True) if m])
    masked = tok.decode(
        [t for t, m in zip(ids[len(prompt) :], mask[len(prompt) - 1 :], strict=True) if not m]
    )
    assert trained == f"use calc {a}+{b} for the sum<|im_end|>\\boxed{{{value}}}<|im_end|>"
    assert masked == demo.observations[0]
    assert mask[: len(prompt) - 1] == [0] * (len(prompt) - 1)


def test_encoded_distiller_demo(graph: AgentGraph, codec: ChatCodec) -> None:
    demo = next(d for d in _demos(graph, DemoConfig(careful={"distiller": 1.0}), 20) if d.role == "distiller")
    ids, mask = encode_tool_demo(demo, codec)
    prompt = codec.encode(demo.messages)
    text = codec.tokenizer.decode(ids)
    assert text.endswith(f"Write the sum.<|im_end|>\n<|im_start|>assistant\n{demo.turns[0]}<|im_end|>")
    assert sum(mask) == len(ids) - len(prompt)
    assert len(prompt) < 40  # compact: a tiny model pays for every token


def test_demo_config_errors_name_the_field() -> None:
    graph = load_graph("tool_pair")
    problems = sum_problems(10)
    with pytest.raises(ConfigError, match=r"demos\.weights: at least one role"):
        build_tool_demos(problems, graph, "compact", DemoConfig(weights=dict.fromkeys(graph.roles, 0.0)), 1)
    with pytest.raises(ConfigError, match="demos: graph 'tool_pair' has no role 'solver'"):
        build_tool_demos(problems, graph, "compact", DemoConfig(careful={"solver": 0.5}), 1)
    assert DemoConfig().with_careful(0.9).careful_share("reasoner") == 0.9
