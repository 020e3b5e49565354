"""The HTTP engine against a real server on 127.0.0.1: the transformers engine served by
``openai_server`` must come back token for token; failures must be quick, bounded and explained."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from mars_megatron.models.presets import init_model
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, RolloutEngine, SamplingParams
from mars_megatron.rollout.hf_engine import HFEngine
from mars_megatron.rollout.openai_engine import EngineError, OpenAIEngine
from mars_megatron.rollout.openai_server import OpenAICompletionsServer

KEY_ENV = "MARS_TEST_OPENAI_KEY"
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-dense", tmp_path_factory.mktemp("openai") / "dense")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> HFEngine:
    return HFEngine(model_dir)


@pytest.fixture(scope="module")
def server(hf: HFEngine, model_dir: Path) -> Iterator[OpenAICompletionsServer]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with OpenAICompletionsServer(hf, model_name="tiny", tokenizer=tokenizer) as s:
        yield s


@pytest.fixture
def client(server: OpenAICompletionsServer, monkeypatch: pytest.MonkeyPatch) -> OpenAIEngine:
    monkeypatch.delenv(KEY_ENV, raising=False)
    return OpenAIEngine(server.url, "tiny", api_key_env=KEY_ENV, timeout_s=30)


def requests(sampling: SamplingParams, lengths: tuple[int, ...] = (3, 9, 5, 1, 7)) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"r{i}", tuple(range(11 + i, 11 + i + n)), sampling) for i, n in enumerate(lengths)
    ]


def assert_same(outs: list[GenerationOutput], refs: list[GenerationOutput]) -> None:
    assert [o.request_id for o in outs] == [r.request_id for r in refs]
    for o, r in zip(outs, refs, strict=True):
        assert o.token_ids == r.token_ids
        assert o.finish_reason == r.finish_reason
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), rtol=0, atol=1e-6)


def test_greedy_through_http_matches_hf_engine(client: OpenAIEngine, hf: HFEngine) -> None:
    assert isinstance(client, RolloutEngine)
    reqs = requests(GREEDY)
    outs = client.generate(reqs)  # five requests in flight at once
    refs = [hf.generate([r])[0] for r in reqs]  # the server runs them one at a time
    assert_same(outs, refs)
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in outs)


def test_stop_token_finishes_with_stop(client: OpenAIEngine, hf: HFEngine) -> None:
    (first,) = hf.generate([requests(GREEDY)[0]])
    stop_at = first.token_ids[2]
    sampling = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop_at,))
    (out,) = client.generate([GenerationRequest("s", requests(GREEDY)[0].prompt_ids, sampling)])
    assert out.finish_reason == "stop"
    assert out.token_ids == first.token_ids[: first.token_ids.index(stop_at) + 1]


def test_seeded_sampling_through_http_matches_hf_engine(client: OpenAIEngine, hf: HFEngine) -> None:
    reqs = [
        GenerationRequest(r.request_id, r.prompt_ids, SamplingParams(10, 0.9, 0.95, 50, seed=100 + i))
        for i, r in enumerate(requests(GREEDY))
    ]
    outs = client.generate(reqs)
    assert_same(outs, [hf.generate([r])[0] for r in reqs])
    assert outs == client.generate(reqs)


def test_server_returns_text_and_usage(server: OpenAICompletionsServer, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    body = {"model": "tiny", "prompt": [[5, 6, 7]], "max_tokens": 4, "temperature": 0, "logprobs": 0}
    as_ids = post_json(server.url + "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    choice = as_ids["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert choice["text"] == tokenizer.decode(ids) and len(ids) == 4
    assert as_ids["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    as_text = post_json(server.url + "/v1/completions", body)["choices"][0]["logprobs"]["tokens"]
    assert as_text == [tokenizer.decode([i]) for i in ids]


def test_api_key_is_required_and_sent(hf: HFEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    with OpenAICompletionsServer(hf, model_name="tiny", api_key="s3cret") as server:
        monkeypatch.setenv(KEY_ENV, "s3cret")
        (out,) = OpenAIEngine(server.url, "tiny", api_key_env=KEY_ENV).generate(requests(GREEDY)[:1])
        assert out.token_ids == hf.generate(requests(GREEDY)[:1])[0].token_ids
        for key in ("wrong", None):
            if key is None:
                monkeypatch.delenv(KEY_ENV)
            else:
                monkeypatch.setenv(KEY_ENV, key)
            engine = OpenAIEngine(server.url, "tiny", api_key_env=KEY_ENV, backoff_s=0)
            with pytest.raises(EngineError, match="HTTP 401: Incorrect or missing API key"):
                engine.generate(requests(GREEDY)[:1])


def test_unreachable_endpoint_fails_quickly_naming_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    url = f"http://127.0.0.1:{port}"
    engine = OpenAIEngine(url, "tiny", timeout_s=2, max_retries=2, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(EngineError, match=f"{url}/v1/completions failed after 3 attempts: cannot connect"):
        engine.generate(requests(GREEDY)[:2])
    assert time.monotonic() - start < 5


def test_silent_server_times_out() -> None:
    with socket.socket() as listener:  # accepts connections (kernel backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"no response within timeout_s=0\.5"):
            OpenAIEngine(url, "tiny", timeout_s=0.5, backoff_s=0).generate(requests(GREEDY)[:1])
    assert time.monotonic() - start < 5


def test_wrong_model_name_fails_at_once_with_the_server_message(client: OpenAIEngine) -> None:
    engine = OpenAIEngine(client.url.removesuffix("/v1/completions"), "other", backoff_s=10)
    with pytest.raises(EngineError, match="HTTP 404: The model `other` does not exist"):
        engine.generate(requests(GREEDY)[:1])


OK_BODY = {
    "choices": [
        {
            "text": "ab",
            "finish_reason": "length",
            "logprobs": {"tokens": ["token_id:4", "token_id:9"], "token_logprobs": [-0.5, -1.25]},
        }
    ]
}


class Scripted:
    """A fake completions server answering with the given (status, body) replies in order."""

    def __init__(self, replies: list[tuple[int, dict[str, Any]]]) -> None:
        self.replies, self.bodies = list(replies), []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                script.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status, body = script.replies.pop(0)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> Scripted:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_server_error_is_retried_then_succeeds() -> None:
    with Scripted([(500, {"error": {"message": "busy"}}), (429, {}), (200, OK_BODY)]) as fake:
        sampling = SamplingParams(max_tokens=2, temperature=0.5, top_k=3, seed=1, stop_token_ids=(2,))
        (out,) = OpenAIEngine(fake.url, "m", backoff_s=0.01).generate(
            [GenerationRequest("x", (1,), sampling)]
        )
    assert (out.request_id, out.token_ids, out.logprobs, out.finish_reason) == (
        "x",
        [4, 9],
        [-0.5, -1.25],
        "length",
    )
    assert len(fake.bodies) == 3
    assert fake.bodies[0] == {
        "model": "m",
        "prompt": [1],
        "max_tokens": 2,
        "temperature": 0.5,
        "top_p": 1.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "top_k": 3,
        "seed": 1,
        "stop_token_ids": [2],
    }


def test_client_error_is_not_retried() -> None:
    with Scripted([(400, {"message": "bad prompt"})]) as fake:
        with pytest.raises(EngineError, match="HTTP 400: bad prompt"):
            OpenAIEngine(fake.url, "m", backoff_s=10).generate(requests(GREEDY)[:1])
    assert len(fake.bodies) == 1


def test_response_without_token_ids_is_explained() -> None:
    text_tokens = {
        "choices": [{"finish_reason": "stop", "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]}}]
    }
    with Scripted([(200, text_tokens), (200, {"choices": [{"text": "a", "logprobs": None}]})]) as fake:
        engine = OpenAIEngine(fake.url, "m")
        with pytest.raises(EngineError, match="return_tokens_as_token_ids"):
            engine.generate(requests(GREEDY)[:1])
        with pytest.raises(EngineError, match="no per-token log-probs"):
            engine.generate(requests(GREEDY)[:1])


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())
