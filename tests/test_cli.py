"""The ``mars`` command run as a real subprocess: init-model -> convert -> score / train / config, with
outputs checked against ``transformers``, and bad inputs failing with a clear message and no output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from mars_megatron.config import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_cpu.yaml"

# lengths 4, 1, 2, 12, 7 (a blank line in between is skipped); 5 sequences give an uneven last micro-batch
TOKENS = [
    [5, 17, 300, 2],
    [9],
    [1023, 0],
    [4, 8, 15, 16, 23, 42, 108, 7, 7, 7, 512, 99],
    [3, 1, 4, 1, 5, 9, 2],
]


def mars(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mars_megatron.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def write_tokens(path: Path, seqs: list[list[int]]) -> Path:
    lines = [json.dumps({"tokens": s}) for s in seqs]
    path.write_text("\n".join([*lines[:2], "", *lines[2:]]) + "\n")
    return path


def hf_logprobs(model_dir: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            logp = torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)
            out.append(logp[torch.arange(len(s) - 1), torch.tensor(s[1:], dtype=torch.long)])
    return out


def read_logprobs(path: Path) -> list[torch.Tensor]:
    return [torch.tensor(json.loads(line)["logprobs"]) for line in path.read_text().splitlines()]


def assert_close_to(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert [len(g) for g in got] == [len(s) - 1 for s in TOKENS]
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def moe(work: Path) -> Path:
    result = ok(mars("init-model", "--preset", "tiny-moe", "--out", "moe-hf", cwd=work))
    assert "wrote tiny-moe to moe-hf" in result.stdout
    assert (work / "moe-hf" / "config.json").is_file()
    return work / "moe-hf"


@pytest.fixture(scope="module")
def mcore(work: Path, moe: Path) -> Path:
    result = ok(mars("convert", "hf-to-mcore", moe, "moe-mcore", "--ep", "2", cwd=work))
    assert "wrote moe-mcore" in result.stdout
    meta = json.loads((work / "moe-mcore" / "mars_checkpoint.json").read_text())
    assert meta["written_by_layout"] == {"tp": 1, "pp": 1, "ep": 2}
    return work / "moe-mcore"


@pytest.fixture(scope="module")
def tokens(work: Path) -> Path:
    return write_tokens(work / "tokens.jsonl", TOKENS)


@pytest.fixture(scope="module")
def reference(moe: Path) -> list[torch.Tensor]:
    return hf_logprobs(moe, TOKENS)


# -------------------------------------------------------------------------------------------- happy path
def test_score_converted_checkpoint_matches_transformers(
    work: Path, mcore: Path, tokens: Path, reference: list[torch.Tensor]
) -> None:
    """Written in EP2, read back into one process: the checkpoint reshards and scores like transformers."""
    out = work / "scores-mcore.jsonl"
    result = ok(
        mars(
            "score", "--model-dir", mcore, "--input", tokens, "--output", out, "--micro-batch", "2", cwd=work
        )
    )
    assert f"scored 5 sequences -> {out}" in result.stdout
    assert_close_to(read_logprobs(out), reference)
    assert not list(work.glob(".*partial*"))


@pytest.mark.multiproc
def test_score_hf_dir_in_tp2_matches_transformers(
    work: Path, moe: Path, tokens: Path, reference: list[torch.Tensor]
) -> None:
    out = work / "scores-hf.jsonl"
    ok(mars("score", "--model-dir", moe, "--input", tokens, "--output", out, "--tp", "2", cwd=work))
    assert_close_to(read_logprobs(out), reference)


def test_train_prints_steps_and_writes_metrics_and_config(work: Path) -> None:
    from mars_megatron.jobs import text_batches

    ok(mars("init-model", "--preset", "tiny-dense", "--out", "dense-hf", cwd=work))
    overrides = [f"model.hf_dir={work / 'dense-hf'}", "train.steps=2", f"logging.run_dir={work / 'run'}"]
    result = ok(mars("train", EXAMPLE, *overrides, cwd=work))

    printed = re.findall(r"^step\s+(\d+)  loss (\d+\.\d{4})  grad_norm", result.stdout, re.MULTILINE)
    assert [step for step, _ in printed] == ["1", "2"], result.stdout
    assert "step    1  loss " in result.stdout

    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m, (_, loss) in zip(metrics, printed, strict=True):
        assert f"{m['loss']:.4f}" == loss
        assert m["tokens"] == 4 * 127  # global_batch 4 windows of seq_length 128
        assert m["update_ok"] == 1.0

    # the first step's loss is transformers' cross-entropy on the first global batch of the demo corpus
    batch = text_batches(work / "dense-hf", 128)[:4]
    ref = -torch.cat(hf_logprobs(work / "dense-hf", batch)).mean().item()
    assert metrics[0]["loss"] == pytest.approx(ref, abs=1e-4)

    saved = load_config(work / "run" / "config.yaml")
    assert saved == load_config(EXAMPLE, overrides)
    assert saved.train.steps == 2 and saved.model.hf_dir == str(work / "dense-hf")


def test_config_describe_lists_fields(work: Path) -> None:
    result = ok(mars("config", "--describe", cwd=work))
    assert "  parallel.tp: int >= 1; default 1" in result.stdout
    assert "Tensor-parallel size" in result.stdout
    assert "[optimizer]" in result.stdout


def test_config_prints_resolved_values(work: Path) -> None:
    result = ok(mars("config", EXAMPLE, "parallel.tp=2", cwd=work))
    printed = yaml.safe_load(result.stdout)
    assert printed["parallel"]["tp"] == 2
    assert printed["train"]["global_batch"] == 4


# ---------------------------------------------------------------------------------------------- bad input
def assert_failed(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    """Exit ``code``, nothing on stdout, and one ``mars <command>: error: ...`` line holding ``needles``
    (library warnings may precede it on stderr)."""
    assert result.returncode == code, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if re.match(r"mars [\w-]+: error: ", line)]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}\n{result.stderr}"


@pytest.mark.parametrize(
    ("lines", "lineno", "message"),
    [
        (['{"tokens": [1, 2]}', '{"tokens": [1, 2]'], 2, "not valid JSON"),
        (['{"ids": [1, 2]}'], 1, "field 'tokens' must be a non-empty list"),
        (['{"tokens": [1, 2]}', "", '{"tokens": []}'], 3, "field 'tokens' must be a non-empty list"),
        (['{"tokens": [1, -2]}'], 1, "field 'tokens' must be a non-empty list"),
        (["[1, 2, 3]"], 1, "field 'tokens' must be a non-empty list"),
    ],
    ids=["malformed-json", "missing-tokens", "empty-tokens", "negative-id", "not-an-object"],
)
def test_score_rejects_bad_token_lines(
    tmp_path: Path, work: Path, moe: Path, lines: list[str], lineno: int, message: str
) -> None:
    tokens = tmp_path / "bad.jsonl"
    tokens.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    result = mars("score", "--model-dir", moe, "--input", tokens, "--output", out, cwd=work)
    assert_failed(result, 2, f"{tokens}:{lineno}:", message)
    assert list(tmp_path.iterdir()) == [tokens]


def test_score_rejects_token_id_out_of_range(tmp_path: Path, work: Path, moe: Path) -> None:
    tokens = write_tokens(tmp_path / "big.jsonl", [[1, 2, 3], [5, 1024]])  # vocab_size is 1024
    out = tmp_path / "out.jsonl"
    result = mars("score", "--model-dir", moe, "--input", tokens, "--output", out, cwd=work)
    # Checked against the model's config before any rank starts: a usage error naming file and line.
    assert_failed(result, 2, f"{tokens}:2: token id 1024 is out of range for vocab_size 1024")
    assert list(tmp_path.iterdir()) == [tokens]


def test_score_rejects_missing_model_dir(tmp_path: Path, work: Path, tokens: Path) -> None:
    out = tmp_path / "out.jsonl"
    result = mars("score", "--model-dir", tmp_path / "nope", "--input", tokens, "--output", out, cwd=work)
    assert_failed(result, 2, f"{tmp_path / 'nope'}: no such file")
    assert list(tmp_path.iterdir()) == []


def test_score_rejects_missing_output_dir(tmp_path: Path, work: Path, moe: Path, tokens: Path) -> None:
    out = tmp_path / "missing" / "out.jsonl"
    result = mars("score", "--model-dir", moe, "--input", tokens, "--output", out, cwd=work)
    assert_failed(result, 2, f"{tmp_path / 'missing'}: output directory does not exist")
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_existing_output_dir(tmp_path: Path, work: Path, moe: Path) -> None:
    dst = tmp_path / "exists"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    result = mars("convert", "hf-to-mcore", moe, dst, cwd=work)
    assert_failed(result, 2, f"{dst}: output directory already exists")
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
    assert list(tmp_path.iterdir()) == [dst]


def test_train_rejects_unknown_config_key(tmp_path: Path, work: Path) -> None:
    run_dir = tmp_path / "run"
    result = mars("train", EXAMPLE, "parallel.tpp=2", f"logging.run_dir={run_dir}", cwd=work)
    assert_failed(
        result, 2, "override 'parallel.tpp=2'", "parallel.tpp: unknown key", "did you mean 'parallel.tp'"
    )
    assert not run_dir.exists()


def test_train_rejects_missing_model_dir(tmp_path: Path, work: Path) -> None:
    run_dir = tmp_path / "run"
    nope = tmp_path / "nope"
    result = mars("train", EXAMPLE, f"model.hf_dir={nope}", f"logging.run_dir={run_dir}", cwd=work)
    assert_failed(result, 1, f"{nope}: no such file")
    assert not run_dir.exists()
