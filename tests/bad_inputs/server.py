"""Server requests: the OpenAI-compatible completions server of ``mars_megatron.rollout.openai_server`` in
front of the real transformers engine on the tiny model. Request bodies go through the server's own request
handling in-process (``complete``: the parsing and checks every HTTP request reaches); framing (bad JSON,
Content-Length, size, paths, methods) goes over a real socket on 127.0.0.1.

A clear refusal is a 4xx whose message names the field (``'max_tokens'``) or the header.
"""

from __future__ import annotations

import json
import math
import socket
from typing import Any

from tests.bad_inputs.harness import Case, HttpReply, Workspace

CATEGORY = "server requests"
GOOD: dict[str, Any] = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.0}


def _complete(ws: Workspace, body: Any) -> Any:
    from mars_megatron.rollout.openai_server import RequestError

    try:
        return ws.fixtures.app.complete(body)
    except RequestError as e:
        return HttpReply(e.status, str(e))


def _with(**changes: Any) -> dict[str, Any]:
    body = dict(GOOD)
    for key, value in changes.items():
        if value is _DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


_DROP = object()

# (name, body, the name the message must hold)
BODIES: list[tuple[str, Any, str]] = [
    ("body-list", [GOOD], "JSON object"),
    ("body-string", "hello", "JSON object"),
    ("body-null", None, "JSON object"),
    ("body-number", 3, "JSON object"),
    ("model-wrong", _with(model="gpt-4"), "gpt-4"),
    ("model-int", _with(model=5), "5"),
    ("prompt-missing", _with(prompt=_DROP), "'prompt'"),
    ("prompt-empty", _with(prompt=[]), "'prompt'"),
    ("prompt-text", _with(prompt="What is 2+3?"), "'prompt'"),
    ("prompt-texts", _with(prompt=["a", "b"]), "'prompt'"),
    ("prompt-batch-of-two", _with(prompt=[[1, 2], [3]]), "'prompt'"),
    ("prompt-negative-id", _with(prompt=[1, -2]), "'prompt'"),
    ("prompt-float-id", _with(prompt=[1, 2.5]), "'prompt'"),
    ("prompt-bool-id", _with(prompt=[1, True]), "'prompt'"),
    ("prompt-null-id", _with(prompt=[1, None]), "'prompt'"),
    ("prompt-string-ids", _with(prompt=["1", "2"]), "'prompt'"),
    ("prompt-id-past-vocab", _with(prompt=[1, 1024]), "'prompt'"),
    ("prompt-id-huge", _with(prompt=[1, 2**63]), "'prompt'"),
    ("prompt-dict", _with(prompt={"ids": [1]}), "'prompt'"),
    ("prompt-too-long", _with(prompt=[1] * 5000), "'prompt'"),
    ("max_tokens-zero", _with(max_tokens=0), "'max_tokens'"),
    ("max_tokens-negative", _with(max_tokens=-1), "'max_tokens'"),
    ("max_tokens-huge", _with(max_tokens=10**12), "'max_tokens'"),
    ("max_tokens-over-limit", _with(max_tokens=65), "'max_tokens'"),
    ("max_tokens-float", _with(max_tokens=2.5), "'max_tokens'"),
    ("max_tokens-string", _with(max_tokens="16"), "'max_tokens'"),
    ("max_tokens-bool", _with(max_tokens=True), "'max_tokens'"),
    ("max_tokens-nan", _with(max_tokens=math.nan), "'max_tokens'"),
    ("max_tokens-list", _with(max_tokens=[2]), "'max_tokens'"),
    ("temperature-negative", _with(temperature=-1), "'temperature'"),
    ("temperature-nan", _with(temperature=math.nan), "'temperature'"),
    ("temperature-inf", _with(temperature=math.inf), "'temperature'"),
    ("temperature-string", _with(temperature="0.7"), "'temperature'"),
    ("temperature-bool", _with(temperature=True), "'temperature'"),
    ("top_p-zero", _with(top_p=0), "'top_p'"),
    ("top_p-over-one", _with(top_p=1.5), "'top_p'"),
    ("top_p-negative", _with(top_p=-0.5), "'top_p'"),
    ("top_p-nan", _with(top_p=math.nan), "'top_p'"),
    ("top_p-string", _with(top_p="1"), "'top_p'"),
    ("top_k-minus-two", _with(top_k=-2), "top_k"),
    ("top_k-float", _with(top_k=2.5), "'top_k'"),
    ("top_k-string", _with(top_k="5"), "'top_k'"),
    ("top_k-bool", _with(top_k=True), "'top_k'"),
    ("seed-huge", _with(seed=2**64), "'seed'"),
    ("seed-float", _with(seed=1.5), "'seed'"),
    ("seed-string", _with(seed="1"), "'seed'"),
    ("seed-bool", _with(seed=True), "'seed'"),
    ("stop_token_ids-int", _with(stop_token_ids=5), "'stop_token_ids'"),
    ("stop_token_ids-negative", _with(stop_token_ids=[-1]), "'stop_token_ids'"),
    ("stop_token_ids-strings", _with(stop_token_ids=["a"]), "'stop_token_ids'"),
    ("stop_token_ids-dict", _with(stop_token_ids={"a": 1}), "'stop_token_ids'"),
    ("logprobs-two", _with(logprobs=2), "'logprobs'"),
    ("logprobs-negative", _with(logprobs=-1), "'logprobs'"),
    ("logprobs-string", _with(logprobs="1"), "'logprobs'"),
    ("logprobs-true", _with(logprobs=True), "'logprobs'"),
    ("logprobs-float", _with(logprobs=1.0), "'logprobs'"),
    ("stream-true", _with(stream=True), "'stream'"),
    ("echo-true", _with(echo=True), "'echo'"),
    ("n-two", _with(n=2), "'n'"),
    ("best_of-three", _with(best_of=3), "'best_of'"),
    ("suffix-text", _with(suffix="x"), "'suffix'"),
    ("stop-string", _with(stop="\n"), "'stop'"),
    ("stop-list", _with(stop=["a"]), "'stop'"),
    ("return-token-ids-string", _with(return_tokens_as_token_ids="yes"), "'return_tokens_as_token_ids'"),
]


