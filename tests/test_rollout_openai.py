"""The HTTP engine against a real server on 127.0.0.1: the transformers engine served by
``openai_server`` must come back token for token; failures must be quick, bounded and explained."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
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


class LocalServer:
    """A threaded HTTP server on 127.0.0.1 (port 0) around ``handler``, serving while in a ``with`` block."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> Any:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class JsonHandler(BaseHTTPRequestHandler):
    def reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class Scripted(LocalServer):
    """A fake completions server answering with the given (status, body) replies in order."""

    def __init__(self, replies: list[tuple[int, dict[str, Any]]]) -> None:
        self.replies, self.bodies = list(replies), []
        script = self

        class Handler(JsonHandler):
            def do_POST(self) -> None:
                script.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.reply(*script.replies.pop(0))

        super().__init__(Handler)


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


def test_a_reply_nested_past_the_recursion_limit_is_invalid_json() -> None:
    """A hostile or broken server's reply fails as an EngineError naming the endpoint, not as the
    RecursionError json.loads raises (which escaped every handler written for bad JSON)."""

    class Deep(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            data = b"[" * 100_000 + b"]" * 100_000
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    with LocalServer(Deep) as fake:
        with pytest.raises(EngineError, match=r"returned invalid JSON"):
            OpenAIEngine(fake.url, "m").generate(requests(GREEDY)[:1])


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


class Recorder(LocalServer):
    """A second origin: records the headers of every request it receives and answers a valid completion."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        recorder = self

        class Handler(JsonHandler):
            def _answer(self) -> None:
                recorder.headers.append(dict(self.headers))
                self.reply(200, OK_BODY)

            do_GET = do_POST = _answer

        super().__init__(Handler)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_redirect_is_refused_and_the_key_never_leaves_the_origin(
    status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "s3cret")
    with Recorder() as elsewhere:
        target = elsewhere.url + "/v1/completions"

        class Redirect(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(status)
                self.send_header("Location", target)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        with ThreadingHTTPServer(("127.0.0.1", 0), Redirect) as httpd:
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
            url = f"http://127.0.0.1:{httpd.server_address[1]}"
            engine = OpenAIEngine(url, "m", api_key_env=KEY_ENV, backoff_s=10)
            try:
                with pytest.raises(EngineError) as failure:
                    engine.generate(requests(GREEDY)[:1])
            finally:
                httpd.shutdown()
    assert f"POST {url}/v1/completions answered HTTP {status}, a redirect to '{target}'" in str(failure.value)
    assert elsewhere.headers == []  # never contacted, so never saw the Authorization header


class Stub:
    """A fast engine for the server's input checks: answers ``max_tokens`` copies of token 5."""

    def __init__(self, max_model_len: int | None = None) -> None:
        self.calls = 0
        if max_model_len is not None:
            self.max_model_len = max_model_len

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        self.calls += 1
        return [
            GenerationOutput(
                r.request_id, [5] * r.sampling.max_tokens, [-0.5] * r.sampling.max_tokens, "length"
            )
            for r in requests
        ]


@pytest.fixture
def stub_server() -> Iterator[OpenAICompletionsServer]:
    with OpenAICompletionsServer(
        Stub(), max_tokens_limit=100, read_timeout_s=0.5, max_connections=3
    ) as server:
        yield server


def port_of(server: OpenAICompletionsServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def post_raw(server: OpenAICompletionsServer, body: bytes) -> tuple[int, str]:
    """POST ``body`` as is (NaN and Infinity included) and return the status and error message."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=5)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        payload = json.loads(reply.read())
    finally:
        conn.close()
    return reply.status, (payload.get("error") or {}).get("message", "")


def exchange(port: int, data: bytes, timeout: float = 5) -> bytes:
    """Send ``data`` on a fresh connection and return everything received until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    return received


@pytest.mark.parametrize(
    ("header", "status"),
    [
        (b"Content-Length: -1\r\n", b"400"),
        (b"Content-Length: abc\r\n", b"400"),
        (b"", b"411"),
        (b"Content-Length: 999999999999\r\n", b"413"),
    ],
)
def test_bad_content_length_is_answered_at_once(
    stub_server: OpenAICompletionsServer, header: bytes, status: bytes
) -> None:
    start = time.monotonic()
    reply = exchange(port_of(stub_server), b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n")
    assert reply.split(b"\r\n", 1)[0].split(b" ")[1] == status
    assert time.monotonic() - start < 2  # not held until a body that never comes


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"prompt": [1, 2], "temperature": NaN}', "non-finite number NaN"),
        (b'{"prompt": [1, 2], "top_p": Infinity}', "non-finite number Infinity"),
        (b'{"prompt": [1, 2], "temperature": -Infinity}', "non-finite number -Infinity"),
        (b'{"prompt": [1, 2], "temperature": 1e999}', "'temperature' must be a finite number"),
        (b'{"prompt": [1, 2], "temperature": "0.5"}', "'temperature' must be a finite number"),
        (b'{"prompt": [1, 2], "temperature": -0.5}', "'temperature' must be >= 0"),
        (b'{"prompt": [1, 2], "top_p": 1.5}', "'top_p' must be in (0, 1]"),
        (b'{"prompt": [1, 2], "top_p": 0}', "'top_p' must be in (0, 1]"),
        (b'{"prompt": [1, 2], "max_tokens": 101}', "'max_tokens' must be an integer in [1, 100]"),
        (b'{"prompt": [1, 2], "max_tokens": 10000000}', "'max_tokens' must be an integer in [1, 100]"),
        (b'{"prompt": [1, 2], "max_tokens": 0}', "'max_tokens' must be an integer in [1, 100]"),
        (b'{"prompt": [1, 2], "max_tokens": 8.5}', "'max_tokens' must be an integer in [1, 100]"),
        (b'{"prompt": [1, 2], "seed": 1e999}', "'seed' must be a 64-bit integer"),
        (b'{"prompt": [1, 2], "top_k": 2.5}', "'top_k' must be an integer"),
        (b"[" * 100000 + b"]" * 100000, "invalid JSON"),
    ],
)
def test_invalid_numbers_are_refused_naming_the_field(
    stub_server: OpenAICompletionsServer, body: bytes, message: str
) -> None:
    status, error = post_raw(stub_server, body)
    assert (status, error[: len(message)]) == (400, message)
    assert stub_server.engine.calls == 0  # type: ignore[attr-defined]


