"""Run metrics against the real writers: metrics.jsonl, TensorBoard events read back, matplotlib PNGs."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mars_megatron.metrics import (
    METRICS_FILE,
    REWARDS_PNG,
    TENSORBOARD_DIR,
    MetricsSink,
    moving_average,
    plot_rewards,
    plot_runs,
    read_metrics,
    reward_keys,
)

ROLES = ("solver", "verifier", "corrector")


def step_metrics(step: int, offset: float = 0.0) -> dict[str, float | int]:
    return {
        "reward/solver": 0.1 * step + offset,
        "reward/verifier": 0.5 + offset,
        "reward/corrector": 1.0 - 0.1 * step - offset,
        "samples/solver": 8,
        "samples/verifier": 4,
        "samples/corrector": 2,
        "tokens": 1000 * step,
        "time/step": 0.25,
        "policy_version": step,
    }


def tb_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    acc.Reload()
    return [(event.step, event.value) for event in acc.Scalars(tag)]


def strict_json(line: str) -> dict:
    def reject(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant} in {line!r}")

    return json.loads(line, parse_constant=reject)


def assert_png(path: Path) -> Image.Image:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
    image = Image.open(path)
    image.load()
    assert image.size == (800, 450)
    colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50  # curves, text and legend, not a blank canvas
    return image


def test_log_writes_jsonl_tensorboard_and_plot(tmp_path: Path) -> None:
    with MetricsSink(tmp_path, tensorboard=True, total_steps=4, progress=False) as sink:
        for step in range(1, 5):
            sink.log(step, step_metrics(step))

    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [strict_json(line) for line in lines] == [{"step": s, **step_metrics(s)} for s in range(1, 5)]
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": s, **step_metrics(s)} for s in range(1, 5)]
    for tag in step_metrics(1):
        expected = [(s, float(step_metrics(s)[tag])) for s in range(1, 5)]
        got = tb_scalars(tmp_path, tag)
        assert [s for s, _ in got] == [s for s, _ in expected], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    assert_png(tmp_path / REWARDS_PNG)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_non_finite_values_are_null_in_json_and_nan_in_tensorboard(tmp_path: Path) -> None:
    with MetricsSink(tmp_path, tensorboard=True, total_steps=3, progress=False) as sink:
        sink.log(1, {"reward/solver": 0.5, "loss": 1.0})
        sink.log(2, {"reward/solver": float("nan"), "loss": float("inf")})
        sink.log(3, {"reward/solver": 0.75, "loss": -float("inf")})

    text = (tmp_path / METRICS_FILE).read_text()
    records = [strict_json(line) for line in text.splitlines()]
    assert records[1] == {"step": 2, "reward/solver": None, "loss": None}
    assert records[2] == {"step": 3, "reward/solver": 0.75, "loss": None}
    values = [v for _, v in tb_scalars(tmp_path, "reward/solver")]
    assert values[0] == 0.5 and math.isnan(values[1]) and values[2] == 0.75
    assert [v for _, v in tb_scalars(tmp_path, "loss")][1:] == [math.inf, -math.inf]
    assert_png(tmp_path / REWARDS_PNG)  # the null point is left out of the curve, not a crash


def test_resume_drops_steps_after_checkpoint_in_jsonl_and_tensorboard(tmp_path: Path) -> None:
    with MetricsSink(tmp_path, tensorboard=True, total_steps=6, progress=False) as sink:
        for step in range(1, 6):
            sink.log(step, step_metrics(step))
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 6, "reward/sol')  # the kill cut this write short

    with pytest.warns(UserWarning, match=rf"{METRICS_FILE}:6: dropping a cut-off last line"):
        sink = MetricsSink(tmp_path, tensorboard=True, total_steps=6, resume_step=3, progress=False)
    with sink:
        assert sink.dropped_lines == 3  # steps 4 and 5, and the cut-off step 6
        assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3]
        with pytest.raises(ValueError, match="step 3 is not after the last logged step 3"):
            sink.log(3, step_metrics(3))
        for step in range(4, 7):
            sink.log(step, step_metrics(step, offset=0.05))

    expected = [step_metrics(s) for s in (1, 2, 3)] + [step_metrics(s, 0.05) for s in (4, 5, 6)]
    records = read_metrics(tmp_path / METRICS_FILE)
    assert records == [{"step": s, **m} for s, m in zip(range(1, 7), expected, strict=True)]
    got = tb_scalars(tmp_path, "reward/solver")
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in got] == pytest.approx([m["reward/solver"] for m in expected], rel=1e-6)


def test_fresh_start_replaces_old_metrics_and_resume_keeps_earlier_steps(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    with MetricsSink(tmp_path, tensorboard=False, total_steps=2, resume_step=2, progress=False) as sink:
        assert sink.dropped_lines == 0 and [r["step"] for r in sink.records] == [1, 2]
    with MetricsSink(tmp_path, tensorboard=False, total_steps=2, progress=False) as sink:
        assert sink.dropped_lines == 2
        sink.log(1, {"loss": 7.0})
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 1, "loss": 7.0}]
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    assert not (tmp_path / REWARDS_PNG).exists()  # no reward/* metrics, no plot


def test_bad_lines_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "loss": 1.0}\n\n{"step": 2, loss}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}:3: not valid JSON"):
        read_metrics(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}:2: expected a JSON object, got list"):
        read_metrics(path)
    path.write_text('{"step": 1}\n{"step": "2"}\n')
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}:2: no integer 'step'"):
        read_metrics(path)
    # A bad line in the middle is not a cut-off write: resuming refuses rather than silently losing steps.
    path.write_text('{"step": 1}\n{"step": 2, loss}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}:2"):
        MetricsSink(tmp_path, tensorboard=False, total_steps=3, resume_step=3, progress=False)


def test_log_rejects_bad_input(tmp_path: Path) -> None:
    import numpy as np
    import torch

    with MetricsSink(tmp_path, tensorboard=False, total_steps=5, progress=False) as sink:
        with pytest.raises(ValueError, match="must not contain 'step'"):
            sink.log(1, {"step": 1})
        with pytest.raises(TypeError, match="metric 'name': str 'x' is not a number"):
            sink.log(1, {"name": "x"})
        with pytest.raises(TypeError, match="metric 'vec'"):
            sink.log(1, {"vec": torch.ones(2)})
        sink.log(2, {"a": np.float32(0.5), "b": torch.tensor(3), "c": True, "d": np.int64(4)})
        with pytest.raises(ValueError, match="step 2 is not after"):
            sink.log(2, {"a": 1.0})
    assert read_metrics(tmp_path / METRICS_FILE) == [{"step": 2, "a": 0.5, "b": 3, "c": 1, "d": 4}]
    with pytest.raises(RuntimeError, match="after close"):
        sink.log(3, {"a": 1.0})
    for kwargs, field in (({"total_steps": -1}, "total_steps"), ({"plot_every": -1}, "plot_every")):
        with pytest.raises(ValueError, match=field):
            MetricsSink(tmp_path, tensorboard=False, progress=False, **{"total_steps": 1, **kwargs})


def test_plot_every_and_final_plot_at_close(tmp_path: Path) -> None:
    png = tmp_path / REWARDS_PNG
    with MetricsSink(tmp_path, tensorboard=False, total_steps=3, progress=False, plot_every=2) as sink:
        sink.log(1, step_metrics(1))
        assert not png.exists()
        sink.log(2, step_metrics(2))
        assert png.exists()
        first = png.read_bytes()
        sink.log(3, step_metrics(3))
        assert png.read_bytes() == first
    assert png.read_bytes() != first  # close() drew step 3
    assert_png(png)


def test_progress_bar_shows_rewards_and_starts_at_resume_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with MetricsSink(tmp_path, tensorboard=False, total_steps=10, resume_step=2, plot_every=0) as sink:
        assert "2/10" in terminal.getvalue()
        sink.log(4, {"reward/solver": 0.5, "reward/verifier": float("nan"), "reward/corrector": 1.0})
    output = terminal.getvalue()
    assert "4/10" in output and "S 0.50 V nan C 1.00" in output

    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    with MetricsSink(tmp_path / "q", tensorboard=False, total_steps=10, progress=False) as sink:
        sink.log(1, {"reward/solver": 0.5})
    assert quiet.getvalue() == ""


def test_plot_helpers_by_hand() -> None:
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([1.0, 2.0, 3.0], 5) == [1.0, 1.5, 2.0]
    assert moving_average([2.0, 4.0], 1) == [2.0, 4.0]
    with pytest.raises(ValueError, match="window"):
        moving_average([1.0], 0)
    records = [
        {"step": 1, "reward/extra": 1, "reward/corrector": 0, "loss": 2},
        {"step": 2, "reward/solver": 1},
    ]
    # in the order first logged: a run logs its graph's roles in the graph's order
    assert reward_keys(records, [{"step": 1, "reward/verifier": 0}]) == [
        "reward/extra",
        "reward/corrector",
        "reward/solver",
        "reward/verifier",
    ]


def test_plot_runs_compares_two_runs(tmp_path: Path) -> None:
    runs = []
    for name, offset in (("mars", 0.0), ("shared", 0.2)):
        sink = MetricsSink(tmp_path / name, tensorboard=False, total_steps=30, progress=False, plot_every=0)
        with sink:
            for step in range(1, 31):
                sink.log(step, {f"reward/{role}": min(1.0, 0.02 * step + offset) for role in ROLES})
        runs.append(tmp_path / name)

    both = plot_runs([str(d) for d in runs], ["mars", "shared"], tmp_path / "out" / "both.png")
    single = plot_runs([runs[0]], ["mars"], tmp_path / "single.png")
    assert both == tmp_path / "out" / "both.png"
    assert_png(both)
    assert_png(single)
    assert both.read_bytes() != single.read_bytes()
    with pytest.raises(ValueError, match="2 run directories but 1 labels"):
        plot_runs(runs, ["mars"], tmp_path / "x.png")
    with pytest.raises(FileNotFoundError, match=r"missing/metrics\.jsonl"):
        plot_runs([tmp_path / "missing"], ["x"], tmp_path / "x.png")
    with pytest.raises(ValueError, match="no reward"):
        plot_rewards([{"step": 1, "loss": 1.0}], tmp_path / "x.png")


def test_held_out_evaluations_go_to_eval_jsonl_tensorboard_and_a_second_panel(tmp_path: Path) -> None:
    """Evaluations: eval.jsonl (step 0 = before training), TensorBoard once per step (not twice though the
    trainer also puts them in metrics.jsonl), a taller plot with the held-out panel, and a resume that drops
    the evaluations after its checkpoint."""
    evals = {
        0: {"eval/solver_acc": 0.3, "eval/system_acc": 0.25},
        2: {"eval/solver_acc": 0.5, "eval/system_acc": 0.6},
    }
    with MetricsSink(tmp_path, tensorboard=True, total_steps=3, progress=False) as sink:
        sink.log_eval(0, evals[0])
        for step in range(1, 4):
            extra = evals.get(step, {})
            if extra:
                sink.log_eval(step, extra)
            sink.log(step, {**step_metrics(step), **extra})
        with pytest.raises(ValueError, match="evaluation of step 2 is not after the last one logged"):
            sink.log_eval(2, evals[2])
    assert read_metrics(tmp_path / "eval.jsonl") == [{"step": s, **m} for s, m in evals.items()]
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3]
    assert read_metrics(tmp_path / METRICS_FILE)[1]["eval/system_acc"] == 0.6
    assert tb_scalars(tmp_path, "eval/system_acc") == [(0, pytest.approx(0.25)), (2, pytest.approx(0.6))]
    image = Image.open(tmp_path / REWARDS_PNG)
    assert image.size == (800, 750)  # the held-out panel below the rewards

    with MetricsSink(tmp_path, tensorboard=False, total_steps=3, resume_step=1, progress=False) as sink:
        assert [r["step"] for r in sink.eval_records] == [0]
    assert [r["step"] for r in read_metrics(tmp_path / "eval.jsonl")] == [0]


def test_a_run_without_evaluations_writes_no_eval_file(tmp_path: Path) -> None:
    with MetricsSink(tmp_path, tensorboard=False, total_steps=1, progress=False) as sink:
        sink.log(1, step_metrics(1))
    assert not (tmp_path / "eval.jsonl").exists()
    assert Image.open(tmp_path / REWARDS_PNG).size == (800, 450)
