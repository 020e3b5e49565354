"""Sizes: inputs whose every field is valid alone but which ask the machine for too much, and the values that
used to slip through checks of model files and ``mars score``.

- a graph and config whose product asks for too many samples per problem or per step, or inference-loop calls
  per problem (``agents/graph_size.py``), and the counts of a graph file or config that are absurd alone
  (``inputs``, ``max_calls``, ``max_iterations``, a 20,000-position chain, ``group_size``,
  ``problems_per_step``, workers): refused before anything starts, naming the figure and the fields;
- more rollout and reward workers than a single machine's cores carry (``check_this_machine``);
- ``mars score --micro-batch`` 0 or -3 (refused at the flag), a token line longer than the model's
  ``max_position_embeddings``;
- ``mars convert hf-to-mcore`` of a folder holding an all-NaN tensor (refused naming the file and tensor,
  nothing written);
- the OpenAI server under 500 idle half-sent requests, and its client given a 300 MiB reply (category
  ``server requests``, built here).
"""

from __future__ import annotations

import json
import time
from typing import Any

from tests.bad_inputs.harness import Case, HttpReply, Workspace, mars_main

CATEGORY = "sizes"


def _graph_for(ws: Workspace, *overrides: str) -> Any:
    from mars_megatron.agents.graph_file import graph_for
    from mars_megatron.config import load_config

    return graph_for(load_config(None, list(overrides)))


def _graph_file(ws: Workspace, trajectory: list[dict[str, Any]], **extra: Any) -> str:
    """A copy of the shipped marsrl graph with ``trajectory`` (and ``loop``/``roles`` keys) replaced."""
    import shutil

    import yaml

    from mars_megatron.agents.graph import SHIPPED

    folder = ws.path("graph")
    shutil.copytree(SHIPPED / "marsrl", folder)
    data = yaml.safe_load((folder / "graph.yaml").read_text())
    del data["trajectory"]
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    # one flow mapping a line: a 20,000-position file is written in milliseconds (safe_dump takes seconds)
    lines = "".join(f"  - {json.dumps(p)}\n" for p in trajectory)
    (folder / "graph.yaml").write_text(yaml.safe_dump(data, sort_keys=False) + "trajectory:\n" + lines)
    return str(folder / "graph.yaml")


def _chain(n: int, inputs: Any = "all") -> list[dict[str, Any]]:
    """solver, then ``n - 1`` verifier/corrector positions each taking ``inputs`` of the one before."""
    out: list[dict[str, Any]] = [{"name": "p0", "role": "solver"}]
    for i in range(1, n):
        role = "verifier" if i % 2 else "corrector"
        out.append({"name": f"p{i}", "role": role, "input": f"p{i - 1}", "inputs": inputs})
    return out


def _tool_graph(ws: Workspace, max_calls: int, max_iterations: int = 10) -> str:
    import shutil

    import yaml

    from mars_megatron.agents.graph import SHIPPED

    folder = ws.path("graph")
    shutil.copytree(SHIPPED / "tool_pair", folder)
    data = yaml.safe_load((folder / "graph.yaml").read_text())
    for role in data["roles"].values():
        if "tool" in role:
            role["tool"]["max_calls"] = max_calls
    data["loop"]["max_iterations"] = max_iterations
    (folder / "graph.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return str(folder / "graph.yaml")


def _workers_on_this_machine(ws: Workspace, *overrides: str) -> Any:
    from mars_megatron.config import load_config
    from mars_megatron.pipeline.trainer import check_workers_fit

    cfg = load_config(None, list(overrides))
    return check_workers_fit(cfg, 1, 2)  # a 2-core machine, as CI's


def _score(ws: Workspace, *flags: str, tokens: list[int] | None = None) -> Any:
    line = {"tokens": tokens or [1, 2, 3]}
    data = ws.write("t.jsonl", json.dumps(line) + "\n")
    out = ws.path("out.jsonl")
    return mars_main("score", "--model-dir", ws.fixtures.hf_dense, "--input", data, "--output", out, *flags)


def _nan_model(ws: Workspace) -> Any:
    """The tiny model with one tensor all NaN, converted: refused, and nothing written at the output."""
    import torch
    from safetensors.torch import load_file, save_file

    src = ws.copy("hf_dense", "nan")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = src / index[name]
    tensors = load_file(shard)
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, shard, metadata={"format": "pt"})
    run = mars_main("convert", "hf-to-mcore", src, ws.path("out"))
    if ws.path("out").exists():
        raise AssertionError("the output was written")
    return run


def _flood(ws: Workspace) -> HttpReply:
    """500 connections send half a request line and idle; a well-formed request is then sent. Its status
    is returned when it is not served within 3 s (starved: 503, or 599 for no answer); when it is served,
    the fate of the oldest idle connection (closed by the server) is the refusal this case judges."""
    from tests.bad_inputs.server import GOOD_BYTES, _exchange, _post
    from tests.test_rollout_openai import half_sent_requests

    port = int(ws.fixtures.server.url.rsplit(":", 1)[1])
    with half_sent_requests(port, 500) as idle:
        start = time.monotonic()
        reply = _exchange(ws, _post(GOOD_BYTES))
        took = time.monotonic() - start
        if reply.status != 200 or took > 3:
            return HttpReply(
                reply.status if reply.status != 200 else 599, f"after {took:.1f} s: {reply.message}"
            )
        idle[0].settimeout(5)
        try:
            left = idle[0].recv(65536)
        except ConnectionResetError:
            left = b""
        if left not in (b"",) and not left.startswith(b"HTTP/1.0 503"):
            return HttpReply(200, f"the oldest idle connection got {left[:60]!r}")
        return HttpReply(408, f"served in {took:.2f} s; the idle half-sent requests were closed")


