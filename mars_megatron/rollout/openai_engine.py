"""Rollout engine over HTTP: any OpenAI-compatible *completions* server that speaks vLLM's extensions.

Each request is one ``POST {endpoint}/v1/completions`` whose ``prompt`` is the token-id list itself, so
no tokenizer runs here. Token ids and log-probs of the sampled tokens come back through vLLM's
extensions: ``logprobs: 0`` (the sampled token's log-prob only) and ``return_tokens_as_token_ids: true``
(tokens as ``"token_id:123"``); ``top_k`` and ``stop_token_ids`` are vLLM extensions too. A server
without them (the OpenAI API itself) cannot serve the trainer, and the engine says so instead of
guessing ids from text. vLLM reports raw log-probs by default (``logprobs_mode="raw_logprobs"``), the
definition of :mod:`mars_megatron.rollout.engine`; a server started with another mode would not.

Requests run concurrently on a bounded thread pool. Connection failures, 429 and 5xx are retried with
exponential backoff; any other HTTP error fails at once with the server's message. Every wait is
bounded: socket timeouts on each call, a fixed number of retries. Redirects are never followed: urllib
would carry the ``Authorization`` header to whatever origin a 3xx names and accept that origin's reply
as a completion, so a 3xx fails at once naming the endpoint and the ``Location`` it pointed to.

:mod:`mars_megatron.rollout.openai_server` serves any local engine behind the same protocol.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mars_megatron.json_file import parse_json
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest

_TOKEN_ID_PREFIX = "token_id:"
_MAX_BACKOFF_S = 30.0
MAX_RESPONSE_BYTES = 64 * 2**20
"""Default bound of one response body: a completion of 32k tokens with their ids and log-probs is about
3 MiB, so 64 MiB leaves room for long contexts and still stops a server (or a man in the middle) from
filling the trainer's memory with one reply."""
_MAX_ERROR_BYTES = 64 * 2**10


class EngineError(RuntimeError):
    """A rollout engine could not produce outputs; the message says what failed and where."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Follows no redirect, so the API key never leaves the configured origin.

    Returning ``None`` makes urllib hand the 3xx to its default error handler, which raises
    :class:`urllib.error.HTTPError`; :meth:`OpenAIEngine._post` turns that into an :class:`EngineError`.
    """

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> None:
        return None


# One opener for every engine: redirects refused, everything else as urllib's default opener.
_OPENER = urllib.request.build_opener(_RefuseRedirects)


