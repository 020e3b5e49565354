"""``mars train`` end to end as a subprocess: Ray trainer ranks (EP2), a Ray rollout engine, real rewards.

Starts from a briefly supervised tiny MoE (so rewards are neither all 0 nor all 1 and the updates are real)
and checks the run's outputs, then kills a trainer rank in step 3's update (the run rebuilds its trainer
group from the step-2 checkpoint) and the whole run after step 3's checkpoint (--resume finishes it):
steps 3 and 4 must give exactly the rewards, losses and gradient norms of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mars_megatron.metrics import read_metrics
from mars_megatron.metrics.tracker_mlflow import mlflow_client
from tests.test_cli import TOKENS, assert_close_to, hf_logprobs, mars, ok, read_logprobs, write_tokens
from tests.test_trackers import assert_trackers_hold_the_run, wandb_history, wandb_runs

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_cpu.yaml"
DATA = REPO / "examples" / "data" / "arith_train.jsonl"
SUMS = REPO / "examples" / "rewards" / "sums.py:score"
STEPS = 4
REQUIRED = ["reward/solver", "reward/verifier", "reward/corrector", "samples/solver", "samples/verifier",
            "samples/corrector", "tokens", "time/step", "policy_version"]  # fmt: skip


def _train(model: Path, run: Path, *extra: str, resume: bool = False) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "mars_megatron.cli", "train", str(EXAMPLE), f"model.mcore_dir={model}",
        f"data.train_file={DATA}", f"logging.run_dir={run}", f"checkpoint.save_dir={run}/ckpt",
        "checkpoint.save_interval=1", f"train.steps={STEPS}", "data.problems_per_step=4", *extra,
    ]  # fmt: skip
    if resume:
        args.append("--resume")
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # a killed run's lines are in its output
    )


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err[-4000:]}"
    return out


@pytest.fixture(scope="module")
def uninterrupted(sft_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run = tmp_path_factory.mktemp("full") / "run"
    return run, _finish(_train(sft_model, run))


def test_run_writes_metrics_tensorboard_plot_and_checkpoints(uninterrupted: tuple[Path, str]) -> None:
    run, stdout = uninterrupted
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        for key in REQUIRED:
            assert key in r, key
        assert r["samples/solver"] == 4 * 4  # 4 problems x G = 4
        assert r["train/update_ok"] == 1.0
    assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
    # the supervised start makes rewards informative: neither all right nor all wrong
    solver = [r["reward/solver"] for r in records]
    assert 0 < sum(solver) < STEPS
    assert any(r["train/grad_norm"] > 0 for r in records)
    assert [line.split()[1] for line in stdout.splitlines() if line.startswith("step")] == [
        f"{s}/{STEPS}" for s in range(1, STEPS + 1)
    ]
    assert any((run / "tensorboard").iterdir())
    assert (run / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpts = sorted(p.name for p in (run / "ckpt").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_000003", "step_000004"]  # keep_last 2
    state = json.loads((run / "ckpt" / "step_000004" / "trainer_state.json").read_text())["state"]
    assert state["step"] == STEPS and state["policy_versions"] == {"shared": STEPS}


def test_the_gpu_checks_summary_reads_a_real_run(uninterrupted: tuple[Path, str]) -> None:
    """tools/gpu_check.py summarises its tiny run from these metrics: every key it reads is written."""
    from tests.test_gpu_check import load_gpu_check

    run, _ = uninterrupted
    summary = load_gpu_check().run_summary(read_metrics(run / "metrics.jsonl"), STEPS)
    assert (summary["steps"], summary["updated"]) == (STEPS, STEPS)
    assert 0 < summary["step_s"] < 60 and summary["first_step_s"] > 0
    assert (
        0 <= summary["mismatch_abs_mean"] < 1e-3 and summary["mismatch_kl"] < 1e-4
    )  # fp32 engine and trainer


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def _busy_rank(proc: subprocess.Popen, timeout_s: float = 300) -> int:
    """A trainer rank of ``proc``'s run (its session: Ray gives each worker a process group of its own)
    while it runs a call (Ray titles an actor's process ``ray::<class>.<method>`` while the method runs):
    after a checkpoint, the next is an update."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                title = (entry / "cmdline").read_bytes()
                if title.startswith(b"ray::_RankActor.run") and os.getsid(int(entry.name)) == proc.pid:
                    return int(entry.name)
            except (OSError, ProcessLookupError):
                continue
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.01)
    raise AssertionError("no trainer rank ran an update")