def _huge_reply(ws: Workspace) -> Any:
    """The client against a server answering 300 MiB: refused naming the URL and the limit."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from mars_megatron.rollout.engine import GenerationRequest, SamplingParams
    from mars_megatron.rollout.openai_engine import OpenAIEngine

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(300 * 2**20))
            self.end_headers()
            try:
                for _ in range(300):
                    self.wfile.write(b"0" * 2**20)
            except OSError:
                pass

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        request = GenerationRequest("x", (1, 2), SamplingParams(max_tokens=2))
        return OpenAIEngine(url, "m", max_retries=0).generate([request])
    finally:
        httpd.shutdown()
        httpd.server_close()


def cases() -> list[Case]:
    from mars_megatron.rollout.openai_engine import EngineError

    out: list[Case] = []

    def add(name: str, feed: Any, *names: str, **kw: Any) -> None:
        out.append(Case(CATEGORY, name, feed, names, **kw))

    # the product: samples per problem, per step, loop calls
    add(
        "graph/fan-out-4^13",
        lambda ws: _graph_for(ws, f"agents.graph={_graph_file(ws, _chain(13))}", "agents.group_size=4"),
        "agents.group_size",
        "65,536 samples per problem",
    )
    add(
        "config/problems-per-step-x-fan-out",
        lambda ws: _graph_for(ws, "data.problems_per_step=100000"),
        "data.problems_per_step=100,000",
        "7,200,000 samples per step",
        "4,194,304",
    )
    add(
        "graph/loop-calls",
        lambda ws: _graph_for(ws, f"agents.graph={_tool_graph(ws, 100, 1000)}"),
        "loop.max_iterations",
        "agent calls per problem",
        "100,000",
    )
    add(
        "config/evaluation-loop-calls",
        lambda ws: _graph_for(ws, f"agents.graph={_tool_graph(ws, 10)}", "evaluation.max_iterations=10000"),
        "evaluation.max_iterations",
        "420,084 agent calls per problem",
    )
    # counts absurd alone: a graph file's
    add(
        "graph/inputs-10^12",
        lambda ws: _graph_for(
            ws,
            "agents.graph="
            + _graph_file(
                ws,
                [
                    {"name": "s", "role": "solver"},
                    {"name": "v", "role": "verifier", "input": "s", "inputs": 10**12},
                ],
            ),
        ),
        "trajectory[1].inputs",
        "graph.yaml",
    )
    add(
        "graph/300-positions",
        lambda ws: _graph_for(ws, f"agents.graph={_graph_file(ws, _chain(300, 1))}"),
        "trajectory",
        "300 positions",
        "graph.yaml",
    )
    add(
        "graph/20000-positions",
        lambda ws: _graph_for(ws, f"agents.graph={_graph_file(ws, _chain(20_000, 1))}"),
        "graph.yaml",
        "262,144",
    )
    add(
        "graph/tool-max-calls-10^12",
        lambda ws: _graph_for(ws, f"agents.graph={_tool_graph(ws, 10**12)}"),
        "max_calls",
        "graph.yaml",
    )
    add(
        "graph/loop-max-iterations-10^30",
        lambda ws: _graph_for(
            ws, "agents.graph=" + _graph_file(ws, _chain(5, 2), loop={"max_iterations": 10**30})
        ),
        "loop.max_iterations",
        "graph.yaml",
    )
    # ... and a config's
    for field, value in (
        ("agents.group_size", 10**9),
        ("data.problems_per_step", 10**9),
        ("pipeline.rollout_workers", 10**5),
        ("pipeline.reward_workers", 10**5),
        ("evaluation.max_iterations", 10**30),
        ("agents.inputs_per_agent", 10**12),
    ):
        add(f"config/{field}={value:.0e}", lambda ws, o=f"{field}={value}": _graph_for(ws, o), field)
    add(
        "machine/rollout-workers-over-cores",
        lambda ws: _workers_on_this_machine(ws, "pipeline.rollout_workers=2000"),
        "pipeline.rollout_workers",
        "2,001 worker processes",
    )
    # mars score, mars convert
    for value in ("0", "-3"):
        add(
            f"score/micro-batch={value}",
            lambda ws, v=value: _score(ws, "--micro-batch", v),
            "--micro-batch",
            needs=("hf_dense",),
        )
    add(
        "score/longer-than-max-positions",
        lambda ws: _score(ws, tokens=[1] * 4097),
        "t.jsonl:1",
        "4097 tokens",
        "max_position_embeddings 4096",
        needs=("hf_dense",),
    )
    add(
        "convert/all-nan-tensor",
        _nan_model,
        "model.layers.0.self_attn.q_proj.weight",
        ".safetensors",
        "--allow-nonfinite",
        needs=("hf_dense",),
    )
    # the OpenAI server and its client
    out.append(
        Case(
            "server requests",
            "flood/500-idle-half-sent-requests",
            _flood,
            ("closed",),
            needs=("loopback", "engine"),
        )
    )
    out.append(
        Case(
            "server requests",
            "client/300-MiB-response",
            _huge_reply,
            ("http://127.0.0.1:", "67,108,864 bytes", "max_response_bytes"),
            errors=(EngineError,),
            needs=("loopback",),
        )
    )
    return out