def test_max_tokens_at_the_limit_is_served(stub_server: OpenAICompletionsServer) -> None:
    status, _ = post_raw(
        stub_server, b'{"prompt": [1, 2], "max_tokens": 100, "temperature": 0.7, "top_p": 1}'
    )
    assert status == 200
    out = post_json(stub_server.url + "/v1/completions", {"prompt": [1], "max_tokens": 3, "logprobs": 0})
    assert out["choices"][0]["logprobs"]["tokens"] == ["token_id:5"] * 3


def test_max_tokens_limit_defaults_to_the_engine_max_model_len() -> None:
    assert OpenAICompletionsServer(Stub(max_model_len=4096)).max_tokens_limit == 4096
    assert OpenAICompletionsServer(Stub()).max_tokens_limit == 32768


def test_idle_connection_is_closed_after_the_read_timeout(stub_server: OpenAICompletionsServer) -> None:
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port_of(stub_server)), timeout=5) as s:
        assert s.recv(1) == b""  # closed by the server (a hang would raise TimeoutError after 5 s)
    assert 0.4 < time.monotonic() - start < 3


def test_connections_over_the_cap_are_answered_503_while_the_others_are_busy() -> None:
    """Connections whose request is being read (headers in, body pending) are not evicted: a newcomer
    over the cap is answered 503 at once, and the busy ones are still served."""
    with OpenAICompletionsServer(Stub(), read_timeout_s=10, max_connections=3) as server:
        port = port_of(server)
        body = b'{"prompt": [1], "max_tokens": 1}'
        head = b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(body)
        busy = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        try:
            for s in busy:
                s.sendall(head)  # headers in, body pending: the request is being read
            time.sleep(0.3)  # the handlers have parsed the headers
            for _ in range(2):
                reply = exchange(port, b"")
                assert reply.startswith(b"HTTP/1.0 503 ")
                assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "busy"
            busy[0].sendall(body)  # the busy ones are still served
            assert busy[0].recv(65536).startswith(b"HTTP/1.0 200 ")
        finally:
            for s in busy:
                s.close()
        deadline = time.monotonic() + 3  # slots come back once the handlers see the close
        while (reply := exchange(port, b"GET /v1/models HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.0 503"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert reply.startswith(b"HTTP/1.0 200 ")


@contextlib.contextmanager
def half_sent_requests(port: int, n: int) -> Iterator[list[socket.socket]]:
    """``n`` connections to ``port`` that each send half a request line and idle (closed on exit), oldest
    first: the flood the server must not be starved by (also the bad-input suite's case)."""
    idle: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Le")
            idle.append(s)
        yield idle
    finally:
        for s in idle:
            s.close()


def test_500_idle_half_sent_requests_do_not_starve_a_well_formed_one() -> None:
    """500 connections that send half a request line and idle take every slot long before their read
    timeout; a well-formed request is still answered within seconds (it takes the slot of the longest
    idle one), and every idle one beyond the slots is closed at once (evicted, or refused with 503)."""
    with OpenAICompletionsServer(Stub(), read_timeout_s=60, max_connections=64) as server:
        with half_sent_requests(port_of(server), 500) as idle:
            start = time.monotonic()
            out = post_json(server.url + "/v1/completions", {"prompt": [1], "max_tokens": 2, "logprobs": 0})
            assert out["choices"][0]["logprobs"]["tokens"] == ["token_id:5"] * 2
            assert time.monotonic() - start < 3
            closed = 0
            for s in idle[:400]:  # the oldest: none can still hold a slot (64 do, the newest)
                s.settimeout(5)
                received = b""
                try:
                    while chunk := s.recv(65536):
                        received += chunk
                except ConnectionResetError:
                    pass
                assert received == b"" or received.startswith(b"HTTP/1.0 503 ")
                closed += 1
            assert closed == 400


class Huge(LocalServer):
    """A server whose reply body is 300 MiB of zeros, declared in Content-Length (``declared``) or not
    (HTTP/1.0, the body ends at the close); it counts the bytes the client let it send."""

    def __init__(self, declared: bool) -> None:
        self.sent = 0
        script = self

        class Handler(JsonHandler):
            protocol_version = "HTTP/1.0"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                if declared:
                    self.send_header("Content-Length", str(300 * 2**20))
                self.end_headers()
                block = b"0" * 2**20
                try:
                    for _ in range(300):
                        self.wfile.write(block)
                        script.sent += len(block)
                except OSError:
                    pass  # the client stopped reading and closed

        super().__init__(Handler)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "until-close"])
def test_a_300_mib_response_is_refused_naming_the_url_and_the_limit(declared: bool) -> None:
    with Huge(declared) as fake:
        engine = OpenAIEngine(fake.url, "m", max_retries=0)
        with pytest.raises(EngineError) as failure:
            engine.generate(requests(GREEDY)[:1])
    message = str(failure.value)
    assert f"POST {fake.url}/v1/completions" in message
    assert "67,108,864 bytes (max_response_bytes)" in message
    assert fake.sent < 100 * 2**20  # not read to the end
