"""The shipped ``imo_refine`` graph (arXiv 2507.15855's verification-and-refinement pipeline) loads,
validates and says what the paper's pipeline does; its compact prompts stay short for the tiny model."""

from __future__ import annotations

import pytest

from mars_megatron.agents.graph import GraphError, LoopBudgets
from mars_megatron.agents.graph_file import load_graph, shipped_graphs
from mars_megatron.config import EvalConfig

IMO = load_graph("imo_refine")


def test_it_is_shipped_and_its_roles_are_what_the_pipeline_needs() -> None:
    assert "imo_refine" in shipped_graphs() and IMO.name == "imo_refine"
    kinds = {r.name: (r.output, r.verdict, r.reward) for r in IMO.roles.values()}
    assert kinds == {
        "solver": ("solution", None, "answer"),
        "verifier": ("report", None, "outcome"),  # a log without a verdict, rewarded by its judgements
        "judge": ("judgement", "yes_no", "verdict"),
        "corrector": ("solution", None, "answer"),
    }
    assert IMO.prompt_sets == ("full", "compact") and IMO.policies == {"shared": tuple(IMO.roles)}


def test_the_loop_verifies_judges_and_corrects() -> None:
    steps = {s.name: (s.role, s.next, s.on_pass, s.on_fail) for s in IMO.loop.steps.values()}
    assert IMO.loop.start == "solve" and IMO.start_role == "solver"
    assert steps == {
        "solve": ("solver", "verify", None, None),
        "verify": ("verifier", "judge", None, None),
        "judge": ("judge", None, "verify", "correct"),
        "correct": ("corrector", "verify", None, None),
    }
    assert LoopBudgets.of(IMO) == LoopBudgets(
        start_retries=3, max_iterations=30, accept_after=5, give_up_after=10
    )
    overridden = LoopBudgets.of(IMO, EvalConfig(accept_after=2, start_retries=0))
    assert (overridden.accept_after, overridden.start_retries, overridden.max_iterations) == (2, 0, 30)


def test_the_training_trajectory_fits_seven_positions() -> None:
    got = [(p.name, p.role, p.input, p.when, p.strategy) for p in IMO.positions]
    assert got == [
        ("solver", "solver", None, "any", None),
        ("verifier_1", "verifier", "solver", "any", None),
        ("judge_1", "judge", "verifier_1", "any", "random"),  # the verifier's reward is an outcome
        ("corrector_1", "corrector", "judge_1", "rejected", None),
        ("verifier_2", "verifier", "corrector_1", "any", None),
        ("judge_2", "judge", "verifier_2", "any", "random"),
        ("corrector_2", "corrector", "judge_2", "rejected", None),
    ]
    assert len(load_graph("imo_refine", max_steps=7).trajectory(3)) == 3
    with pytest.raises(GraphError, match=r"agents\.max_steps: is 8, beyond the 7 positions"):
        load_graph("imo_refine", max_steps=8)


def test_full_prompts_ask_for_a_log_without_a_grade_and_a_yes_no_judgement() -> None:
    variables = {"problem": "P", "solution": "S", "report": "R", "bug_report": "B"}
    verifier = IMO.roles["verifier"].messages("full", variables)
    assert [m["role"] for m in verifier] == ["system", "user"] and "Correctness" not in verifier[0]["content"]
    judge = IMO.roles["judge"].messages("full", variables)
    assert len(judge) == 1 and "R" in judge[0]["content"] and "yes or no" in judge[0]["content"]
    corrector = IMO.roles["corrector"].messages("full", variables)
    assert corrector[1] == {"role": "assistant", "content": "S"} and corrector[2]["content"].endswith("B")
    assert "\\boxed{}" in corrector[0]["content"]


def test_compact_prompts_are_a_few_tiny_tokens() -> None:
    """The tiny run pays for every prompt token: each compact template is at most 24 tokens of the tiny
    tokenizer (MarsRL's compact Verifier request is 18), and its words other than yes/no are whole."""
    from mars_megatron.models.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    empty = dict.fromkeys(("problem", "solution", "report", "bug_report"), "")
    counts = {
        role.name: [len(tokenizer.encode(m["content"])) for m in role.messages("compact", empty)]
        for role in IMO.roles.values()
    }
    assert counts == {
        "solver": [11],
        "verifier": [14],  # no system message in the compact set
        "judge": [24],
        "corrector": [11, 0, 17],  # the Solver's request, its solution, the findings
    }
    for word in (" solution", " correct", " complete", " check", " step", "Findings", "Solution"):
        assert len(tokenizer.encode(word)) == 1, word
