"""The ``mars`` command run as a real subprocess: init-model -> convert -> score / train / config, with
outputs checked against ``transformers``, and bad inputs failing with a clear message and no output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
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


def mars_here(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """:func:`mars` in this process (``cli.main`` from ``cwd``, argparse's exit included), for commands
    refused before anything starts: the same code, exit status and output, without a subprocess's seconds
    of imports per call. Also checks that the refusal left nothing started here (no Ray)."""
    import contextlib

    from tests.bad_inputs.harness import mars_main

    with contextlib.chdir(cwd):
        r = mars_main(*args)
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), f"mars {args[0]} started Ray before refusing"
    return subprocess.CompletedProcess(["mars", *map(str, args)], r.rc, r.stdout, r.stderr)


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
    result = ok(mars("convert", "hf-to-mcore", moe, "moe-mcore", "--ep", "2", "--via-model", cwd=work))
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


def test_convert_is_direct_both_ways_and_exact(work: Path, moe: Path, mcore: Path) -> None:
    """Without ``--via-model`` both directions run in the command's own process, no model or ranks; the
    direct checkpoint exports back bit-identical, and so does the model path's (``mcore``, EP2)."""
    from tests.test_conversion import assert_bit_identical

    result = ok(mars("convert", "hf-to-mcore", moe, "moe-direct", "--ep", "2", cwd=work))
    assert (
        "wrote moe-direct (direct: loads into any layout; --ep applies only with --via-model)"
        in result.stdout
    )
    meta = json.loads((work / "moe-direct" / "mars_checkpoint.json").read_text())
    assert meta["written_by_layout"] == {"tp": 1, "pp": 1, "ep": 1}  # the layout flags do not apply
    for src in ("moe-direct", mcore.name):
        result = ok(mars("convert", "mcore-to-hf", src, f"{src}-hf", cwd=work))
        assert f"wrote {src}-hf (direct)" in result.stdout and "through a model" not in result.stdout
        assert_bit_identical(moe, work / f"{src}-hf")


@pytest.mark.multiproc
def test_score_hf_dir_in_tp2_matches_transformers(
    work: Path, moe: Path, tokens: Path, reference: list[torch.Tensor]
) -> None:
    out = work / "scores-hf.jsonl"
    ok(mars("score", "--model-dir", moe, "--input", tokens, "--output", out, "--tp", "2", cwd=work))
    assert_close_to(read_logprobs(out), reference)


def test_config_describe_lists_fields(work: Path) -> None:
    result = ok(mars("config", "--describe", cwd=work))
    assert "  parallel.tp: int >= 1; default 1" in result.stdout
    assert "Tensor-parallel size" in result.stdout
    assert "[optimizer]" in result.stdout


def test_config_prints_resolved_values(work: Path) -> None:
    result = ok(mars("config", EXAMPLE, "parallel.tp=2", cwd=work))
    printed = yaml.safe_load(result.stdout)
    assert printed["parallel"]["tp"] == 2
    assert printed["train"]["pack_length"] == load_config(EXAMPLE).train.pack_length


def test_overrides_may_follow_options(work: Path) -> None:
    """``key=value`` words after an option still reach the config (here: rejected, naming the field)."""
    result = mars_here("train", EXAMPLE, "--nproc", "2", "parallel.tp=3", cwd=work)
    assert_failed(result, 2, "parallel.tp = 3")
    result = mars_here("train", EXAMPLE, "--nproc", "2", "oops", cwd=work)
    assert result.returncode == 2 and "unrecognized arguments: oops" in result.stderr


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
        (['{"tokens": [1, 2]}', '{"tokens": [1, 2]'], 2, "invalid JSON (Expecting"),
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
    result = mars_here("score", "--model-dir", moe, "--input", tokens, "--output", out, cwd=work)
    assert_failed(result, 2, f"{tokens}:{lineno}:", message)
    assert list(tmp_path.iterdir()) == [tokens]


def test_score_rejects_token_id_out_of_range(tmp_path: Path, work: Path, moe: Path) -> None:
    tokens = write_tokens(tmp_path / "big.jsonl", [[1, 2, 3], [5, 1024]])  # vocab_size is 1024
    out = tmp_path / "out.jsonl"
    result = mars_here("score", "--model-dir", moe, "--input", tokens, "--output", out, cwd=work)
    # Checked against the model's config before any rank starts: a usage error naming file and line.
    assert_failed(result, 2, f"{tokens}:2: token id 1024 is out of range for vocab_size 1024")
    assert list(tmp_path.iterdir()) == [tokens]


def test_score_rejects_missing_model_dir(tmp_path: Path, work: Path, tokens: Path) -> None:
    out = tmp_path / "out.jsonl"
    result = mars_here(
        "score", "--model-dir", tmp_path / "nope", "--input", tokens, "--output", out, cwd=work
    )
    assert_failed(result, 2, f"{tmp_path / 'nope'}: no such file")
    assert list(tmp_path.iterdir()) == []


def test_score_rejects_missing_output_dir(tmp_path: Path, work: Path, moe: Path, tokens: Path) -> None:
    out = tmp_path / "missing" / "out.jsonl"
    result = mars_here("score", "--model-dir", moe, "--input", tokens, "--output", out, cwd=work)
    assert_failed(result, 2, f"{tmp_path / 'missing'}: output directory does not exist")
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_existing_output_dir(tmp_path: Path, work: Path, moe: Path) -> None:
    dst = tmp_path / "exists"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    result = mars_here("convert", "hf-to-mcore", moe, dst, cwd=work)
    assert_failed(result, 2, f"{dst}: output directory already exists")
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and (dst / "keep.txt").read_text() == "mine"
    assert list(tmp_path.iterdir()) == [dst]


def test_train_rejects_unknown_config_key(tmp_path: Path, work: Path) -> None:
    run_dir = tmp_path / "run"
    result = mars_here("train", EXAMPLE, "parallel.tpp=2", f"logging.run_dir={run_dir}", cwd=work)
    assert_failed(
        result, 2, "override 'parallel.tpp=2'", "parallel.tpp: unknown key", "did you mean 'parallel.tp'"
    )
    assert not run_dir.exists()


def test_train_rejects_missing_model_dir(tmp_path: Path, work: Path) -> None:
    run_dir = tmp_path / "run"
    nope = tmp_path / "nope"
    args = [f"model.hf_dir={nope}", "model.mcore_dir=null", f"logging.run_dir={run_dir}"]
    result = mars_here("train", EXAMPLE, *args, cwd=work)
    assert_failed(result, 2, "model.hf_dir", f"{nope}: no such directory")
    assert not run_dir.exists()


def test_train_rejects_missing_data_file(tmp_path: Path, work: Path, moe: Path) -> None:
    args = [f"model.hf_dir={moe}", "model.mcore_dir=null", f"logging.run_dir={tmp_path / 'run'}"]
    result = mars_here("train", EXAMPLE, *args, "data.train_file=nope.jsonl", cwd=work)
    assert_failed(result, 2, "data.train_file: nope.jsonl: no such file")


def test_train_rejects_pack_length_shorter_than_a_response(tmp_path: Path, work: Path) -> None:
    run_dir = tmp_path / "run"
    result = mars_here("train", EXAMPLE, "train.pack_length=16", f"logging.run_dir={run_dir}", cwd=work)
    assert_failed(result, 2, "train.pack_length: 16 is shorter than rollout.max_response_tokens")
    assert not run_dir.exists()


def test_train_rejects_a_layout_that_does_not_divide_the_model(tmp_path: Path, work: Path, moe: Path) -> None:
    """The tiny MoE has 4 experts: ep=3 cannot split them. Refused before any process or Ray starts."""
    run_dir = tmp_path / "run"
    args = [f"model.hf_dir={moe}", "model.mcore_dir=null", "parallel.ep=3", f"logging.run_dir={run_dir}"]
    result = mars_here("train", EXAMPLE, *args, cwd=work)
    assert_failed(result, 2, "mars train: error: parallel.ep: 3 must divide num_experts (4)")
    assert not run_dir.exists()


def test_train_refuses_to_overwrite_a_run_without_resume(tmp_path: Path, work: Path, moe: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    data = REPO / "examples" / "data" / "arith_train.jsonl"
    args = [f"model.hf_dir={moe}", "model.mcore_dir=null", f"data.train_file={data}"]
    args.append(f"logging.run_dir={run_dir}")
    result = mars_here("train", EXAMPLE, *args, cwd=work)
    assert_failed(result, 2, "already holds a run", "--resume")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


# --------------------------------------------------------------------------------------- routed scoring
def _forced_routing(seqs: list[list[int]]) -> list[np.ndarray]:
    """Experts no router would pick so regularly: position p, layer l -> (p + l) % 4 and (p + l + 1) % 4."""
    out = []
    for s in seqs:
        p = np.arange(len(s) - 1)[:, None, None]
        layer = np.arange(2)[None, :, None]
        out.append(((p + layer + np.arange(2)[None, None, :]) % 4).astype(np.uint8))
    return out


def hf_forced_logprobs(
    model_dir: Path, seqs: list[list[int]], routing: list[np.ndarray]
) -> list[torch.Tensor]:
    """transformers with every router's top-k replaced by ``routing`` (gate weights: the router's softmax
    over the given experts, renormalised, as Megatron's post-softmax router computes them)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    forced: list[torch.Tensor | None] = [None]

    def wrap(layer: int, gate: torch.nn.Module):
        original = gate.forward

        def forward(hidden: torch.Tensor):
            logits, _, _ = original(hidden)
            idx = forced[0][:, layer].long()  # type: ignore[index]
            return logits, torch.softmax(logits.gather(1, idx).float(), -1).to(logits.dtype), idx

        return forward

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.forward = wrap(i, layer.mlp.gate)
    out = []
    with torch.no_grad():
        for s, r in zip(seqs, routing, strict=True):
            # the last token's row is free in mars; feed the model only the positions that have one
            forced[0] = torch.from_numpy(r.astype(np.int64))
            logp = (
                torch.log_softmax(model(torch.tensor([s[:-1]])).logits[0].float(), -1) if len(s) > 1 else None
            )
            out.append(
                torch.empty(0) if logp is None else logp[torch.arange(len(s) - 1), torch.tensor(s[1:])]
            )
    return out


def test_score_under_given_routing_matches_transformers_forced_to_it(
    work: Path, moe: Path, tokens: Path, reference: list[torch.Tensor]
) -> None:
    routing = _forced_routing(TOKENS)
    path = work / "routing.npz"
    np.savez(path, *routing)
    out = work / "scores-routed.jsonl"
    result = ok(
        mars("score", "--model-dir", moe, "--input", tokens, "--output", out, "--routing", path, cwd=work)
    )
    assert f"scored 5 sequences under the routing of {path} -> {out}" in result.stdout
    got = read_logprobs(out)
    assert_close_to(got, hf_forced_logprobs(moe, TOKENS, routing))
    assert max(float((g - r).abs().max()) for g, r in zip(got, reference, strict=True) if len(g)) > 1e-3


@pytest.mark.parametrize(
    ("arrays", "message"),
    [("short", r"sample '.*routing.npz:arr_3': routed_experts has shape \(10, 2, 2\), expected \(11, 2, 2\)"),
     ("out-of-range", r"sample '.*routing.npz:arr_0'.*expert ids in \[1, 7\], the model has experts 0..3"),
     ("missing", r"routing.npz: expected arrays arr_0..arr_4, one per sequence .*; missing \['arr_4'\]")],
)  # fmt: skip
def test_score_rejects_bad_routing_naming_the_sequence(
    tmp_path: Path, work: Path, moe: Path, tokens: Path, arrays: str, message: str
) -> None:
    routing = _forced_routing(TOKENS)
    if arrays == "short":
        routing[3] = routing[3][:-1]
    elif arrays == "out-of-range":
        routing[0] = routing[0] * 2 + 1
    else:
        routing = routing[:-1]
    path = tmp_path / "routing.npz"
    np.savez(path, *routing)
    out = tmp_path / "out.jsonl"
    result = mars_here(
        "score", "--model-dir", moe, "--input", tokens, "--output", out, "--routing", path, cwd=work
    )
    assert result.returncode == 2 and re.search(message, result.stderr), result.stderr
    assert not out.exists()
