"""tools/bench/paper_table.py's table and verdict: the mean and range over seeds, and the goal judged per seed
(the runs themselves take many minutes and are the benchmark, not a test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import paper_table


def summary(solver: float, system: float, on_wrong: float = 0.9) -> dict:
    """The fields of a `mars eval` summary.json the table reads."""
    return {
        "samples": 16,
        "problems": 100,
        "solver_acc": solver,
        "system_acc": system,
        "accepted_rate": 0.8,
        "pass@k": {"solver": {"1": solver, "16": 0.9}, "system": {"1": system, "16": 0.95}},
        "roles": {
            "verifier": {"acc_on_right": 0.95, "acc_on_wrong": on_wrong},
            "corrector": {"fix_rate": 0.3, "break_rate": 0.01},
        },
    }


def seeds(*agent_gaps: float, shared_gap: float = 0.02) -> list[dict[str, dict]]:
    return [
        {"sft": summary(0.2, 0.2), "agent": summary(0.4, 0.4 + g), "shared": summary(0.4, 0.4 + shared_gap)}
        for g in agent_gaps
    ]


def test_cells_are_the_mean_and_range_over_seeds() -> None:
    table = paper_table.markdown("held-out", seeds(0.06, 0.10, 0.08))
    gap_row = next(line for line in table.splitlines() if line.startswith("| system − Solver"))
    assert gap_row == (
        "| system − Solver (points) | +0.0 (+0.0 to +0.0) | +8.0 (+6.0 to +10.0) | +2.0 (+2.0 to +2.0) |"
    )
    assert "| V–C system, avg@16 | 20.0 (20.0 to 20.0) | 48.0 (46.0 to 50.0) |" in table
    assert "| Solver pass@16 | 90.0 (90.0 to 90.0) |" in table
    assert "| V–C system | 85.6 | 93.3 |" in table  # the paper's figures beside ours


def test_one_seed_has_no_range() -> None:
    table = paper_table.markdown("held-out", seeds(0.06))
    assert "| system − Solver (points) | +0.0 | +6.0 | +2.0 |" in table


@pytest.mark.parametrize(
    ("agent_gaps", "shared_gap", "met"),
    [
        ((0.06, 0.10, 0.08), 0.02, (True, True)),
        ((0.06, 0.04, 0.08), 0.02, (False, True)),  # one seed under 5 points
        ((0.06, 0.10, 0.08), 0.09, (True, False)),  # the shared reward does as well
    ],
)
def test_the_goal_is_judged_on_every_seed(
    agent_gaps: tuple[float, ...], shared_gap: float, met: tuple[bool, bool]
) -> None:
    lines = paper_table.verdict(seeds(*agent_gaps, shared_gap=shared_gap))
    assert [line.startswith("goal MET") for line in lines] == list(met)