def _exchange(ws: Workspace, data: bytes) -> HttpReply:
    """Send raw bytes to the running server; the status and the error message of its reply."""
    port = int(ws.fixtures.server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer and close before reading everything
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
    reply = b"".join(chunks)
    if not reply:
        return HttpReply(599, "no reply")
    if reply.startswith(b"HTTP/"):
        head, _, body = reply.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
    else:  # an HTTP/0.9 request ("hello") gets a reply without a status line: the body alone
        head, body = b"", reply
        status = 400 if b'"error"' in body else 599
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace") or head.decode(errors="replace")
    return HttpReply(status, message)


def _post(
    body: bytes, path: str = "/v1/completions", headers: str | None = None, method: str = "POST"
) -> bytes:
    if headers is None:
        headers = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode() + body


GOOD_BYTES = json.dumps(GOOD).encode()
RAW: list[tuple[str, bytes, str]] = [
    ("json-invalid", _post(b"{not json"), "invalid JSON"),
    ("json-empty-body", _post(b""), "invalid JSON"),
    ("json-nan-literal", _post(b'{"prompt": [1], "temperature": NaN}'), "NaN"),
    ("json-infinity-literal", _post(b'{"prompt": [1], "top_p": Infinity}'), "Infinity"),
    ("json-huge-exponent", _post(b'{"prompt": [1], "temperature": 1e999}'), "'temperature'"),
    ("json-deep-nesting", _post(b"[" * 100_000 + b"]" * 100_000), "invalid JSON"),
    ("json-not-utf8", _post(b'{"prompt": [1], "model": "\xff"}'), "invalid JSON"),
    ("json-huge-int", _post(b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}"), "invalid JSON"),
    ("content-length-missing", _post(GOOD_BYTES, headers="Accept: */*\r\n"), "Content-Length"),
    ("content-length-negative", _post(GOOD_BYTES, headers="Content-Length: -1\r\n"), "Content-Length"),
    ("content-length-text", _post(GOOD_BYTES, headers="Content-Length: ten\r\n"), "Content-Length"),
    ("content-length-twice", _post(GOOD_BYTES, headers="Content-Length: 5\r\nContent-Length: 6\r\n"),
     "Content-Length"),
    ("content-length-huge", _post(b"{}", headers=f"Content-Length: {2**40}\r\n"), "bytes"),
    ("content-length-over-body", _post(GOOD_BYTES, headers=f"Content-Length: {len(GOOD_BYTES) + 50}\r\n"),
     "request body ended"),
    ("content-length-plus-sign", _post(GOOD_BYTES, headers=f"Content-Length: +{len(GOOD_BYTES)}\r\n"),
     "Content-Length"),
    ("path-unknown", _post(GOOD_BYTES, path="/v1/chat/completions"), "/v1/chat/completions"),
    ("path-traversal", _post(GOOD_BYTES, path="/../../etc/passwd"), "/../../etc/passwd"),
    ("get-unknown", _post(b"", path="/admin", headers="", method="GET"), "/admin"),
    ("method-put", _post(GOOD_BYTES, method="PUT"), "PUT"),
    ("method-delete", _post(b"", headers="", method="DELETE"), "DELETE"),
    ("method-garbage", b"\x00\x01\x02 / HTTP/1.1\r\n\r\n", "method"),
    ("request-line-garbage", b"hello\r\n\r\n", "request"),
    ("http-version-bad", b"POST /v1/completions HTTP/9.9\r\nContent-Length: 2\r\n\r\n{}", "HTTP"),
    ("header-too-long", b"GET /v1/models HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", "headers"),
    ("headers-too-many", b"GET /v1/models HTTP/1.1\r\n" + b"X: a\r\n" * 200 + b"\r\n", "headers"),
]  # fmt: skip


def cases() -> list[Case]:
    out = [
        Case(CATEGORY, f"body/{name}", lambda ws, b=body: _complete(ws, b), (want,), needs=("engine",))
        for name, body, want in BODIES
    ]
    out += [
        Case(CATEGORY, f"http/{name}", lambda ws, d=data: _exchange(ws, d), (want,), needs=("loopback",))
        for name, data, want in RAW
    ]
    return out