def check_endpoint(endpoint: str, what: str = "endpoint") -> str:
    """An ``http(s)://host[:port][/path]`` server root, refused otherwise naming ``what``: urllib also
    opens ``file://`` and ``ftp://`` URLs (a file would be read as a completion), and credentials in the
    URL would be sent in the clear and logged."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{what} {endpoint!r}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {endpoint!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{what}: credentials in the URL; pass the API key in OPENAI_API_KEY instead")
    if port == 0 or parts.query or parts.fragment or any(c.isspace() or c in ";`$<>" for c in endpoint):
        raise ValueError(f"{what} {endpoint!r}: expected a server root such as http://127.0.0.1:8000")
    return endpoint


class OpenAIEngine:
    """A :class:`~mars_megatron.rollout.engine.RolloutEngine` on an OpenAI-compatible completions server.

    Args:
        endpoint: server root, e.g. ``http://127.0.0.1:8000`` (``/v1/completions`` is appended).
        model: the served model name sent as ``model``.
        api_key_env: environment variable holding the API key, read at construction; unset or empty
            sends no ``Authorization`` header.
        timeout_s: socket timeout of each HTTP call (connect and each read).
        max_retries: retries after the first attempt, on connection errors, 429 and 5xx only.
        max_concurrency: most requests in flight at once.
        backoff_s: wait before the first retry; doubled on each further retry (capped at 30 s).
        max_response_bytes: largest response body accepted (:data:`MAX_RESPONSE_BYTES`); a larger one is
            refused naming the URL and the limit, after reading at most one byte past it.
    """

    def __init__(
        self,
        endpoint: str,
        model: str,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 600,
        max_retries: int = 3,
        max_concurrency: int = 8,
        backoff_s: float = 0.5,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        if max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {max_response_bytes}")
        self.max_response_bytes = max_response_bytes
        self.url = check_endpoint(endpoint).rstrip("/") + "/v1/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_concurrency = max_concurrency
        self.backoff_s = backoff_s
        self._api_key = os.environ.get(api_key_env) or None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        if not requests:
            return []
        pool = ThreadPoolExecutor(min(self.max_concurrency, len(requests)), thread_name_prefix="openai")
        try:
            return list(pool.map(self._generate_one, requests))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def request_body(self, request: GenerationRequest) -> dict[str, Any]:
        """The JSON body sent for ``request``."""
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": request.prompt_list(),
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        if s.top_k != -1:
            body["top_k"] = s.top_k
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)
        return body

    def _generate_one(self, request: GenerationRequest) -> GenerationOutput:
        response = self._post(self.request_body(request))
        return self._parse(request.request_id, response)

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        last_failure = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            http_request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with _OPENER.open(http_request, timeout=self.timeout_s) as reply:
                    raw = self._read_bounded(reply)
            except urllib.error.HTTPError as e:
                if 300 <= e.code < 400:
                    location = e.headers.get("Location") if e.headers is not None else None
                    e.close()
                    raise EngineError(
                        f"POST {self.url} answered HTTP {e.code}, a redirect to {location!r}; redirects are "
                        "not followed (the API key must not leave the configured origin): set the endpoint "
                        "to the server that answers"
                    ) from e
                message = _error_message(e)
                if e.code != 429 and e.code < 500:
                    raise EngineError(f"POST {self.url} failed with HTTP {e.code}: {message}") from e
                last_failure = f"HTTP {e.code}: {message}"
            except urllib.error.URLError as e:  # connection refused, DNS, connect timeout
                last_failure = f"cannot connect ({e.reason})"
            except TimeoutError as e:  # read timeout: the server may still be working, do not pile on
                raise EngineError(f"POST {self.url}: no response within timeout_s={self.timeout_s}") from e
            except (ConnectionError, http.client.HTTPException) as e:  # reset / closed mid-response
                last_failure = f"connection lost ({type(e).__name__}: {e})"
            else:
                try:
                    return parse_json(raw)  # a reply nested past the recursion limit is a ValueError too
                except ValueError as e:
                    raise EngineError(f"POST {self.url} returned invalid JSON: {raw[:200]!r}") from e
        raise EngineError(f"POST {self.url} failed after {self.max_retries + 1} attempts: {last_failure}")

    def _read_bounded(self, reply: Any) -> bytes:
        """The response body, refused when its declared or actual size passes ``max_response_bytes``
        (never more than one byte past the limit is read)."""
        limit = self.max_response_bytes
        declared = reply.headers.get("Content-Length") if reply.headers is not None else None
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise EngineError(
                f"POST {self.url}: the response body is {int(declared):,} bytes (Content-Length), over the "
                f"limit of {limit:,} bytes (max_response_bytes)"
            )
        raw = reply.read(limit + 1)
        if len(raw) > limit:
            raise EngineError(
                f"POST {self.url}: the response body is over the limit of {limit:,} bytes "
                "(max_response_bytes); not read further"
            )
        return raw

    def _parse(self, request_id: str, response: dict[str, Any]) -> GenerationOutput:
        try:
            choice = response["choices"][0]
        except (KeyError, IndexError, TypeError) as e:
            raise EngineError(f"{self.url}: response without choices: {str(response)[:200]}") from e
        logprobs = choice.get("logprobs") or {}
        tokens, token_logprobs = logprobs.get("tokens"), logprobs.get("token_logprobs")
        if tokens is None or token_logprobs is None or len(tokens) != len(token_logprobs):
            raise EngineError(
                f"{self.url}: the response has no per-token log-probs; the engine needs a server that "
                "honours 'logprobs: 0' on completions (vLLM's OpenAI server does)"
            )
        token_ids = []
        for token in tokens:
            if not (isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX)):
                raise EngineError(
                    f"{self.url}: the response gives tokens as text ({token!r}), not token ids; the engine "
                    "needs the vLLM extension 'return_tokens_as_token_ids' (vLLM's OpenAI server, or "
                    "mars_megatron.rollout.openai_server)"
                )
            token_ids.append(int(token[len(_TOKEN_ID_PREFIX) :]))
        finish_reason = "length" if choice.get("finish_reason") == "length" else "stop"
        return GenerationOutput(request_id, token_ids, [float(x) for x in token_logprobs], finish_reason)


def _error_message(error: urllib.error.HTTPError) -> str:
    """The server's error message: OpenAI's ``{"error": {"message"}}``, vLLM's ``{"message"}``, or text."""
    try:
        raw = error.read(_MAX_ERROR_BYTES).decode(errors="replace")  # an error page is read in part
    except OSError:
        return error.reason or ""
    try:
        payload = parse_json(raw)
    except ValueError:
        return raw[:500] or str(error.reason)
    if isinstance(payload, dict):
        inner = payload.get("error")
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
        if "message" in payload:
            return str(payload["message"])
    return raw[:500]
