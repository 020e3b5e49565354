"""The files a task brings, tried as a hostile user would: graph files and configs that hang or mislead
a parser (an alias bomb, UTF-16, bytes that are not UTF-8, a key given twice), prompt files that resolve
outside their folder or are huge, names that become paths (roles, policies, prompt sets, the graph),
output folders that are system folders, checkpoint step folders that are symlinks and a resealed
checkpoint whose weights point at another checkpoint. Each is refused naming the file and field."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from tests.bad_inputs.harness import Case, Workspace, mars_main

REPO = Path(__file__).resolve().parents[2]
MARSRL = REPO / "mars_megatron" / "agents" / "graphs" / "marsrl"
BOMB = "\n".join(
    ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
) + "\n"  # fmt: skip
"""Nine levels of nine aliases: 9^9 values in about 400 bytes."""
FLOW_BOMB = "[&a0 [" + ", ".join(["lol"] * 9) + "], " + ", ".join(
    f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)
) + "]"  # fmt: skip
"""The same in one line of flow style, as an override value."""


def _fast(feed: Any, limit_s: float = 10.0) -> Any:
    """``feed`` must answer within ``limit_s`` (a parser that walks an alias bomb would not): an
    AssertionError (a traceback outcome) otherwise."""

    def run(ws: Workspace) -> Any:
        start = time.monotonic()
        try:
            return feed(ws)
        finally:
            took = time.monotonic() - start
            assert took < limit_s, f"took {took:.1f} s"

    return run


def _graph(ws: Workspace, edit: Any = None, text: str | None = None) -> Path:
    """A copy of the shipped MarsRL graph; ``edit(folder)`` changes it, ``text`` replaces graph.yaml."""
    folder = ws.path("graph")
    shutil.copytree(MARSRL, folder)
    if text is not None:
        (folder / "graph.yaml").write_text(text)
    if edit is not None:
        edit(folder)
    return folder / "graph.yaml"


def _load(path: Path) -> Any:
    from mars_megatron.agents.graph_file import load_graph

    return load_graph(str(path))


def _replace(old: str, new: str) -> Any:
    def edit(folder: Path) -> None:
        path = folder / "graph.yaml"
        text = path.read_text()
        assert old in text, old
        path.write_text(text.replace(old, new, 1))

    return edit


def _write(data: bytes) -> Any:
    def edit(folder: Path) -> None:
        (folder / "graph.yaml").write_bytes(data)

    return edit


def _link_prompt(target: str) -> Any:
    def edit(folder: Path) -> None:
        prompt = folder / "prompts" / "compact" / "solver.txt"
        prompt.unlink()
        prompt.symlink_to(target if target.startswith("/") else "../" + target)

    return edit


def _big_prompt(folder: Path) -> None:
    prompt = folder / "prompts" / "compact" / "solver.txt"
    with prompt.open("wb") as f:
        f.truncate(100 * 2**20)  # 100 MB (sparse: nothing written)


def _bytes_prompt(data: bytes) -> Any:
    def edit(folder: Path) -> None:
        (folder / "prompts" / "compact" / "solver.txt").write_bytes(data)

    return edit


def _prompt_folder_link(folder: Path) -> None:
    prompts = folder / "prompts" / "compact"
    shutil.rmtree(prompts)
    prompts.symlink_to("/usr/share")


def _config_file(ws: Workspace, data: bytes) -> Any:
    from mars_megatron.config import load_config

    return load_config(ws.write("run.yaml", data), [])


def _config(*overrides: str) -> Any:
    from mars_megatron.config import load_config

    return load_config(None, list(overrides))


def _steps(ws: Workspace) -> Path:
    from mars_megatron.checkpoint.store import STATE_FORMAT

    root = ws.path("ckpt")
    step = root / "step_000001"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"format": STATE_FORMAT, "step": 1, "state": {}}))
    (root / "step_000002").symlink_to(step)
    return root


def _resume(ws: Workspace, which: Any) -> Any:
    from mars_megatron.checkpoint.store import CheckpointStore

    root = _steps(ws)
    return CheckpointStore(root, keep_last=2).resolve(which(root) if callable(which) else which)


def _weights_elsewhere(ws: Workspace, weights: str) -> Any:
    from mars_megatron.checkpoint.manifest import seal
    from mars_megatron.checkpoint.model_meta import META, read_meta

    mine, other = ws.copy("mcore", "mine"), ws.copy("mcore", "other")
    meta = json.loads((mine / META).read_text())
    meta["weights"] = weights.replace("OTHER", str(other))
    (mine / META).write_text(json.dumps(meta))
    seal(mine)  # the manifest matches: only the field can tell
    return read_meta(mine)


def cases() -> list[Case]:
    out: list[Case] = []

    def add(name: str, feed: Any, *names: str, **kw: Any) -> None:
        out.append(Case("task files", name, feed, names, **kw))

    # parsers
    add("graph/alias-bomb", _fast(lambda ws: _load(_graph(ws, text=BOMB))), "{ws}/graph/graph.yaml", "alias")
    add("config/alias-bomb", _fast(lambda ws: _config_file(ws, BOMB.encode())), "{ws}/run.yaml", "alias")
    add("override/alias-bomb", _fast(lambda ws: _config(f"agents.strategy={FLOW_BOMB}")), "agents.strategy")
    for name, data, why in [
        ("utf16", "name: x\n".encode("utf-16"), "UTF-16"),
        ("utf16-no-bom", "name: x\n".encode("utf-16-le"), "UTF-16"),
        ("utf32", "name: x\n".encode("utf-32"), "UTF-32"),
        ("latin1", "name: caf\u00e9\n".encode("latin-1"), "not UTF-8"),
        ("binary", bytes(range(256)), "UTF"),
    ]:
        add(f"graph/{name}", lambda ws, d=data: _load(_graph(ws, _write(d))),
            "{ws}/graph/graph.yaml", why)  # fmt: skip
        add(f"config/{name}", lambda ws, d=data: _config_file(ws, d), "{ws}/run.yaml", why)
    add(
        "config/over-1-MiB",
        lambda ws: _config_file(ws, b"# " + b"x" * (2**20) + b"\n"),
        "{ws}/run.yaml",
        "bytes",
    )
    add("graph/duplicate-loop-step",
        lambda ws: _load(_graph(ws, _replace("  steps:\n", "  steps:\n    verify: {role: solver}\n"))),
        "{ws}/graph/graph.yaml", "duplicate key 'verify'")  # fmt: skip
    add("graph/duplicate-role",
        lambda ws: _load(_graph(ws, _replace("roles:\n", "roles:\n  solver: {output: solution}\n"))),
        "{ws}/graph/graph.yaml", "duplicate key 'solver'")  # fmt: skip
    # prompt files
    for name, target in (("etc-passwd", "/etc/passwd"), ("proc-environ", "/proc/self/environ"),
                         ("graph-file", "../graph.yaml")):  # fmt: skip
        add(f"prompt/symlink-to-{name}", lambda ws, t=target: _load(_graph(ws, _link_prompt(t))),
            "{ws}/graph/graph.yaml", "outside its prompt folder")  # fmt: skip
    add("prompt/folder-symlink-out", lambda ws: _load(_graph(ws, _prompt_folder_link)),
        "{ws}/graph/graph.yaml", "outside the graph file's folder")  # fmt: skip
    add(
        "prompt/100-MB", _fast(lambda ws: _load(_graph(ws, _big_prompt))), "{ws}/graph/graph.yaml", "1024 KiB"
    )
    add("prompt/not-utf8", lambda ws: _load(_graph(ws, _bytes_prompt(b"caf\xe9 {problem}"))),
        "{ws}/graph/graph.yaml", "not UTF-8")  # fmt: skip
    add("prompt/utf16", lambda ws: _load(_graph(ws, _bytes_prompt("{problem}".encode("utf-16")))),
        "{ws}/graph/graph.yaml", "UTF-16")  # fmt: skip
    # names that become paths
    for name, bad in [("traversal", "'../../x'"), ("absolute", "/tmp/x"), ("empty", "''"),
                      ("newline", '"a\\nb"'), ("dot-dot", "'..'"), ("space", "'a b'"),
                      ("too-long", "a" * 65)]:  # fmt: skip
        add(f"names/role-{name}", lambda ws, b=bad: _load(_graph(ws, _replace("  solver:", f"  {b}:"))),
            "{ws}/graph/graph.yaml", "roles.", "not a name")  # fmt: skip
        add(f"names/policy-{name}",
            lambda ws, b=bad: _load(_graph(ws, _replace("  shared: [solver", f"  {b}: [solver"))),
            "{ws}/graph/graph.yaml", "policies.", "not a name")  # fmt: skip
    add("names/graph-name", lambda ws: _load(_graph(ws, _replace("name: marsrl", "name: ../../x"))),
        "{ws}/graph/graph.yaml", "name", "not a name")  # fmt: skip
    add("names/prompt-set",
        lambda ws: _load(_graph(ws, _replace("  marsrl: prompts/marsrl", "  '../x': prompts/marsrl"))),
        "{ws}/graph/graph.yaml", "prompts")  # fmt: skip
    # output places
    for name, override, field in [
        ("run-dir-root", "logging.run_dir=/", "logging.run_dir"),
        ("run-dir-etc", "logging.run_dir=/etc", "logging.run_dir"),
        ("run-dir-dotdot-etc", "logging.run_dir=/tmp/../etc/mars", "logging.run_dir"),
        ("run-dir-usr-inside", "logging.run_dir=/usr/lib/mars", "logging.run_dir"),
        ("run-dir-proc", "logging.run_dir=/proc/self", "logging.run_dir"),
        ("save-dir-root", "checkpoint.save_dir=/", "checkpoint.save_dir"),
        ("save-dir-boot", "checkpoint.save_dir=/boot", "checkpoint.save_dir"),
        ("run-dir-home", "logging.run_dir=~", "logging.run_dir"),
    ]:
        add(f"outputs/{name}", lambda ws, o=override: _config(o), field)
    add("outputs/run-dir-symlink-to-etc",
        lambda ws: (ws.path("link").symlink_to("/etc"), _config(f"logging.run_dir={ws.path('link')}"))[-1],
        "logging.run_dir", "/etc")  # fmt: skip
    add("outputs/eval-out-root", lambda ws: mars_main(
        "eval", "--data", ws.fixtures.eval_data, "--model", ws.fixtures.hf_dense, "--engine", "openai",
        "--endpoint", "http://127.0.0.1:9", "--samples", "1", "--out", "/"), "--out", "root",
        needs=("hf_dense",))  # fmt: skip
    add("outputs/convert-into-etc",
        lambda ws: mars_main("convert", "hf-to-mcore", ws.fixtures.hf_dense, "/etc/mars-x"),
        "/etc", needs=("hf_dense",))  # fmt: skip
    add("outputs/init-model-root", lambda ws: mars_main("init-model", "--preset", "tiny-dense", "--out", "/"),
        "--out", "root")  # fmt: skip
    # checkpoints
    add("checkpoint/step-symlink-latest", lambda ws: _resume(ws, True), "{ws}/ckpt/step_000002", "symlink")
    add("checkpoint/step-symlink-by-path", lambda ws: _resume(ws, lambda root: root / "step_000002"),
        "{ws}/ckpt/step_000002", "symlink")  # fmt: skip
    add("checkpoint/weights-in-another-checkpoint", lambda ws: _weights_elsewhere(ws, "../other/model"),
        "{ws}/mine/mars_checkpoint.json", "weights", needs=("mcore",))  # fmt: skip
    add("checkpoint/weights-absolute", lambda ws: _weights_elsewhere(ws, "OTHER/model"),
        "{ws}/mine/mars_checkpoint.json", "weights", needs=("mcore",))  # fmt: skip
    return out
