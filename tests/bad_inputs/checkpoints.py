"""Checkpoints: what ``mars train --resume``, ``mars eval --checkpoint`` and the policy loaders read from
a training checkpoint: ``trainer_state.json``, the ``latest`` pointer, every ``torch.save`` file (the
schedule's ``pipeline_state.pt``, per-rank RNG states), a dist checkpoint's ``.metadata`` pickle and
``mars_checkpoint.json``. Crafted pickles try to create the canary file when loaded."""

from __future__ import annotations

import json
import pickle
import zipfile
from typing import Any

from tests.bad_inputs.harness import Case, Workspace
from tests.bad_inputs.model_files import _Evil

CATEGORY = "checkpoints"


def _step(ws: Workspace, state: bytes | None) -> Any:
    step = ws.path("ckpt/step_000003")
    step.mkdir(parents=True)
    if state is not None:
        (step / "trainer_state.json").write_bytes(state)
    return step


def _load_state(ws: Workspace, state: bytes | None) -> Any:
    from mars_megatron.checkpoint.store import CheckpointStore

    return CheckpointStore.load_state(_step(ws, state))


def _eval_checkpoint(ws: Workspace, state: bytes | None) -> Any:
    """``mars eval --checkpoint``'s reading of the step folder (which policy answers each role of the
    default graph)."""
    from mars_megatron.agents.graph_file import load_graph
    from mars_megatron.config import AgentsConfig
    from mars_megatron.evaluation.policies import checkpoint_policies

    return checkpoint_policies(_step(ws, state), load_graph(AgentsConfig().graph))


def _resolve(ws: Workspace, resume: Any) -> Any:
    from mars_megatron.checkpoint.store import CheckpointStore

    root = ws.path("ckpt")
    root.mkdir(exist_ok=True)
    return CheckpointStore(root, keep_last=2).resolve(resume(ws) if callable(resume) else resume)


def _pickled(ws: Workspace, name: str, data: Any) -> Any:
    """``load_plain`` (the schedule's pipeline_state.pt, and every torch.save file resume reads)."""
    from mars_megatron.checkpoint.safe_load import load_plain

    path = ws.path(name)
    path.write_bytes(data(ws) if callable(data) else data)
    return load_plain(path)


