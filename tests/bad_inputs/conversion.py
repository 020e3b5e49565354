"""Conversion inputs: ``mars convert hf-to-mcore SRC DST`` and ``mars convert mcore-to-hf SRC DST`` through
``mars_megatron.cli.main`` in-process. Every source is checked in the launching process before a rank
starts; an existing DST is never touched (``preserve``)."""

from __future__ import annotations

import functools
import json
from typing import Any

from tests.bad_inputs.harness import Case, Workspace, mars, mars_main

CATEGORY = "conversion"
SHARD = "model-00004-of-00007.safetensors"


def _convert(ws: Workspace, direction: str, src: Any, dst: Any = None, *flags: str) -> Any:
    """``mars convert DIRECTION SRC DST FLAGS``; SRC/DST may be functions of the workspace."""
    src = src(ws) if callable(src) else src
    dst = dst(ws) if callable(dst) else (dst or ws.path("out"))
    return mars_main("convert", direction, src, dst, *flags)


def _hf(edit: Any = None) -> Any:
    def make(ws: Workspace) -> Any:
        model = ws.copy("hf_dense", "m")
        if edit is not None:
            edit(model)
        return model

    return make


def _meta(content: bytes | None) -> Any:
    """A folder that claims to be a mars checkpoint with this mars_checkpoint.json."""

    def make(ws: Workspace) -> Any:
        src = ws.path("ck")
        (src / "hf").mkdir(parents=True)
        (src / "model").mkdir()
        if content is not None:
            (src / "mars_checkpoint.json").write_bytes(content)
        return src

    return make


def _existing_out(ws: Workspace) -> Any:
    out = ws.path("out")
    out.mkdir()
    (out / "keep.txt").write_text("results of an earlier conversion")
    return out


def _shard_gb(ws: Workspace, value: str) -> Any:
    return _convert(ws, "mcore-to-hf", _meta(b"{}"), None, "--max-shard-gb", value)


GOOD_META = {"format": "mars-mcore-v1", "arch": {}, "dtype": "float32", "vocab_pad_multiple": 128}


def cases() -> list[Case]:
    out: list[Case] = []

    def add(name: str, feed: Any, *names: str, **kw: Any) -> None:
        out.append(Case(CATEGORY, name, feed, names, needs=("hf_dense",), **kw))

    for direction in ("hf-to-mcore", "mcore-to-hf"):
        d = direction
        add(f"{d}/src-missing", lambda ws, d=d: _convert(ws, d, ws.path("nope")), "{ws}/nope")
        add(f"{d}/src-is-file", lambda ws, d=d: _convert(ws, d, ws.write("f", "x")), "{ws}/f")
        add(
            f"{d}/src-empty-dir",
            lambda ws, d=d: _convert(ws, d, (ws.path("e").mkdir(), ws.path("e"))[1]),
            "{ws}/e",
        )
        add(f"{d}/dst-exists", lambda ws, d=d: _convert(ws, d, _hf(), _existing_out), "{ws}/out", "exists",
            preserve=("out",))  # fmt: skip
        add(f"{d}/dst-is-src", lambda ws, d=d: _convert(ws, d, _hf(), lambda w: w.path("m")), "{ws}/m",
            preserve=("m",))  # fmt: skip
        add(f"{d}/dst-parent-missing", lambda ws, d=d: _convert(ws, d, _hf(), ws.path("a/b/c")), "{ws}/a/b")
        for flag, value in (("--tp", "0"), ("--tp", "-2"), ("--pp", "0"), ("--ep", "-1"), ("--tp", "x"),
                            ("--nproc", "0"), ("--impl", "cuda")):  # fmt: skip
            add(
                f"{d}/{flag[2:]}-{value}",
                lambda ws, d=d, f=flag, v=value: _convert(ws, d, _hf(), None, f, v),
                flag,
            )
    add(
        "hf-to-mcore/tp-not-dividing-heads",
        lambda ws: _convert(ws, "hf-to-mcore", _hf(), None, "--tp", "3"),
        "tp",
    )
    add(
        "hf-to-mcore/dtype-unknown",
        lambda ws: _convert(ws, "hf-to-mcore", _hf(), None, "--dtype", "fp8"),
        "--dtype",
    )
    for name, edit, names in (
        ("config-garbage", lambda m: (m / "config.json").write_text("{"), ("config.json",)),
        ("config-llama", lambda m: (m / "config.json").write_text(json.dumps(
            {**json.loads((m / "config.json").read_text()), "architectures": ["LlamaForCausalLM"]})),
         ("config.json", "architectures")),
        ("shard-missing", lambda m: (m / SHARD).unlink(),
         (SHARD,)),
        ("shard-truncated", lambda m: (m / SHARD).write_bytes(b"\x08" + b"\x00" * 7), (SHARD,)),
        ("no-weights", lambda m: [p.unlink() for p in m.glob("model*")], ("model.safetensors",)),
    ):  # fmt: skip
        add(f"hf-to-mcore/{name}", lambda ws, e=edit: _convert(ws, "hf-to-mcore", _hf(e)), "{ws}/m", *names)
    for name, content, _names, owner in (
        ("meta-empty", b"", ("mars_checkpoint.json",), None),
        ("meta-not-json", b"{nope", ("mars_checkpoint.json",), None),
        ("meta-array", b"[]", ("mars_checkpoint.json",), None),
        ("meta-wrong-format", json.dumps({**GOOD_META, "format": "other"}).encode(), ("format",), None),
        ("meta-no-arch", json.dumps({"format": "mars-mcore-v1"}).encode(), ("arch",), None),
        ("meta-arch-garbage", json.dumps(GOOD_META).encode(), ("arch",), None),
        ("meta-arch-unknown-field", json.dumps({**GOOD_META, "arch": {"evil": 1}}).encode(), ("arch",), None),
        ("meta-non-utf8", b'{"format": "\xff"}', ("mars_checkpoint.json",), None),
        ("meta-deep-nesting", b"[" * 100_000, ("mars_checkpoint.json",), None),
        ("meta-missing-hf-dir", None, ("{ws}/ck",), None),
    ):
        # a checkpoint's manifest is checked first: the refusal names the folder (the manifest's entry)
        feed = functools.partial(_convert, direction="mcore-to-hf", src=_meta(content))
        add(f"mcore-to-hf/{name}", feed, "{ws}/ck", owner=owner)
    add("mcore-to-hf/src-is-hf", lambda ws: _convert(ws, "mcore-to-hf", _hf()), "{ws}/m")
    for value in ("0", "-1", "nan", "inf", "1e300", "x"):
        feed = functools.partial(_shard_gb, value=value)
        add(f"mcore-to-hf/max-shard-gb-{value}", feed, "--max-shard-gb")
    add("cli/src-missing", lambda ws: mars("convert", "hf-to-mcore", ws.path("nope"), ws.path("o")),
        "{ws}/nope", cli=True)  # fmt: skip
    add("cli/dst-exists", lambda ws: mars("convert", "hf-to-mcore", _hf()(ws), _existing_out(ws)), "{ws}/out",
        preserve=("out",), cli=True)  # fmt: skip
    return out