def test_a_killed_rank_and_a_killed_run_both_continue_exactly(
    sft_model: Path, uninterrupted: tuple[Path, str], tmp_path: Path
) -> None:
    """Two faults in one run. A trainer rank is killed (SIGKILL) in step 3's update: the run rebuilds its
    trainer group from the step-2 checkpoint inside the job and trains step 3 again. Then the whole run
    is killed after step 3's checkpoint, and --resume finishes it. Steps 3 and 4 give exactly the
    rewards, losses and gradient norms of the uninterrupted run (optimizer state, schedule and data
    stream restored both times)."""
    run = tmp_path / "run"
    trackers = "logging.backends=[wandb, mlflow]"  # offline, and through both faults
    proc = _train(sft_model, run, trackers)
    _wait_for(run / "ckpt" / "step_000002" / "trainer_state.json", proc)
    rank = _busy_rank(proc)
    killed_at = time.monotonic()
    os.kill(rank, signal.SIGKILL)
    _wait_for(run / "ckpt" / "step_000003" / "trainer_state.json", proc)
    step3_s = time.monotonic() - killed_at
    os.killpg(proc.pid, signal.SIGKILL)  # the whole process tree, Ray actors included
    first_out = proc.communicate()[0]
    assert "rebuilding the trainer group from step_000002" in first_out, first_out
    rebuilt = next(line for line in first_out.splitlines() if "trainer group rebuilt in" in line)
    print(f"a rank killed in update 3: {rebuilt}; step 3 done {step3_s:.1f} s after the kill")
    assert "died" in first_out.split("rebuilding the trainer group")[0].splitlines()[-1]
    out = _finish(_train(sft_model, run, trackers, resume=True))
    assert "resumed from" in out and "step_000003" in out
    got = read_metrics(run / "metrics.jsonl")
    want = read_metrics(uninterrupted[0] / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # step 3 once: the lost update left no line
    assert got[2]["pipeline/trainer_restarts"] == 1 and got[2]["time/recover"] > 0
    assert got[3]["pipeline/trainer_restarts"] == 0 and "time/recover" not in got[3]  # a new process
    keys = ["reward/solver", "reward/verifier", "reward/corrector", "train/loss", "train/grad_norm", "tokens",
            "pipeline/trained_total"]  # fmt: skip
    for a, b in zip(got[2:], want[2:], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    # the trackers went on in the same runs through the rebuilt trainer group and the resume, each step
    # once: W&B in three offline parts of one run id (steps 1-2, 3, 4; a step logged under a second before
    # the SIGKILL may be missing there), MLflow in one run
    state = json.loads((run / "trackers.json").read_text())
    logs = wandb_runs(run)
    assert len(logs) == 3 and {log.stem for log in logs} == {f"run-{state['wandb']['id']}"}
    steps = [step for log in logs for step in wandb_history(log)]
    assert sorted(set(steps)) == sorted(steps) and {1, 2, 4} <= set(steps) <= {1, 2, 3, 4}, steps
    client = mlflow_client(state["mlflow"]["tracking_uri"])
    history = client.get_metric_history(state["mlflow"]["run_id"], "reward.solver")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["reward/solver"]) for r in got]


def test_a_dapo_like_parquet_and_an_aime_like_dataset_train_as_their_jsonl(
    sft_model: Path, uninterrupted: tuple[Path, str], tmp_path: Path
) -> None:
    """The same problems in two other datasets' shapes, written by pyarrow and ``datasets``: DAPO-Math's
    Parquet (the problem a chat list, the answer a string in a nested column, rows the filter leaves out
    and unusable rows between them) and AIME's ``save_to_disk`` folder (``query``/``ans_box``, a test
    split beside), the latter with the answers judged by examples/rewards/sums.py (a reward function in its
    own processes) instead of math-verify. Mapped by ``data.fields``, each trains exactly the steps of the
    JSONL run."""
    from tests.test_data_files import arith, save_aime, write_dapo

    records = arith()
    dapo = write_dapo(tmp_path / "dapo.parquet", records)
    aime = save_aime(tmp_path / "aime", records, records[:5])
    steps = 2
    want = read_metrics(uninterrupted[0] / "metrics.jsonl")[:steps]
    runs = {
        "dapo": [f"data.train_file={dapo}", "data.fields.problem=prompt",
                 "data.fields.answer=reward_model.ground_truth", "data.fields.id=extra_info.index",
                 """data.filter=['reward_model.style == "rule"']"""],
        "aime": [f"data.train_file={aime}", "data.split=train", "data.fields.problem=query",
                 "data.fields.answer=ans_box", "data.fields.id=id",
                 # the Solver's and the Corrector's answers judged by a function of the user's
                 f"algorithm.reward_functions.solver={SUMS}", f"algorithm.reward_functions.corrector={SUMS}"],
    }  # fmt: skip
    keys = ["reward/solver", "reward/verifier", "reward/corrector", "train/loss", "train/grad_norm", "tokens"]
    for name, fields in runs.items():
        run = tmp_path / name
        out = subprocess.run(
            [sys.executable, "-m", "mars_megatron.cli", "train", str(EXAMPLE), f"model.mcore_dir={sft_model}",
             f"logging.run_dir={run}", f"train.steps={steps}", "data.problems_per_step=4", *fields],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-4000:]
        if name == "dapo":
            assert f"data: {dapo}: 75 problems of 79 rows, 2 left out by the filter, 2 unusable" in out.stdout
        got = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in got] == [1, 2]
        for a, b in zip(got, want, strict=True):
            assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (name, a["step"])


