"""Summary metrics over finished result records (pure: records in, a JSON-ready dict out).

pass@k is the unbiased estimator of Chen et al. (2021): with ``n`` samples of a problem of which ``c``
are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, averaged over problems. It is reported for
k = 1, 2, 4, … up to K and for K itself. Accuracies are avg@K: the mean correctness of all samples.

The roles are also scored on their own (:func:`role_accuracy`), because the system beats its Solver
only when the Verifier tells right from wrong and the Corrector fixes what it is told is wrong: the
Verifier's accuracy on right and on wrong solutions (each verdict against the truth of the solution it
judged) and the Corrector's fix rate (a correction of a wrong solution that is right).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb
from typing import Any

from mars_megatron.agents.roles import Role


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def k_values(samples: int) -> list[int]:
    """1, 2, 4, … up to ``samples``, and ``samples`` itself."""
    ks = [1 << i for i in range(samples.bit_length()) if 1 << i <= samples]
    return ks if ks[-1] == samples else [*ks, samples]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _pass_at(records_by_problem: dict[str, list[dict]], field: str, samples: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in k_values(samples):
        scores = [
            pass_at_k(len(recs), sum(r[field] for r in recs), k)
            for recs in records_by_problem.values()
            if len(recs) >= k
        ]
        out[str(k)] = _mean(scores)
    return out


def _tokens(records: Sequence[dict]) -> dict[str, dict[str, Any]]:
    out = {}
    for role in Role:
        steps = [s for r in records for s in r["steps"] if s["role"] == role.value]
        output = [s["output_tokens"] for s in steps]
        prompt = [s["prompt_tokens"] for s in steps]
        out[role.value] = {
            "calls": len(steps),
            "output_total": sum(output),
            "output_mean": _mean(output),
            "prompt_total": sum(prompt),
            "prompt_mean": _mean(prompt),
            "truncated": sum(s["truncated"] for s in steps),
        }
    return out


def _rate(hits: int, total: int) -> float | None:
    return hits / total if total else None


def role_accuracy(records: Sequence[dict]) -> dict[str, dict[str, float | int | None]]:
    """The Verifier's accuracy on right and on wrong solutions, and the Corrector's fix and break rates,
    over every call of ``records`` (results lines that carry ``solutions_correct``)."""
    v_right = v_right_ok = v_wrong = v_wrong_ok = 0
    c_wrong = c_fixed = c_right = c_broken = 0
    for r in records:
        correct = r.get("solutions_correct")
        if correct is None:  # a line written before solutions were checked one by one
            continue
        judged: int | None = None
        for step in r["steps"]:
            if step["role"] == Role.VERIFIER.value and step.get("solution") is not None:
                judged = step["solution"]
                if correct[judged]:
                    v_right += 1
                    v_right_ok += step["verdict"] is True
                else:
                    v_wrong += 1
                    v_wrong_ok += step["verdict"] is not True
            elif step["role"] == Role.CORRECTOR.value and judged is not None:
                made = step.get("solution")
                now = made is not None and bool(
                    correct[made]
                )  # a dropped (truncated) correction fixes nothing
                if correct[judged]:
                    c_right += 1
                    c_broken += not now
                else:
                    c_wrong += 1
                    c_fixed += now
    return {
        "verifier": {
            "acc_on_right": _rate(v_right_ok, v_right),
            "acc_on_wrong": _rate(v_wrong_ok, v_wrong),
            "calls_on_right": v_right,
            "calls_on_wrong": v_wrong,
        },
        "corrector": {
            "fix_rate": _rate(c_fixed, c_wrong),
            "break_rate": _rate(c_broken, c_right),
            "calls_on_wrong": c_wrong,
            "calls_on_right": c_right,
        },
    }


def summarize(records: Sequence[dict], problem_ids: Sequence[str], samples: int) -> dict[str, Any]:
    """Metrics over the records of ``problem_ids`` with sample < ``samples``, in a fixed order (so a
    resumed run, whose file holds the same records in another order, gives the same numbers)."""
    order = {pid: i for i, pid in enumerate(problem_ids)}
    chosen = sorted(
        (r for r in records if r["problem_id"] in order and r["sample"] < samples),
        key=lambda r: (order[r["problem_id"]], r["sample"]),
    )
    by_problem: dict[str, list[dict]] = {pid: [] for pid in problem_ids}
    for r in chosen:
        by_problem[r["problem_id"]].append(r)
    by_problem = {pid: recs for pid, recs in by_problem.items() if recs}
    checks = Counter(s for r in chosen for s in (r["solver_check"], r["system_check"]))
    return {
        "problems": len(problem_ids),
        "samples": samples,
        "results": len(chosen),
        "missing_results": len(problem_ids) * samples - len(chosen),
        "solver_acc": _mean([float(r["solver_correct"]) for r in chosen]),
        "system_acc": _mean([float(r["system_correct"]) for r in chosen]),
        "pass@k": {
            "solver": _pass_at(by_problem, "solver_correct", samples),
            "system": _pass_at(by_problem, "system_correct", samples),
        },
        "accepted_rate": _mean([float(r["accepted"]) for r in chosen]),
        "roles": role_accuracy(chosen),
        "stop_reasons": dict(sorted(Counter(r["stop_reason"] for r in chosen).items())),
        "tokens": _tokens(chosen),
        "prompts_too_long": sum(s["prompt_too_long"] for r in chosen for s in r["steps"]),
        "checker": {
            "timeouts": checks["timeout"],
            "parse_errors": checks["parse_error"],
            "no_answer": checks["no_answer"],
        },
    }
