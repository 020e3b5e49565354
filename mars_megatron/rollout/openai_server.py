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

No client can starve the others: ``max_tokens`` has an upper bound (``max_tokens_limit``), a request
without a usable ``Content-Length`` is answered 400/411/413 before any body is read, every connection
has a read timeout (``read_timeout_s``) so idle ones are closed, at most ``max_connections`` are served
at once (a newcomer takes the slot of the connection idle longest before its request's headers, or is
answered 503 and closed when every connection is busy with a request), and non-finite numbers (``NaN``,
``Infinity``) and out-of-range sampling values are refused with 400 naming the field.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

from mars_megatron.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)

_MAX_BODY_BYTES = 16 * 2**20
_DEFAULT_MAX_TOKENS_LIMIT = 32768
_DRAIN_S, _DRAIN_BYTES = 0.5, 2**20  # unread input left before close: bounded wait, then give up
_BUSY_BODY = json.dumps(
    {"error": {"message": "too many connections", "type": "server_error", "param": None, "code": "busy"}}
).encode()
_BUSY_REPLY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)
_EVICT_WAIT_S = 2.0  # the accept loop's wait for an evicted connection's thread to free its slot
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
        max_tokens_limit: largest ``max_tokens`` accepted, so one request cannot hold the engine for
            minutes; default the engine's ``max_model_len`` when it has one, else 32768.
        read_timeout_s: socket timeout of each connection (each read and write), so an idle or
            trickling client is disconnected instead of holding a handler thread.
        max_connections: most connections served at once (one thread each); further connections are
            answered 503 at once and closed, so idle connections cannot pile up threads.
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
        max_tokens_limit: int | None = None,
        read_timeout_s: float = 30.0,
        max_connections: int = 64,
    ) -> None:
        if max_tokens_limit is None:
            engine_max = getattr(engine, "max_model_len", None)
            valid = isinstance(engine_max, int) and not isinstance(engine_max, bool) and engine_max > 0
            max_tokens_limit = engine_max if valid else _DEFAULT_MAX_TOKENS_LIMIT
        if max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {max_tokens_limit}")
        if not (math.isfinite(read_timeout_s) and read_timeout_s > 0):
            raise ValueError(f"read_timeout_s must be finite and > 0, got {read_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.engine, self.model_name, self.tokenizer = engine, model_name, tokenizer
        self.host, self.port, self.api_key = host, port, api_key
        self.max_tokens_limit, self.read_timeout_s = max_tokens_limit, read_timeout_s
        self.max_connections = max_connections
        vocab = getattr(engine, "vocab_size", None)
        self.vocab_size = vocab if _is_int(vocab) and vocab > 0 else None
        context = getattr(engine, "max_model_len", None) or getattr(engine, "max_positions", None)
        self.context_len = context if _is_int(context) and context > 0 else None
        self._engine_lock = threading.Lock()
        self._httpd: _BoundedHTTPServer | None = None
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
        httpd = _BoundedHTTPServer((self.host, self.port), _Handler, self.max_connections)
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
        if self.vocab_size is not None and max(prompt) >= self.vocab_size:
            raise RequestError(
                400,
                f"'prompt' holds token id {max(prompt)}, past the model's vocabulary of {self.vocab_size}",
            )
        logprobs = body.get("logprobs")
        if not (logprobs is None or (_is_int(logprobs) and logprobs in (0, 1))):
            raise RequestError(400, f"'logprobs' must be 0, 1 or null, got {logprobs!r}")
        as_ids = body.get("return_tokens_as_token_ids")
        if not (as_ids is None or isinstance(as_ids, bool)):
            raise RequestError(
                400, f"'return_tokens_as_token_ids' must be true, false or null, got {as_ids!r}"
            )
        top_k = body.get("top_k", -1)
        stop_token_ids = body.get("stop_token_ids") or []
        if not (isinstance(stop_token_ids, list) and all(_is_int(t) for t in stop_token_ids)):
            raise RequestError(400, "'stop_token_ids' must be a list of token ids")
        max_tokens = _or(body.get("max_tokens"), 16)
        if not (_is_int(max_tokens) and 1 <= max_tokens <= self.max_tokens_limit):
            raise RequestError(
                400, f"'max_tokens' must be an integer in [1, {self.max_tokens_limit}], got {max_tokens!r}"
            )
        if self.context_len is not None and len(prompt) + max_tokens > self.context_len:
            raise RequestError(
                400,
                f"'prompt' has {len(prompt)} tokens; with 'max_tokens' {max_tokens} that is more than the "
                f"model's context of {self.context_len} tokens",
            )
        temperature = _number(body, "temperature", 1.0)
        if temperature < 0:
            raise RequestError(400, f"'temperature' must be >= 0, got {temperature!r}")
        top_p = _number(body, "top_p", 1.0)
        if not 0 < top_p <= 1:
            raise RequestError(400, f"'top_p' must be in (0, 1], got {top_p!r}")
        if not (top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool))):
            raise RequestError(400, f"'top_k' must be an integer, got {top_k!r}")
        seed = body.get("seed")
        if not (seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and abs(seed) < 2**63)):
            raise RequestError(400, f"'seed' must be a 64-bit integer, got {seed!r}")
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=-1 if top_k in (None, 0, -1) else top_k,
                seed=seed,
                stop_token_ids=tuple(stop_token_ids),
            )
        except (TypeError, ValueError) as e:
            raise RequestError(400, str(e)) from e
        request = GenerationRequest(f"cmpl-{uuid.uuid4().hex}", tuple(prompt), sampling)
        return request, logprobs is not None, bool(as_ids)


