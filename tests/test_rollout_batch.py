"""One engine call's requests and outputs as columns (``rollout/batch.py``): what the engine and the
records see is what was sent, and a call pickles as a few objects whatever its size."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from mars_megatron.pipeline.agents import segment_request
from mars_megatron.pipeline.contexts import ContextIndex
from mars_megatron.pipeline.scheduler import SegmentJob
from mars_megatron.rollout.batch import OutputBatch, RequestBatch
from mars_megatron.rollout.engine import GenerationOutput, SamplingParams

SAMPLING = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, stop_token_ids=(2,))


def _jobs(n: int) -> list[SegmentJob]:
    rng = np.random.default_rng(0)
    return [
        SegmentJob(
            f"s{i}",
            "solver",
            rng.integers(3, 1000, 5 + i, dtype=np.int32),
            rng.integers(3, 1000, i % 3, dtype=np.int32),  # some continue a response, some start one
            8 + i,
            1000 + i,
            0,
        )
        for i in range(n)
    ]


def test_a_call_carries_each_segments_request_unchanged() -> None:
    jobs = _jobs(6)
    batch = pickle.loads(pickle.dumps(ContextIndex().request_batch(jobs, SAMPLING), protocol=5))
    for got, job in zip(batch.requests(), jobs, strict=True):
        want = segment_request(job, SAMPLING)
        assert (got.request_id, got.sampling) == (want.request_id, want.sampling)
        assert got.prompt_ids.dtype == np.int32 and got.prompt_ids.tolist() == list(want.prompt_ids)
    again = RequestBatch.of_requests([segment_request(j, SAMPLING) for j in jobs])
    assert again.tokens.tolist() == batch.tokens.tolist() and again.offsets == batch.offsets


def test_a_call_pickles_as_a_few_objects_whatever_its_size() -> None:
    """The reason for the columns: pickled one object a request, Ray's serialiser paid per object."""
    small, large = (ContextIndex().request_batch(_jobs(n), SAMPLING) for n in (4, 64))
    buffers: list[pickle.PickleBuffer] = []
    pickle.dumps(large, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1  # every request's tokens in one array
    outs = [
        GenerationOutput(f"s{i}", [5, 6, 7][: 1 + i % 3], [-0.5, -0.25, -1.0][: 1 + i % 3], "stop")
        for i in range(64)
    ]
    buffers = []
    pickle.dumps(OutputBatch.of(outs, routing_by_reference=False), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2  # tokens and log-probs
    assert len(small) == 4 and len(large) == 64


def test_outputs_come_back_as_the_engine_wrote_them() -> None:
    routing = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    outs = [
        GenerationOutput("a", [5, 6], [-0.5, 1e-7], "length", routed_experts=routing),
        GenerationOutput("b", [], [], "stop", extra={"note": 1}),
        GenerationOutput("c", np.array([9], dtype=np.int64), np.array([-2.0]), "stop"),
    ]
    got = pickle.loads(pickle.dumps(OutputBatch.of(outs, routing_by_reference=False), protocol=5)).outputs()
    assert [o.request_id for o in got] == ["a", "b", "c"]
    assert [o.token_ids.tolist() for o in got] == [[5, 6], [], [9]]
    assert [o.logprobs.tolist() for o in got] == [[-0.5, float(np.float32(1e-7))], [], [-2.0]]
    assert [o.finish_reason for o in got] == ["length", "stop", "stop"]
    assert [o.extra for o in got] == [{}, {"note": 1}, {}]
    assert got[0].routed_experts.tolist() == routing.tolist() and got[1].routed_experts is None


def test_an_output_its_budget_cut_carries_its_next_context() -> None:
    """What a continuing segment's request names: the prompt it was decoded from, then the output; only
    for outputs the budget cut (one that stopped has no next segment)."""
    outs = [
        GenerationOutput("a", [5, 6], [-0.5, -0.5], "length"),
        GenerationOutput("b", [7], [-0.5], "stop"),
        GenerationOutput("c", [8], [-0.5], "length"),
    ]
    prompts = [np.array([1, 2, 3], dtype=np.int32), np.array([4], dtype=np.int32), (9, 9)]
    batch = pickle.loads(pickle.dumps(OutputBatch.of(outs, False, prompts), protocol=5))
    spans = [batch.next_context(i) for i in range(3)]
    assert spans[1] is None and batch.carried is not None
    assert [batch.carried[a:b].tolist() for a, b in (spans[0], spans[2])] == [[1, 2, 3, 5, 6], [9, 9, 8]]
    assert OutputBatch.of(outs, False).next_context(0) is None  # not asked to carry: nothing carried


def test_a_malformed_call_is_refused_naming_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="output x: 2 tokens but 1 log-probs"):
        OutputBatch.of([GenerationOutput("x", [1, 2], [-0.1], "stop")], routing_by_reference=False)
    with pytest.raises(ValueError, match="2 request ids, 2 offsets"):
        RequestBatch(("a", "b"), np.zeros(3, dtype=np.int32), (0, 3), (1, 1), (None, None), SAMPLING)
    with pytest.raises(ValueError, match=r"offsets span 0\.\.2, tokens hold 3"):
        RequestBatch(("a",), np.zeros(3, dtype=np.int32), (0, 2), (1,), (None,), SAMPLING)
    with pytest.raises(ValueError, match=r"request a names tokens 0:4 of source 1 \(1 sources\)"):
        empty = np.zeros(0, dtype=np.int32)
        RequestBatch(("a",), empty, (0, 0), (1,), (None,), SAMPLING, ("ref",), ((1, 0, 4),))
    hot = segment_request(_jobs(1)[0], SamplingParams(max_tokens=64, temperature=1.0))
    with pytest.raises(ValueError, match=r"request s0 samples with .*one call shares its sampling"):
        RequestBatch.of_requests([segment_request(_jobs(2)[1], SAMPLING), hot])
