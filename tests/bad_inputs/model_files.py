"""Model files: an HF model directory's ``config.json``, its safetensors shards and index, and its tokenizer
files, each checked by what ``mars convert hf-to-mcore``, ``mars score``, ``mars sft`` and ``mars train`` run
before building a model (``load_hf_config``, ``HFReader``, ``validate_hf_checkpoint``) or by what loads the
tokenizer for ``mars eval`` and the rollout engines (``ChatCodec.from_pretrained``).

Hostile directories also try to run code: ``auto_map`` entries that point transformers at a Python file in
the folder, a chat template that reaches for Python objects, a pickled ``pytorch_model.bin``.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path
from typing import Any

from tests.bad_inputs.harness import MARKER, Case, Workspace

CATEGORY = "model files"
INDEX = "model.safetensors.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SHARD = "model-00004-of-00007.safetensors"  # holds layer 0's norms and down_proj, layer 1's q/k/v
TENSOR = "model.layers.0.mlp.down_proj.weight"


def check_model(path: Path) -> Any:
    """What every command that builds a model checks first (see jobs.load_engine)."""
    from mars_megatron.conversion.hf_io import HFReader
    from mars_megatron.conversion.model_io import validate_hf_checkpoint
    from mars_megatron.models.hf_config import load_hf_config

    arch = load_hf_config(path)
    reader = HFReader(path)
    try:
        validate_hf_checkpoint(reader, arch)
    finally:
        reader.close()
    return arch


def _config_case(ws: Workspace, edit: Any, fixture: str = "hf_dense") -> Any:
    model = ws.copy(fixture, "m")
    cfg = json.loads((model / "config.json").read_text())
    result = edit(cfg)
    if result is not None:
        cfg = result
    (model / "config.json").write_text(json.dumps(cfg))
    return check_model(model)


def _drop(*keys: str) -> Any:
    def edit(cfg: dict) -> None:
        for key in keys:
            cfg.pop(key, None)

    return edit


def _set(key: str, value: Any) -> Any:
    def edit(cfg: dict) -> None:
        cfg[key] = value

    return edit


def _layers(n: int) -> Any:
    """A config with ``n`` layers (and its layer_types), unlike the saved weights."""

    def edit(cfg: dict) -> None:
        cfg.update(num_hidden_layers=n, layer_types=["full_attention"] * n, max_window_layers=n)

    return edit


INT_FIELDS = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size",
    "max_position_embeddings", "num_key_value_heads", "head_dim",
)  # fmt: skip
FLOAT_FIELDS = ("rms_norm_eps", "initializer_range")


def _config_cases() -> list[tuple[str, Any, tuple[str, ...], str, str | None]]:
    """(name, edit, names, fixture, owner)."""
    out: list[tuple[str, Any, tuple[str, ...], str, str | None]] = []
    for key in ("architectures", "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings"):  # fmt: skip
        out.append((f"missing-{key}", _drop(key), (key,), "hf_dense", None))
    out.append(
        ("missing-rope-theta", _drop("rope_parameters", "rope_theta"), ("rope_theta",), "hf_dense", None)
    )
    for key in INT_FIELDS:
        for label, value in (("string", "128"), ("float", 128.5), ("bool", True), ("list", [128]),
                             ("dict", {"v": 1}), ("zero", 0), ("negative", -4)):  # fmt: skip
            out.append((f"{key}-{label}", _set(key, value), (key,), "hf_dense", None))
    for key in FLOAT_FIELDS:
        for label, value in (("string", "1e-6"), ("bool", False), ("list", [1e-6]), ("nan", math.nan),
                             ("inf", math.inf), ("negative", -1e-6)):  # fmt: skip
            owner = None
            out.append((f"{key}-{label}", _set(key, value), (key,), "hf_dense", owner))
    out.append(("rms_norm_eps-zero", _set("rms_norm_eps", 0.0), ("rms_norm_eps",), "hf_dense", None))
    for label, value in (
        ("nan", math.nan),
        ("inf", math.inf),
        ("negative", -1.0),
        ("zero", 0.0),
        ("string", "1e6"),
    ):
        owner = None
        rope = {"rope_theta": value, "rope_type": "default"}
        out.append((f"rope_theta-{label}", _set("rope_parameters", rope), ("rope_theta",), "hf_dense", owner))
    for label, value in (("string", "Qwen3ForCausalLM"), ("empty", []), ("two", ["Qwen3ForCausalLM"] * 2),
                         ("llama", ["LlamaForCausalLM"]), ("null-entry", [None]), ("int", 3),
                         ("code", ["__import__('os').system('touch PWNED')"])):  # fmt: skip
        out.append(
            (f"architectures-{label}", _set("architectures", value), ("architectures",), "hf_dense", None)
        )
    out += [
        ("rope-yarn", _set("rope_parameters", {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}),
         ("rope_parameters",), "hf_dense", None),
        ("rope_scaling-linear", _set("rope_scaling", {"type": "linear", "factor": 2.0}), ("rope_scaling",),
         "hf_dense", None),
        ("rope_scaling-string", _set("rope_scaling", "yarn"), ("rope_scaling",), "hf_dense", None),
        ("sliding-window", _set("use_sliding_window", True), ("use_sliding_window",), "hf_dense", None),
        ("kv-heads-not-dividing", _set("num_key_value_heads", 3), ("num_key_value_heads",), "hf_dense", None),
        ("kv-heads-over-heads", _set("num_key_value_heads", 8), ("num_key_value_heads",), "hf_dense", None),
        ("dtype-int8", _set("dtype", "int8"), ("dtype",), "hf_dense", None),
        ("dtype-number", _set("dtype", 5), ("dtype",), "hf_dense", None),
        ("dtype-bf16-file-f32", _set("dtype", "bfloat16"), ("declares bfloat16",), "hf_dense", None),
        ("hidden-size-absurd", _set("hidden_size", 2**40), ("hidden_size",), "hf_dense", None),
        ("vocab-absurd", _set("vocab_size", 10**12), ("vocab_size",), "hf_dense", None),
        ("layers-more-than-saved", _layers(3), ("missing", "'model.layers.2."), "hf_dense",
         None),
        ("layers-fewer-than-saved", _layers(1), ("not expected", "'model.layers.1."),
         "hf_dense", None),
        ("tie-embeddings-string", _set("tie_word_embeddings", "yes"), ("tie_word_embeddings",), "hf_dense",
         None),
        ("attention-bias-int", _set("attention_bias", 1), ("attention_bias",), "hf_dense", None),
        ("moe-topk-over-experts", _set("num_experts_per_tok", 9), ("num_experts_per_tok",), "hf_moe", None),
        ("moe-no-experts", _drop("num_experts", "num_local_experts"), ("num_experts",), "hf_moe", None),
        ("moe-experts-zero", _set("num_experts", 0), ("num_experts",), "hf_moe", None),
        ("moe-experts-string", _set("num_experts", "4"), ("num_experts",), "hf_moe", None),
        ("moe-topk-zero", _set("num_experts_per_tok", 0), ("num_experts_per_tok",), "hf_moe", None),
        ("moe-no-topk", _drop("num_experts_per_tok"), ("num_experts_per_tok",), "hf_moe", None),
        ("moe-no-ffn", _drop("moe_intermediate_size"), ("moe_intermediate_size",), "hf_moe", None),
        ("moe-mlp-only-out-of-range", _set("mlp_only_layers", [99]), ("mlp_only_layers",), "hf_moe", None),
        ("moe-mlp-only-strings", _set("mlp_only_layers", ["a"]), ("mlp_only_layers",), "hf_moe", None),
        ("moe-mlp-only-dict", _set("mlp_only_layers", {"0": 1}), ("mlp_only_layers",), "hf_moe", None),
        ("moe-sparse-step-zero", _set("decoder_sparse_step", 0), ("decoder_sparse_step",), "hf_moe", None),
        ("moe-sparse-step-minus", _set("decoder_sparse_step", -1), ("decoder_sparse_step",), "hf_moe", None),
        ("moe-norm-topk-string", _set("norm_topk_prob", "true"), ("norm_topk_prob",), "hf_moe", None),
        ("moe-aux-nan", _set("router_aux_loss_coef", math.nan), ("router_aux_loss_coef",), "hf_moe", None),
        ("moe-aux-minus", _set("router_aux_loss_coef", -1.0), ("router_aux_loss_coef",), "hf_moe", None),
        ("not-a-dict", lambda cfg: ["Qwen3ForCausalLM"], ("config.json",), "hf_dense", None),
    ]  # fmt: skip
    return out


def _config_file(ws: Workspace, data: bytes | None, directory: bool = False) -> Any:
    model = ws.copy("hf_dense", "m")
    (model / "config.json").unlink()
    if directory:
        (model / "config.json").mkdir()
    elif data is not None:
        (model / "config.json").write_bytes(data)
    return check_model(model)


CONFIG_FILES: list[tuple[str, bytes | None, str | None]] = [
    ("missing", None, None),
    ("empty", b"", None),
    ("not-json", b"architectures: [Qwen3ForCausalLM]", None),
    ("binary", bytes(range(256)) * 16, None),
    ("latin1", '{"architectures": ["Qwen3ForCausalLM"], "x": "caf\u00e9"}'.encode("latin-1"), None),
    ("utf16", b"\xff\xfe" + '{"a": 1}'.encode("utf-16-le"), None),
    ("deep-nesting", b"[" * 100_000 + b"]" * 100_000, None),
    ("nan-literal", b'{"architectures": ["Qwen3ForCausalLM"], "hidden_size": NaN}', None),
    ("null", b"null", None),
    ("string", b'"config"', None),
]


# ----------------------------------------------------------------------------------------- safetensors
def _shard_case(ws: Workspace, edit: Any) -> Any:
    model = ws.copy("hf_dense", "m")
    edit(model)
    return check_model(model)


def _rewrite_shard(transform: Any) -> Any:
    """Rewrite SHARD with its tensors passed through ``transform(name, tensor) -> tensor | None``."""

    def edit(model: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(model / SHARD)
        out = {}
        for name, t in tensors.items():
            new = transform(name, t)
            if new is not None:
                out[name] = new
        save_file(out, model / SHARD, metadata={"format": "pt"})

    return edit


def _raw(edit_bytes: Any) -> Any:
    def edit(model: Path) -> None:
        path = model / SHARD
        path.write_bytes(edit_bytes(path.read_bytes()))

    return edit


def _header(mutate: Any) -> Any:
    """Rewrite the shard's JSON header (same data after it)."""

    def edit_bytes(data: bytes) -> bytes:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        header = mutate(header) or header
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        return struct.pack("<Q", len(blob)) + blob + data[8 + n :]

    return _raw(edit_bytes)