def _is_int(x: object) -> bool:
    """A token id or count: a non-negative int (not a bool), below 2**31 (what engines index with)."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31


def _or(value: Any, default: float) -> Any:
    return default if value is None else value


def _number(body: dict[str, Any], key: str, default: float) -> float:
    """``body[key]`` as a finite float; strings and ``1e999`` (parsed as inf) would slip past range checks."""
    value = _or(body.get(key), default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(400, f"'{key}' must be a finite number, got {value!r}")
    return float(value)


def _refuse_constant(name: str) -> NoReturn:
    """``parse_constant`` for :func:`json.loads`: Python's JSON accepts NaN and Infinity, JSON does not."""
    raise RequestError(400, f"non-finite number {name} in the request body (JSON numbers must be finite)")


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A threading server that serves at most ``max_connections`` connections at once.

    Each connection holds a thread until it closes; without a cap, idle connections exhaust threads.
    At the cap, a new connection takes the slot of the connection that has waited longest for its next
    request (connected, or between keep-alive requests, without a complete request line and headers):
    that one is shut down. Idle or half-sent requests therefore cannot keep a well-formed one out (500
    of them used to: every slot held until the read timeout, every newcomer answered 503); a connection
    whose request is being read or answered is never evicted. With no such connection the newcomer is
    answered 503 from the accept loop (non-blocking, a fresh socket's send buffer takes the short reply)
    and closed, without starting a thread.
    """

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: bursts of connections wait for accept, not for a SYN retry

    def __init__(self, address: tuple[str, int], handler: type[_Handler], max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._waiting: dict[Any, float] = {}
        """Connections waiting for a request line and headers -> since when (monotonic)."""
        self._waiting_lock = threading.Lock()

    def awaiting_request(self, connection: Any, waiting: bool) -> None:
        """Mark ``connection`` as waiting for its next request's headers (evictable) or not."""
        with self._waiting_lock:
            if waiting:
                self._waiting[connection] = time.monotonic()
            else:
                self._waiting.pop(connection, None)

    def _evict_idle(self) -> bool:
        """Shut down the connection that has waited longest for its request; False if none waits."""
        with self._waiting_lock:
            if not self._waiting:
                return False
            connection = min(self._waiting, key=self._waiting.__getitem__)
            del self._waiting[connection]
        try:
            connection.shutdown(
                socket.SHUT_RDWR
            )  # its handler's read returns: the thread ends, the slot frees
        except OSError:
            pass
        return True

    def _acquire_slot(self) -> bool:
        if self._slots.acquire(blocking=False):
            return True
        while self._evict_idle():
            if self._slots.acquire(timeout=_EVICT_WAIT_S):
                return True
        return False

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._acquire_slot():
            logger.warning("refusing %s: %s", client_address, "too many connections")
            try:
                request.setblocking(False)
                request.send(_BUSY_REPLY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.awaiting_request(request, False)
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server_version = "mars-megatron-openai/1"

    @property
    def app(self) -> OpenAICompletionsServer:
        return self.server.app  # type: ignore[attr-defined]

    def setup(self) -> None:
        # StreamRequestHandler applies ``timeout`` to the socket: idle and trickling clients time out.
        self.timeout = self.app.read_timeout_s
        self._unread_input = False  # set when replying before the body was read: drain before closing
        super().setup()

    def handle_one_request(self) -> None:
        # Until its request line and headers are in, the connection may be evicted for a newcomer.
        self.server.awaiting_request(self.connection, True)  # type: ignore[attr-defined]
        try:
            super().handle_one_request()
        except OSError:  # evicted (shut down) or reset while waiting: nothing to answer
            self.close_connection = True
        finally:
            self.server.awaiting_request(self.connection, False)  # type: ignore[attr-defined]

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers: evictable until they are in
        self.server.awaiting_request(self.connection, False)  # type: ignore[attr-defined]
        return ok

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
            try:
                length = self._content_length()
            except RequestError:
                # The body is left unread: answer now, close, and drain briefly so the reply is not reset.
                self.close_connection = self._unread_input = True
                raise
            try:
                raw = self.rfile.read(length)  # read before any answer: unread input would reset the socket
            except TimeoutError:
                self.close_connection = self._unread_input = True
                raise RequestError(
                    408, f"request body not received within {self.app.read_timeout_s} s"
                ) from None
            if len(raw) < length:
                self.close_connection = self._unread_input = True
                raise RequestError(400, f"request body ended after {len(raw)} of {length} bytes")
            if not self._check_auth():
                return
            if self.path.rstrip("/") != "/v1/completions":
                raise RequestError(404, f"no route {self.path}")
            try:
                body = json.loads(raw, parse_constant=_refuse_constant)
            except RequestError:
                raise
            except (ValueError, RecursionError) as e:
                raise RequestError(400, f"invalid JSON: {e}") from e
            self._send(200, self.app.complete(body))
        except RequestError as e:
            self._error(e.status, str(e), e.code)
        except Exception as e:
            logger.exception("completion failed")
            self._error(500, f"engine error: {type(e).__name__}: {e}")

    def _content_length(self) -> int:
        """The declared body size; refused before reading, since a bad one would hold the thread."""
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise RequestError(411, "Content-Length is required")
        if len(values) > 1 or not values[0].strip().isdigit():  # isdigit: no sign, no "-1"
            raise RequestError(400, f"invalid Content-Length {', '.join(values)!r}")
        length = int(values[0])
        if length > _MAX_BODY_BYTES:
            raise RequestError(413, f"request body over {_MAX_BODY_BYTES} bytes")
        return length

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (bad request line, header too long, unknown method) as OpenAI-style
        JSON like every other error; an unknown method is 405 (http.server says 501, a server fault)."""
        if code == 501:
            code, message = 405, f"method {self.command!r} is not allowed; use POST /v1/completions"
        elif code == 505:
            code = 400
        elif code == 431:
            message = f"request headers refused: {message}"
        self.close_connection = True
        self._unread_input = True
        try:
            self._error(code, message or HTTPStatus(code).phrase)
        except OSError:
            pass

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
        if self._unread_input:
            self._drain()

    def _drain(self) -> None:
        """Read (bounded in time and size) what the client still sends, after replying on a connection
        whose body went unread: closing with unread input resets the socket, and the client may then
        lose the reply."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + _DRAIN_S
            received = 0
            while received < _DRAIN_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.connection.settimeout(left)
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                received += len(chunk)
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)
