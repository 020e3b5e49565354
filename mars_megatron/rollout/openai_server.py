"""A small OpenAI-compatible completions server in front of any local rollout engine.

Use it to expose a local checkpoint to tools that speak the OpenAI completions API, and to test
:class:`~mars_megatron.rollout.openai_engine.OpenAIEngine` against a real HTTP server::

    engine = HFEngine("ckpt/")
    with OpenAICompletionsServer(engine, model_name="policy", tokenizer=tokenizer) as server:
        client = OpenAIEngine(server.url, "policy")

It serves the subset that engine uses, with vLLM's extensions: ``POST /v1/completions`` with a token-id
``prompt`` (one list of ids, or a batch of exactly one), ``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop_token_ids``, ``logprobs`` (0 or 1: the sampled token's log-prob; no
alternatives, ``top_logprobs`` is null) and ``return_tokens_as_token_ids``; ``GET /v1/models`` lists the
one model. ``text`` is filled when a tokenizer is given, empty otherwise. Text prompts, ``stop`` strings,
``n > 1``, ``echo`` and streaming are refused with 400.

Binds 127.0.0.1 by default (port 0 picks a free port, see :attr:`OpenAICompletionsServer.url`); pass
``host="0.0.0.0"`` deliberately, and an ``api_key``, to serve other machines. Requests are handled on
threads but engine calls are serialised by a lock (engines are not thread-safe), one request at a time.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mars_megatron.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)

_MAX_BODY_BYTES = 16 * 2**20
_UNSUPPORTED = {"stream": False, "echo": False, "n": 1, "best_of": 1, "suffix": None}


class RequestError(ValueError):
    """A client error, answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class OpenAICompletionsServer:
    """Serves ``engine`` at ``http://{host}:{port}/v1/completions`` on a background thread.

    Args:
        engine: any :class:`~mars_megatron.rollout.engine.RolloutEngine`.
        model_name: the model name clients must send (``model`` may also be omitted).
        tokenizer: optional, with ``decode(list[int]) -> str``; fills ``text``.
        host: interface to bind; loopback only by default.
        port: TCP port; 0 picks a free one.
        api_key: when set, requests must carry ``Authorization: Bearer <api_key>``.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        model_name: str = "mars-megatron",
        tokenizer: Any = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        self.engine, self.model_name, self.tokenizer = engine, model_name, tokenizer
        self.host, self.port, self.api_key = host, port, api_key
        self._engine_lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server (the actual port when started with port 0)."""
        if self._httpd is None:
            raise RuntimeError("the server is not started")
        return f"http://{self.host}:{self._httpd.server_address[1]}"

    def start(self) -> OpenAICompletionsServer:
        if self._httpd is not None:
            raise RuntimeError("the server is already started")
        httpd = ThreadingHTTPServer((self.host, self.port), _Handler)
        httpd.daemon_threads = True
        httpd.app = self  # type: ignore[attr-defined]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, name="openai-server", daemon=True)
        self._thread.start()
        logger.info("serving %s at %s/v1/completions", self.model_name, self.url)
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._httpd, self._thread = None, None

    def __enter__(self) -> OpenAICompletionsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def authorised(self, authorization: str | None) -> bool:
        return self.api_key is None or authorization == f"Bearer {self.api_key}"

    def complete(self, body: Any) -> dict[str, Any]:
        """The completions response for a parsed request ``body``; raises :class:`RequestError`."""
        request, logprobs_wanted, token_ids_wanted = self._parse(body)
        with self._engine_lock:
            (output,) = self.engine.generate([request])
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        logprobs = None
        if logprobs_wanted:
            pieces = [decode([t]) if decode else "" for t in output.token_ids]
            offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
            logprobs = {
                "tokens": [
                    f"token_id:{t}" if token_ids_wanted or decode is None else p
                    for t, p in zip(output.token_ids, pieces, strict=True)
                ],
                "token_logprobs": list(output.logprobs),
                "top_logprobs": None,
                "text_offset": offsets,
            }
        n_prompt, n_out = len(request.prompt_ids), len(output.token_ids)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "text": decode(output.token_ids) if decode else "",
                    "logprobs": logprobs,
                    "finish_reason": output.finish_reason,
                    "stop_reason": None,
                }
            ],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
            },
        }

    def _parse(self, body: Any) -> tuple[GenerationRequest, bool, bool]:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(404, f"The model `{model}` does not exist.", "model_not_found")
        for key, default in _UNSUPPORTED.items():
            if body.get(key, default) not in (default, None):
                raise RequestError(400, f"'{key}' is not supported by this server (only {default!r})")
        if body.get("stop"):
            raise RequestError(400, "'stop' strings are not supported; use 'stop_token_ids'")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
            raise RequestError(
                400, "'prompt' must be a non-empty list of token ids (text prompts unsupported)"
            )
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0, 1):
            raise RequestError(400, f"'logprobs' must be 0, 1 or null, got {logprobs!r}")
        top_k = body.get("top_k", -1)
        stop_token_ids = body.get("stop_token_ids") or []
        if not (isinstance(stop_token_ids, list) and all(_is_int(t) for t in stop_token_ids)):
            raise RequestError(400, "'stop_token_ids' must be a list of token ids")
        try:
            sampling = SamplingParams(
                max_tokens=int(_or(body.get("max_tokens"), 16)),
                temperature=float(_or(body.get("temperature"), 1.0)),
                top_p=float(_or(body.get("top_p"), 1.0)),
                top_k=-1 if top_k in (None, 0, -1) else int(top_k),
                seed=None if body.get("seed") is None else int(body["seed"]),
                stop_token_ids=tuple(stop_token_ids),
            )
        except (TypeError, ValueError) as e:
            raise RequestError(400, str(e)) from e
        request = GenerationRequest(f"cmpl-{uuid.uuid4().hex}", tuple(prompt), sampling)
        return request, logprobs is not None, bool(body.get("return_tokens_as_token_ids"))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _or(value: Any, default: float) -> Any:
    return default if value is None else value


class _Handler(BaseHTTPRequestHandler):
    server_version = "mars-megatron-openai/1"

    @property
    def app(self) -> OpenAICompletionsServer:
        return self.server.app  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        if not self._check_auth():
            return
        if self.path.rstrip("/") != "/v1/models":
            self._error(404, f"no route {self.path}")
            return
        model = {"id": self.app.model_name, "object": "model", "owned_by": "mars-megatron"}
        self._send(200, {"object": "list", "data": [model]})

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY_BYTES:
                raise RequestError(413, f"request body over {_MAX_BODY_BYTES} bytes")
            raw = self.rfile.read(length)  # read before any answer: unread input would reset the socket
            if not self._check_auth():
                return
            if self.path.rstrip("/") != "/v1/completions":
                raise RequestError(404, f"no route {self.path}")
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise RequestError(400, f"invalid JSON: {e}") from e
            self._send(200, self.app.complete(body))
        except RequestError as e:
            self._error(e.status, str(e), e.code)
        except Exception as e:
            logger.exception("completion failed")
            self._error(500, f"engine error: {type(e).__name__}: {e}")

    def _check_auth(self) -> bool:
        if self.app.authorised(self.headers.get("Authorization")):
            return True
        self._error(401, "Incorrect or missing API key", "invalid_api_key")
        return False

    def _error(self, status: int, message: str, code: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send(status, {"error": {"message": message, "type": kind, "param": None, "code": code}})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)