def _torch_zip(ws: Workspace, payload: bytes) -> bytes:
    """A torch.save zip archive whose data.pkl is ``payload``."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"step": 1}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = payload if item.filename.endswith("data.pkl") else src.read(item)
            dst.writestr(item, data)
    return out.getvalue()


def _evil(ws: Workspace) -> bytes:
    return pickle.dumps(_Evil(ws.marker))


def _metadata(ws: Workspace, data: Any) -> Any:
    from mars_megatron.checkpoint.dist_metadata import read_metadata

    d = ws.path("dist")
    d.mkdir()
    (d / ".metadata").write_bytes(data(ws) if callable(data) else data)
    return read_metadata(d)


def _good_rng() -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"torch": torch.get_rng_state()}, buf)
    return buf.getvalue()


STATE_FILES: list[tuple[str, bytes | None, tuple[str, ...]]] = [
    ("missing", None, ("trainer_state.json",)),
    ("empty", b"", ("trainer_state.json",)),
    ("not-json", b"{step: 3}", ("trainer_state.json",)),
    ("array", b"[1, 2]", ("trainer_state.json", "format")),
    ("null", b"null", ("trainer_state.json",)),
    ("wrong-format", json.dumps({"format": "x", "state": {}}).encode(), ("trainer_state.json", "format")),
    ("no-state", json.dumps({"format": "mars-trainer-state-v1"}).encode(), ("trainer_state.json", "state")),
    ("state-list", json.dumps({"format": "mars-trainer-state-v1", "state": []}).encode(), ("state",)),
    ("non-utf8", b'{"format": "\xff"}', ("trainer_state.json",)),
    ("deep-nesting", b"[" * 100_000 + b"]" * 100_000, ("trainer_state.json",)),
    ("huge-int", b'{"format": ' + b"9" * 5000 + b"}", ("trainer_state.json",)),
    ("binary", bytes(range(256)), ("trainer_state.json",)),
]
POLICY_STATES: list[tuple[str, Any, tuple[str, ...]]] = [
    ("no-policies", {}, ("policies",)),
    ("policies-string", {"policies": "shared"}, ("policies",)),
    ("policies-unknown", {"policies": ["judge"]}, ("policies",)),
    ("policies-traversal", {"policies": ["../../etc"]}, ("policies",)),
    ("policies-null", {"policies": None}, ("policies",)),
    ("policy-folder-missing", {"policies": ["shared"]}, ("shared",)),
]


def cases() -> list[Case]:
    out: list[Case] = []

    def add(name: str, feed: Any, *names: str, **kw: Any) -> None:
        out.append(Case(CATEGORY, name, feed, names, **kw))

    for name, data, names in STATE_FILES:
        add(f"trainer_state/{name}", lambda ws, d=data: _load_state(ws, d), *names)
        add(f"eval-checkpoint/{name}", lambda ws, d=data: _eval_checkpoint(ws, d), *names)
    for name, state, names in POLICY_STATES:
        raw = json.dumps({"format": "mars-trainer-state-v1", "step": 3, "state": state}).encode()
        add(f"eval-checkpoint/{name}", lambda ws, r=raw: _eval_checkpoint(ws, r), "--checkpoint", *names)
    for name, resume, names in (
        ("missing-path", lambda ws: ws.path("nope"), ("nope",)),
        ("file", lambda ws: ws.write("f", "x"), ("{ws}/f",)),
        ("incomplete", lambda ws: _step(ws, None), ("step_000003", "trainer_state.json")),
        ("traversal", "../../../etc", ("../../../etc",)),
    ):
        add(f"resume/{name}", lambda ws, r=resume: _resolve(ws, r), *names)
    evil_names = ("pipeline_state.pt",)
    for name, data, owner in (
        ("raw-pickle-reduce", _evil, None),
        ("zip-pickle-reduce", lambda ws: _torch_zip(ws, _evil(ws)), None),
        ("zip-pickle-global", lambda ws: _torch_zip(ws, b"cos\nsystem\n(S'touch PWNED'\ntR."), None),
        ("zip-pickle-builtins-eval", lambda ws: _torch_zip(ws, b"c__builtin__\neval\n(S'1'\ntR."), None),
        ("object-array", lambda ws: _object_array(), None),
        ("empty", b"", None),
        ("truncated", lambda ws: _good_rng()[:100], None),
        ("garbage", bytes(range(256)) * 8, None),
        ("not-a-zip-text", b"hello", None),
        ("zip-without-data", lambda ws: _empty_zip(), None),
    ):
        add(
            f"torch-save/{name}",
            lambda ws, d=data: _pickled(ws, "pipeline_state.pt", d),
            *evil_names,
            owner=owner,
        )
    for name, data in (
        ("pickle-reduce", _evil),
        ("pickle-global-os-system", b"cos\nsystem\n(S'touch PWNED'\ntR."),
        ("pickle-dict", pickle.dumps({"a": 1})),
        ("pickle-torch-tensor", lambda ws: _torch_tensor_pickle()),
        ("empty", b""),
        ("garbage", b"\x80\x05garbage"),
        ("truncated", lambda ws: pickle.dumps(list(range(1000)))[:50]),
    ):
        add(f"dist-metadata/{name}", lambda ws, d=data: _metadata(ws, d), "{ws}/dist/.metadata")
    return out


def _object_array() -> bytes:
    import io

    import numpy as np
    import torch

    buf = io.BytesIO()
    torch.save({"a": np.array([{"x": 1}], dtype=object)}, buf)
    return buf.getvalue()


def _empty_zip() -> bytes:
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/version", "3")
    return buf.getvalue()


def _torch_tensor_pickle() -> bytes:
    import torch

    return pickle.dumps(torch.zeros(2))