def _index(mutate: Any) -> Any:
    def edit(model: Path) -> None:
        path = model / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        result = mutate(index, model)
        path.write_text(result if isinstance(result, str) else json.dumps(result or index))

    return edit


def _move_outside(index: dict, model: Path) -> None:
    outside = model.parent / "elsewhere"
    outside.mkdir()
    (model / SHARD).rename(outside / SHARD)
    for name, file in index["weight_map"].items():
        if file == SHARD:
            index["weight_map"][name] = f"../elsewhere/{SHARD}"


def _absolute(index: dict, model: Path) -> None:
    for name, file in index["weight_map"].items():
        if file == SHARD:
            index["weight_map"][name] = str(model / SHARD)


def _set_dtype(header: dict) -> None:
    header[TENSOR]["dtype"] = "BF16"
    start, end = header[TENSOR]["data_offsets"]
    header[TENSOR]["data_offsets"] = [start, start + (end - start) // 2]


def _safetensors_cases() -> list[tuple[str, Any, tuple[str, ...], str | None]]:
    import torch

    def idx(f: Any) -> Any:
        return _index(f)

    return [
        ("truncated-half", _raw(lambda d: d[: len(d) // 2]), (SHARD,), None),
        ("truncated-header", _raw(lambda d: d[:20]), (SHARD,), None),
        ("zero-bytes", _raw(lambda d: b""), (SHARD,), None),
        ("header-length-absurd", _raw(lambda d: struct.pack("<Q", 2**60) + d[8:]), (SHARD,), None),
        ("header-not-json", _raw(lambda d: d[:8] + b"{" * 8 + d[16:]), (SHARD,), None),
        ("header-array", _header(lambda h: [1, 2]), (SHARD,), None),
        ("offsets-past-end", _header(lambda h: h[TENSOR].update(data_offsets=[0, 10**9])), (SHARD,), None),
        ("offsets-reversed", _header(lambda h: h[TENSOR].update(data_offsets=[64, 0])), (SHARD,), None),
        ("dtype-mislabelled", _header(_set_dtype), (SHARD,), None),
        ("dtype-unknown", _header(lambda h: h[TENSOR].update(dtype="Q99")), (SHARD,), None),
        ("shape-negative", _header(lambda h: h[TENSOR].update(shape=[-1, 256])), (SHARD,), None),
        ("wrong-dtype", _rewrite_shard(lambda n, t: t.to(torch.bfloat16) if n == TENSOR else t),
         (SHARD, TENSOR, "BF16"), None),
        ("wrong-dtype-int", _rewrite_shard(lambda n, t: t.to(torch.int32) if n == TENSOR else t),
         (SHARD, TENSOR), None),
        ("wrong-shape", _rewrite_shard(lambda n, t: t[:, :64].contiguous() if n == TENSOR else t),
         (SHARD, TENSOR, "shape"), None),
        ("transposed", _rewrite_shard(lambda n, t: t.t().contiguous() if n == TENSOR else t),
         (SHARD, TENSOR, "shape"), None),
        ("scalar", _rewrite_shard(lambda n, t: t.sum() if n == TENSOR else t), (SHARD, TENSOR), None),
        ("tensor-missing-from-shard", _rewrite_shard(lambda n, t: None if n == TENSOR else t),
         (SHARD, TENSOR), None),
        ("extra-tensor", idx(lambda i, m: i["weight_map"].update({"model.layers.9.evil": SHARD})),
         ("model.layers.9.evil",), None),
        ("tensor-missing", idx(lambda i, m: i["weight_map"].pop(TENSOR) and None), (TENSOR,), None),
        ("shard-deleted", lambda m: (m / SHARD).unlink(), (SHARD,), None),
        ("shard-is-directory", lambda m: ((m / SHARD).unlink(), (m / SHARD).mkdir()), (SHARD,), None),
        ("index-not-json", idx(lambda i, m: "{not json"), ("model.safetensors.index.json",), None),
        ("index-no-weight-map", idx(lambda i, m: {"metadata": {}}), ("model.safetensors.index.json",), None),
        ("index-array", idx(lambda i, m: "[]"), ("model.safetensors.index.json",), None),
        ("index-weight-map-list", idx(lambda i, m: {"weight_map": [[TENSOR, SHARD]]}),
         ("model.safetensors.index.json",), None),
        ("index-weight-map-string", idx(lambda i, m: {"weight_map": "x"}), ("model.safetensors.index.json",),
         None),
        ("index-file-int", idx(lambda i, m: i["weight_map"].update({TENSOR: 7})),
         ("model.safetensors.index.json", TENSOR), None),
        ("index-file-null", idx(lambda i, m: i["weight_map"].update({TENSOR: None})),
         ("model.safetensors.index.json", TENSOR), None),
        ("index-path-traversal", idx(_move_outside), (INDEX, "../elsewhere"), None),
        ("index-absolute-path", idx(_absolute), ("model.safetensors.index.json",), None),
        ("index-non-utf8", lambda m: (m / INDEX).write_bytes(b'{"weight_map": "\xff"}'),
         ("model.safetensors.index.json",), None),
        ("index-deep-nesting", lambda m: (m / "model.safetensors.index.json").write_bytes(b"[" * 100_000),
         ("model.safetensors.index.json",), None),
        ("index-is-directory", lambda m: ((m / "model.safetensors.index.json").unlink(),
                                          (m / "model.safetensors.index.json").mkdir()),
         ("model.safetensors.index.json",), None),
        ("no-weights", lambda m: [p.unlink() for p in m.glob("model*")], ("model.safetensors",), None),
        ("single-file-garbage", lambda m: ([p.unlink() for p in m.glob("model*")],
                                           (m / "model.safetensors").write_bytes(b"garbage" * 10)),
         ("model.safetensors",), None),
        ("pickled-bin-only", lambda m: ([p.unlink() for p in m.glob("model*")], _pickle_bin(m)),
         ("model.safetensors",), None),
    ]  # fmt: skip


class _Evil:
    """A pickle that runs ``touch PWNED`` in the folder where it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


def _pickle_bin(model: Path) -> None:
    import pickle

    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Evil(model.parent / MARKER)))


# ----------------------------------------------------------------------------------------- tokenizer
def _codec(ws: Workspace, edit: Any) -> Any:
    from mars_megatron.rollout.chat import ChatCodec

    model = ws.copy("hf_dense", "m")
    edit(model, ws)
    codec = ChatCodec.from_pretrained(model)
    return codec.encode([{"role": "user", "content": "What is 2+3?"}])


EVIL_MODULE = (
    "open({marker!r}, 'w').close()\nfrom transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
)


def _remote_tokenizer(model: Path, ws: Workspace) -> None:
    (model / "evil.py").write_text(EVIL_MODULE.format(marker=str(ws.marker)))
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))


def _remote_config(model: Path, ws: Workspace) -> None:
    (model / "evil.py").write_text(EVIL_MODULE.format(marker=str(ws.marker)))
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(
        model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig", "AutoTokenizer": "evil.EvilTokenizer"}
    )
    (model / "config.json").write_text(json.dumps(cfg))


def _template(text: str) -> Any:
    def edit(model: Path, ws: Workspace) -> None:
        (model / "chat_template.jinja").write_text(text.replace("MARKER", str(ws.marker)))

    return edit


def _write(name: str, data: bytes | None) -> Any:
    def edit(model: Path, ws: Workspace) -> None:
        if data is None:
            (model / name).unlink()
        else:
            (model / name).write_bytes(data)

    return edit


def _tokenizer_cases() -> list[tuple[str, Any, tuple[str, ...], str | None]]:
    sandbox_escape = (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}"
        "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}"
    )
    return [
        ("tokenizer-json-missing", _write("tokenizer.json", None), ("{ws}/m",), None),
        ("tokenizer-json-empty", _write("tokenizer.json", b""), ("{ws}/m",), None),
        ("tokenizer-json-garbage", _write("tokenizer.json", b"\x00\x01garbage"), ("{ws}/m",), None),
        ("tokenizer-json-object", _write("tokenizer.json", b"{}"), ("{ws}/m",), None),
        ("tokenizer-json-truncated", lambda m, ws: (m / "tokenizer.json").write_bytes(
            (m / "tokenizer.json").read_bytes()[:1000]), ("{ws}/m",), None),
        ("tokenizer-config-not-json", _write("tokenizer_config.json", b"{nope"), ("{ws}/m",), None),
        ("tokenizer-config-array", _write("tokenizer_config.json", b"[1]"), ("{ws}/m",), None),
        ("both-missing", lambda m, ws: [(m / n).unlink() for n in ("tokenizer.json", TOKENIZER_CONFIG)],
         ("{ws}/m",), None),
        ("chat-template-missing", _write("chat_template.jinja", None), ("{ws}/m", "chat template"), None),
        ("chat-template-syntax", _template("{% for m in messages %}{{ m['content'] }"), ("{ws}/m",), None),
        ("chat-template-raises", _template("{{ raise_exception('no') }}"), ("{ws}/m",), None),
        ("chat-template-undefined", _template("{{ nothing.at.all }}"), ("{ws}/m",), None),
        ("chat-template-sandbox-escape", _template(sandbox_escape), ("{ws}/m",), None),
        ("chat-template-empty", _template(""), ("{ws}/m",), None),
        ("remote-code-tokenizer", _remote_tokenizer, ("{ws}/m/tokenizer_config.json", "auto_map"), None),
        ("remote-code-config", _remote_config, ("{ws}/m/config.json", "auto_map"), None),
    ]  # fmt: skip


def _engine(ws: Workspace, edit: Any) -> Any:
    """The transformers rollout engine (``mars eval --engine transformers``, the trainer's engines)."""
    from mars_megatron.rollout.hf_engine import HFEngine

    model = ws.copy("hf_dense", "m")
    edit(model, ws)
    return HFEngine(str(model))


def cases() -> list[Case]:
    out: list[Case] = []
    for name, edit, names, fixture, owner in _config_cases():
        feed = functools.partial(_config_case, edit=edit, fixture=fixture)
        out.append(
            Case(CATEGORY, f"config.json/{name}", feed, ("{ws}/m", *names), owner=owner, needs=(fixture,))
        )
    for name, data, owner in CONFIG_FILES:
        out.append(Case("model files", f"config.json/file-{name}", lambda ws, d=data: _config_file(ws, d),
                        ("{ws}/m/config.json",), owner=owner, needs=("hf_dense",)))  # fmt: skip
    out.append(Case("model files", "config.json/file-directory", lambda ws: _config_file(ws, None, True),
                    ("{ws}/m/config.json",), needs=("hf_dense",)))  # fmt: skip
    for name, edit, names, owner in _safetensors_cases():
        out.append(Case("model files", f"safetensors/{name}", lambda ws, e=edit: _shard_case(ws, e),
                        ("{ws}/m", *names), owner=owner, needs=("hf_dense",)))  # fmt: skip
    for name, edit, names, owner in _tokenizer_cases():
        feed = functools.partial(_codec, edit=edit)
        out.append(Case(CATEGORY, f"tokenizer/{name}", feed, names, owner=owner, needs=("hf_dense",)))
    out.append(Case("model files", "engine/remote-code-config", lambda ws: _engine(ws, _remote_config),
                    ("{ws}/m/config.json", "auto_map"), needs=("hf_dense",)))  # fmt: skip
    return out