def test_a_separate_policy_per_role_evaluated_during_and_after_training(
    sft_model: Path, tmp_path: Path
) -> None:
    """algorithm.policies=per_role: three models, three engines, each trained on its own role's samples.
    The run evaluates the held-out split before and after each update (each role answered by its own
    policy's engine), and `mars eval --checkpoint` evaluates the saved policies, each role by its own."""
    from PIL import Image

    run = tmp_path / "run"
    test = REPO / "examples" / "data" / "arith_test.jsonl"
    evaluation = [f"evaluation.test_file={test}", "evaluation.interval=1", "evaluation.limit=4",
                  "evaluation.samples=2"]  # fmt: skip
    trackers = ["logging.backends=[wandb, mlflow]"]  # offline: W&B's files and MLflow's store in run
    _finish(_train(sft_model, run, "algorithm.policies=per_role", "train.steps=2", *evaluation, *trackers))
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for role in ("solver", "verifier", "corrector"):
        assert records[-1][f"policy_version/{role}"] == 2
        assert records[-1][f"train/{role}/tokens"] > 0
    saved = sorted(p.name for p in (run / "ckpt" / "step_000002").iterdir() if p.is_dir())
    assert saved == ["corrector", "solver", "verifier"]
    # held-out evaluation: before training (step 0) and after each update, into eval.jsonl and metrics.jsonl
    evals = read_metrics(run / "eval.jsonl")
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        assert 0 <= r["eval/solver_acc"] <= 1 and 0 <= r["eval/system_acc"] <= 1 and r["eval/time"] > 0
    assert all(records[i]["eval/system_acc"] == evals[i + 1]["eval/system_acc"] for i in range(2))
    lines = (run / "eval" / "step_000002" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4 * 2 and all(json.loads(line)["steps"] for line in lines)
    assert Image.open(run / "rewards.png").size == (800, 750)  # with the held-out panel
    summaries = {f"eval/step_00000{s}/summary.json" for s in range(3)}
    assert_trackers_hold_the_run(run, {"config.yaml", "rewards.png", *summaries})

    out = tmp_path / "eval"
    ok(mars("eval", "--checkpoint", run / "ckpt", "--config", run / "config.yaml", "--data", test,
            "--limit", "3", "--samples", "1", "--engine", "transformers", "--out", out,
            "--checker-workers", "1", cwd=tmp_path))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == {r: str((run / "ckpt" / "step_000002" / r).resolve()) for r in saved}
    assert (
        config["prompts"] == "compact" and config["sampling"]["max_tokens"] == 24
    )  # the run's, from --config
    converted = {
        r: b"".join(f.read_bytes() for f in sorted((out / "models" / r).glob("*.safetensors"))) for r in saved
    }
    assert len(set(converted.values())) == 3  # three different trained models answered
    assert json.loads((out / "summary.json").read_text())["results"] == 3


def test_eval_of_the_trained_checkpoint_in_its_own_prompts(
    uninterrupted: tuple[Path, str], tmp_path: Path
) -> None:
    """`mars eval --prompts compact` on the trained tiny model: the Solver's prompt is the compact one
    (a few tokens, not the marsrl texts), and the model answers in the format it learned under it."""
    run = uninterrupted[0]
    out = tmp_path / "eval"
    test = REPO / "examples" / "data" / "arith_test.jsonl"
    ok(mars("eval", "--checkpoint", run / "ckpt" / "step_000004", "--prompts", "compact", "--data", test,
            "--samples", "2", "--limit", "10", "--max-tokens", "24", "--engine", "transformers", "--out", out,
            "--checker-workers", "1", cwd=tmp_path))  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["prompts"] == "compact" and summary["results"] == 20
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert max(r["steps"][0]["prompt_tokens"] for r in results) < 40  # the marsrl Solver prompt is longer
    # the model answers in the format it learned under these prompts: boxed answers, parseable verdicts
    # (this briefly trained model still guesses most sums; the accuracy is the benchmark's business)
    assert sum(r["solver_answer"] is not None for r in results) >= 18
    verdicts = [s["verdict"] for r in results for s in r["steps"] if s["role"] == "verifier"]
    assert verdicts and sum(v is not None for v in verdicts) >= 0.9 * len(verdicts)
    assert summary["prompts_too_long"] == 0


def test_trained_policy_checkpoint_exports_and_scores(
    sft_model: Path, uninterrupted: tuple[Path, str], tmp_path: Path
) -> None:
    """A policy folder of a training checkpoint is a mars checkpoint: ``mars convert mcore-to-hf`` exports
    the trained weights (not the starting ones), and ``mars score`` reads the same weights from it."""
    ckpt = uninterrupted[0] / "ckpt" / "step_000004" / "shared"
    hf = tmp_path / "hf"
    ok(mars("convert", "mcore-to-hf", ckpt, hf, cwd=tmp_path))
    trained, start = hf_logprobs(hf, TOKENS), hf_logprobs(sft_model / "hf", TOKENS)
    assert float((torch.cat(trained) - torch.cat(start)).abs().max()) > 1e-3
    scores = tmp_path / "scores.jsonl"
    ok(mars("score", "--model-dir", ckpt, "--input", write_tokens(tmp_path / "t.jsonl", TOKENS),
            "--output", scores, cwd=tmp_path))  # fmt: skip
    assert_close_to(read_logprobs(scores), trained)
