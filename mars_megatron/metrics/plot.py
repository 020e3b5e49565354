"""``rewards.png``: each agent's mean reward against the training step, optionally beside other runs.

One line per ``reward/<role>`` metric, in the order the run logs its graph's roles, in a fixed colour each.
Rewards are noisy from step to step, so with more than a few points the raw values are
drawn faint and a trailing moving average solid. Other runs (``compare``; e.g. the
``algorithm.reward=shared`` ablation) reuse the role colours with dashed, dotted, … lines. When the run
evaluated on held-out problems (``eval.jsonl``), a second panel draws the system's accuracy against its
first solution's alone (MarsRL: the Solver's): the paper's comparison, step by step.

matplotlib is imported inside the functions and drawn on an Agg canvas directly (no pyplot, no global
backend switch), so this works headless, in threads and without slowing ``import mars_megatron``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mars_megatron.metrics.records import METRICS_FILE, REWARD_PREFIX, read_metrics

_COMPARE_STYLES = ("--", ":", "-.")


def reward_keys(*runs: Sequence[dict[str, Any]]) -> list[str]:
    """The ``reward/*`` keys found in any record of ``runs``, in the order first logged (a run logs its
    graph's roles in the graph's order)."""
    found = (key for records in runs for record in records for key in record if key.startswith(REWARD_PREFIX))
    return list(dict.fromkeys(found))


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean of the last ``window`` values at each position (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def auto_window(num_points: int) -> int:
    """Smoothing window for ``num_points`` points: a tenth of the run, between 1 and 50."""
    return max(1, min(50, num_points // 10))


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``; missing, null and non-finite values are left out."""
    points = [
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and math.isfinite(r[key])
    ]
    points.sort()
    return [s for s, _ in points], [v for _, v in points]


def plot_rewards(
    records: Sequence[dict[str, Any]],
    out_png: str | Path,
    *,
    title: str | None = None,
    compare: dict[str, Sequence[dict[str, Any]]] | None = None,
    label: str | None = None,
    window: int | None = None,
    evals: Sequence[dict[str, Any]] | None = None,
) -> Path:
    """Draw the ``reward/*`` curves of ``records`` (and of each ``compare`` run, dashed) to ``out_png``.

    ``evals``: the run's held-out evaluations (``eval.jsonl`` records), drawn in a second panel.
    ``label`` names this run in the legend when runs are compared. ``window``: moving-average length
    (None: :func:`auto_window`; 1: raw values only). The file is written to a temporary name and renamed,
    so a reader (or a kill) never sees half a PNG. Raises ``ValueError`` when no run has a reward metric.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    compare = dict(compare or {})
    runs: list[tuple[str | None, Sequence[dict[str, Any]], str]] = [(label, records, "-")]
    for i, (name, other) in enumerate(compare.items()):
        runs.append((name, other, _COMPARE_STYLES[i % len(_COMPARE_STYLES)]))
    keys = reward_keys(*(run for _, run, _ in runs))
    if not keys:
        raise ValueError("no reward/* metrics to plot")
    colours = {key: f"C{i}" for i, key in enumerate(keys)}

    held_out = [(key, name) for key, name in _eval_curves(evals or []) if _series(evals or [], key)[0]]
    fig = Figure(figsize=(8, 7.5 if held_out else 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 1, 1) if held_out else fig.add_subplot()
    low, high, smoothed = 0.0, 1.0, False
    for name, run, style in runs:
        for key in keys:
            steps, values = _series(run, key)
            if not steps:
                continue
            low, high = min(low, *values), max(high, *values)
            role = key.removeprefix(REWARD_PREFIX)
            legend = f"{role} ({name})" if name and compare else role
            size = window if window is not None else auto_window(len(values))
            if size > 1:
                smoothed = True
                ax.plot(steps, values, style, color=colours[key], alpha=0.25, linewidth=1)
                values = moving_average(values, size)
            ax.plot(steps, values, style, color=colours[key], linewidth=2, label=legend)
    margin = 0.02 * (high - low)
    ax.set_ylim(low - margin, high + margin)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward" + (" (faint: per step; solid: moving average)" if smoothed else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    if title:
        ax.set_title(title)
    if held_out:
        _plot_held_out(fig.add_subplot(2, 1, 2), evals or [], held_out)
    fig.tight_layout()

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(f".{out_png.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out_png)
    return out_png


def _eval_curves(evals: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The system's held-out accuracy and its first solution's alone (``eval/<start role>_acc``)."""
    alone = sorted({k for r in evals for k in r if k.startswith("eval/") and k.endswith("_acc")} - {SYSTEM})
    return [
        (SYSTEM, "system"),
        *((k, f"{k.removeprefix('eval/').removesuffix('_acc')} alone") for k in alone),
    ]


SYSTEM = "eval/system_acc"


def _plot_held_out(ax: Any, evals: Sequence[dict[str, Any]], curves: Sequence[tuple[str, str]]) -> None:
    for key, name in curves:
        steps, values = _series(evals, key)
        style = "-o" if key == "eval/system_acc" else "--s"
        ax.plot(
            steps, values, style, color="k" if key == "eval/system_acc" else "0.5", label=name, markersize=4
        )
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (avg@K)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def plot_runs(run_dirs: Sequence[str | Path], labels: Sequence[str], out_png: str | Path) -> Path:
    """One figure of several runs' ``metrics.jsonl``: the first run solid, the others dashed, dotted, …"""
    if not run_dirs:
        raise ValueError("plot_runs: no run directories given")
    if len(labels) != len(run_dirs):
        raise ValueError(f"plot_runs: {len(run_dirs)} run directories but {len(labels)} labels")
    if len(set(labels)) != len(labels):
        raise ValueError(f"plot_runs: labels must be distinct, got {list(labels)}")
    runs = [read_metrics(Path(d) / METRICS_FILE) for d in run_dirs]
    compare = dict(zip(labels[1:], runs[1:], strict=True))
    return plot_rewards(runs[0], out_png, label=labels[0], compare=compare or None)
