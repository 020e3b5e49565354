"""Summary metrics over finished result records (pure: records in, a JSON-ready dict out).

pass@k is the unbiased estimator of Chen et al. (2021): with ``n`` samples of a problem of which ``c``
are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``, averaged over problems. It is reported for
k = 1, 2, 4, … up to K and for K itself. Accuracies are avg@K: the mean correctness of all samples.

The roles are also scored on their own (:func:`role_accuracy`), by what the graph says they do, because
the system beats its start role only when the deciding roles tell right from wrong and the revising
roles fix what they are told is wrong: every role that decides gets its accuracy on right and on wrong
solutions (each verdict against the truth of the solution it judged), every role after the start that
writes solutions its fix rate (a revision of a wrong solution that is right). Names come from the
graph's role names: MarsRL's are ``solver_acc``, ``roles["verifier"]``, ``roles["corrector"]``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb
from typing import Any

from mars_megatron.agents.graph import AgentGraph


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


def _tokens(records: Sequence[dict], roles: Sequence[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for role in roles:
        steps = [s for r in records for s in r["steps"] if s["role"] == role]
        output = [s["output_tokens"] for s in steps]
        prompt = [s["prompt_tokens"] for s in steps]
        out[role] = {
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


def deciding_roles(graph: AgentGraph) -> list[str]:
    """Roles a verdict is read from (scored on right and on wrong solutions), in graph order."""
    return [r.name for r in graph.roles.values() if r.decides]


def revising_roles(graph: AgentGraph) -> list[str]:
    """Roles after the start that write solutions (scored by their fix rate), in graph order."""
    return [r.name for r in graph.roles.values() if r.output == "solution" and r.name != graph.start_role]


def role_accuracy(records: Sequence[dict], graph: AgentGraph) -> dict[str, dict[str, float | int | None]]:
    """Each deciding role's accuracy on right and on wrong solutions, and each revising role's fix and
    break rates, over every call of ``records`` (results lines that carry ``solutions_correct``).

    A revision is scored against the solution last judged or reported on before it (the one it was
    asked to revise); a dropped (truncated) revision fixes nothing."""
    deciding, revising = set(deciding_roles(graph)), set(revising_roles(graph))
    judge = {r: {"right": 0, "right_ok": 0, "wrong": 0, "wrong_ok": 0} for r in deciding}
    fix = {r: {"wrong": 0, "fixed": 0, "right": 0, "broken": 0} for r in revising}
    solution_roles = {r.name for r in graph.roles.values() if r.output == "solution"}
    for r in records:
        correct = r.get("solutions_correct")
        if correct is None:  # a line written before solutions were checked one by one
            continue
        judged: int | None = None
        for step in r["steps"]:
            role = step["role"]
            if role not in solution_roles:
                if step.get("solution") is None:
                    continue
                judged = step["solution"]
                if role in judge:
                    n = judge[role]
                    if correct[judged]:
                        n["right"] += 1
                        n["right_ok"] += step["verdict"] is True
                    else:
                        n["wrong"] += 1
                        n["wrong_ok"] += step["verdict"] is not True
            elif role in fix and judged is not None:
                made = step.get("solution")
                now = made is not None and bool(correct[made])
                n = fix[role]
                if correct[judged]:
                    n["right"] += 1
                    n["broken"] += not now
                else:
                    n["wrong"] += 1
                    n["fixed"] += now
    out: dict[str, dict[str, float | int | None]] = {}
    for role in graph.roles:
        if role in judge:
            n = judge[role]
            out[role] = {
                "acc_on_right": _rate(n["right_ok"], n["right"]),
                "acc_on_wrong": _rate(n["wrong_ok"], n["wrong"]),
                "calls_on_right": n["right"],
                "calls_on_wrong": n["wrong"],
            }
        elif role in fix:
            n = fix[role]
            out[role] = {
                "fix_rate": _rate(n["fixed"], n["wrong"]),
                "break_rate": _rate(n["broken"], n["right"]),
                "calls_on_wrong": n["wrong"],
                "calls_on_right": n["right"],
            }
    return out


def summarize(
    records: Sequence[dict], problem_ids: Sequence[str], samples: int, graph: AgentGraph
) -> dict[str, Any]:
    """Metrics over the records of ``problem_ids`` with sample < ``samples``, in a fixed order (so a
    resumed run, whose file holds the same records in another order, gives the same numbers). The
    start role's own figures are named after it (MarsRL: ``solver_acc``, ``pass@k["solver"]``)."""
    first = graph.start_role
    order = {pid: i for i, pid in enumerate(problem_ids)}
    chosen = sorted(
        (r for r in records if r["problem_id"] in order and r["sample"] < samples),
        key=lambda r: (order[r["problem_id"]], r["sample"]),
    )
    by_problem: dict[str, list[dict]] = {pid: [] for pid in problem_ids}
    for r in chosen:
        by_problem[r["problem_id"]].append(r)
    by_problem = {pid: recs for pid, recs in by_problem.items() if recs}
    checks = Counter(s for r in chosen for s in (r[f"{first}_check"], r["system_check"]))
    return {
        "problems": len(problem_ids),
        "samples": samples,
        "results": len(chosen),
        "missing_results": len(problem_ids) * samples - len(chosen),
        f"{first}_acc": _mean([float(r[f"{first}_correct"]) for r in chosen]),
        "system_acc": _mean([float(r["system_correct"]) for r in chosen]),
        "pass@k": {
            first: _pass_at(by_problem, f"{first}_correct", samples),
            "system": _pass_at(by_problem, "system_correct", samples),
        },
        "accepted_rate": _mean([float(r["accepted"]) for r in chosen]),
        "roles": role_accuracy(chosen, graph),
        "stop_reasons": dict(sorted(Counter(r["stop_reason"] for r in chosen).items())),
        "tokens": _tokens(chosen, list(graph.roles)),
        "prompts_too_long": sum(s["prompt_too_long"] for r in chosen for s in r["steps"]),
        "checker": {
            "timeouts": checks["timeout"],
            "parse_errors": checks["parse_error"],
            "no_answer": checks["no_answer"],
        },
    }
