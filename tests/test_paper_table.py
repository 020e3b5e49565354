"""tools/bench/paper_table.py's table and verdict (the mean and range over seeds, the goal judged per seed)
and the runner of its commands (two side by side, each after the ones it needs; a failure keeps what
finished). The runs themselves take many minutes and are the benchmark, not a test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import paper_table
from common import Job, JobFailed, run_jobs


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


# ------------------------------------------------------------------------ the commands, side by side
def job(name: str, code: str, *after: str, writes: Path | None = None) -> Job:
    """A job that runs ``code`` in Python (the bench's jobs are `mars` commands; the runner is the same)."""
    return Job(name, (sys.executable, "-c", code), tuple(after), writes)


def stamp(log: Path, name: str, seconds: float = 0.3) -> str:
    """Code that appends "<name> start" and "<name> end" to ``log``, ``seconds`` apart."""
    return (
        f"import time; f = open({str(log)!r}, 'a'); f.write('{name} start\\n'); f.flush(); "
        f"time.sleep({seconds}); f.write('{name} end\\n')"
    )


def test_jobs_run_after_their_dependencies_two_at_a_time(tmp_path: Path) -> None:
    log = tmp_path / "order.txt"
    jobs = [
        job("warm", stamp(log, "warm")),
        job("a", stamp(log, "a"), "warm"),
        job("b", stamp(log, "b"), "warm"),
        job("c", stamp(log, "c"), "warm"),
        job("eval_a", stamp(log, "eval_a"), "a"),
    ]
    run_jobs(jobs, tmp_path / "out", lanes=2, log=lambda _: None)
    lines = log.read_text().splitlines()
    assert lines[:2] == ["warm start", "warm end"]  # nothing beside the job everything needs
    running, most = set(), 0
    for line in lines:
        name, what = line.split()
        running = running | {name} if what == "start" else running - {name}
        most = max(most, len(running))
    assert most == 2
    assert lines.index("eval_a start") > lines.index("a end")
    assert sorted((tmp_path / "out" / "done").iterdir()) == sorted(
        tmp_path / "out" / "done" / j.name for j in jobs
    )
    assert (tmp_path / "out" / "logs" / "warm.log").is_file()


def test_a_failed_job_keeps_what_finished_and_a_rerun_does_the_rest(tmp_path: Path) -> None:
    log, out, made = tmp_path / "order.txt", tmp_path / "out", tmp_path / "half_done"
    failing = f"import os, sys; os.mkdir({str(made)!r}); print('the cause, in the log'); sys.exit(3)"
    jobs = [
        job("slow", stamp(log, "slow", 1.0)),
        job("bad", failing, writes=made),
        job("after_bad", stamp(log, "after_bad"), "bad"),
    ]
    with pytest.raises(JobFailed, match=r"job bad failed; its log .*bad\.log ends:\n  the cause, in the log"):
        run_jobs(jobs, out, lanes=2, log=lambda _: None)
    assert log.read_text().splitlines() == ["slow start", "slow end"]  # it finished beside the failure
    assert [p.name for p in (out / "done").iterdir()] == ["slow"]
    assert made.is_dir()  # what the failed job left, removed before it runs again
    fixed = [jobs[0], job("bad", stamp(log, "bad"), writes=made), jobs[2]]
    said: list[str] = []
    run_jobs(fixed, out, lanes=2, log=said.append)
    assert log.read_text().splitlines()[2:] == ["bad start", "bad end", "after_bad start", "after_bad end"]
    assert said[0].startswith("1 of 3 jobs already done")
    assert not made.exists()


def test_jobs_with_unknown_dependencies_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dependencies"):
        run_jobs([job("a", "pass", "missing")], tmp_path, lanes=1)
