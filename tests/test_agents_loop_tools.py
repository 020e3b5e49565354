"""A tool-using role's step in the inference loop (the tool_pair graph): its calls are served inside the
step, and the engine prompt of its continuation is laid out as training lays out a served call."""

from __future__ import annotations

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.loop import ENDED, InferenceLoop
from mars_megatron.config import EvalConfig
from mars_megatron.evaluation.runner import prompt_tokens
from mars_megatron.models.tokenizer import build_tiny_tokenizer
from mars_megatron.rollout.chat import ChatCodec

GRAPH = load_graph("tool_pair")
PROBLEM = "Find 372+45."


def test_a_call_is_served_and_the_answer_is_the_whole_response() -> None:
    loop = InferenceLoop(PROBLEM, GRAPH, prompts="compact")
    first = loop.next_request()
    assert first is not None and first.role == "reasoner" and first.continuation == ()
    loop.observe("use calc 372+45 for the sum")
    digest_request = loop.next_request()
    assert digest_request is not None and digest_request.role == "distiller"
    assert "372+45 = 417" in digest_request.messages[-1]["content"]  # the calculator's output
    assert "the sum" in digest_request.messages[-1]["content"]  # and the purpose
    loop.observe("the sum is 417.")
    again = loop.next_request()
    assert again is not None and again.role == "reasoner" and again.messages == first.messages
    assert again.continuation == (
        ("use calc 372+45 for the sum", True),
        ("\nRESULT the sum is 417.\n", False),
    )
    loop.observe("\\boxed{417}")
    assert loop.done
    result = loop.result()
    assert result.stop_reason == ENDED and not result.accepted
    assert result.solution == "use calc 372+45 for the sum\nRESULT the sum is 417.\n\\boxed{417}"
    assert result.calls == {"reasoner": 2, "distiller": 1}  # engine calls: two turns and one digest
    assert [(s.role, s.partial) for s in result.history] == [
        ("reasoner", True),
        ("distiller", False),
        ("reasoner", False),
    ]
    assert (
        result.history[0].text == "use calc 372+45 for the sum" and result.history[-1].text == result.solution
    )


def test_no_call_and_calls_beyond_max_calls_end_the_step() -> None:
    loop = InferenceLoop(PROBLEM, GRAPH, prompts="compact")
    loop.observe("\\boxed{400}")
    assert loop.done and loop.result().solution == "\\boxed{400}"
    loop = InferenceLoop(PROBLEM, GRAPH, prompts="compact")
    loop.observe("use calc 372+45 for the sum")
    loop.observe("the sum is 417.")
    loop.observe("use calc 1+1 for more")  # max_calls 1: not served
    assert loop.done and loop.result().solution.endswith("use calc 1+1 for more")
    assert loop.result().calls == {"reasoner": 2, "distiller": 1}


def test_a_truncated_continuation_is_retried_from_the_start() -> None:
    loop = InferenceLoop(PROBLEM, GRAPH, EvalConfig(start_retries=1), prompts="compact")
    loop.observe("use calc 372+45 for the sum")
    loop.observe("the sum is 417.")
    loop.observe("\\boxed{4", truncated=True)
    retry = loop.next_request()
    assert retry is not None and retry.role == "reasoner" and retry.continuation == ()
    loop.observe("\\boxed{417}")
    assert loop.result().solution == "\\boxed{417}"


def test_the_continuation_prompt_is_the_training_layout() -> None:
    """Chat prompt, the turn, end-of-turn, the observation: the tokens a served call holds in training
    (pipeline/agents.py: serve_tools), so a model is evaluated on the layout it was trained on."""
    codec = ChatCodec(build_tiny_tokenizer(1024))
    loop = InferenceLoop(PROBLEM, GRAPH, prompts="compact")
    first = loop.next_request()
    assert first is not None
    loop.observe("use calc 372+45 for the sum")
    loop.observe("the sum is 417.")
    again = loop.next_request()
    assert again is not None
    turn = codec.encode_text("use calc 372+45 for the sum")
    observed = codec.encode_text("\nRESULT the sum is 417.\n")
    assert prompt_tokens(codec, again) == (*codec.encode(first.messages), *turn, codec.end_of_turn, *observed)
