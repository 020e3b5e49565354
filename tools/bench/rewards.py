"""Benchmark reward checks: AnswerChecker (worker processes, timeouts) vs math-verify on a main thread.

Inputs: every reference answer of the AIME 2025 and BeyondAIME test sets (``examples/data``), each as a
boxed response that is right and one that is off by one, repeated to ``--checks`` checks. In one run it times:

- ``direct``: ``verify(parse(reference), parse(response))`` per check on this process's main thread, with
  math-verify's own (signal.alarm) timeouts — the TARGETS.md anchor;
- ``direct, same work``: the checker's per-check work (last boxed answer only, cached reference parse) on the
  main thread, to separate the pool's overhead from the work it saves;
- ``AnswerChecker``: ``check_many`` on the whole batch, with 1 worker and with one worker per CPU. Worker
  start-up is excluded (a warm-up batch runs first). Per core = checks/s divided by the worker count.

With no arguments it runs the default measurement (2,000 checks, median of 3; its inputs are in the
repository) and prints checks/s, their range and per core for each path, direct first as the baseline,
then the per-core target met or not: under 20 seconds on 2 cores.

    python tools/bench/rewards.py [--checks 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from mars_megatron.rewards import AnswerChecker, CheckerConfig, extract_boxed, normalize_reference
from mars_megatron.rewards._worker import CORRECT, _Grader

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
TARGET_PER_CORE = 600.0


def make_pairs(num_checks: int) -> list[tuple[str, str | int]]:
    references = []
    for name in ("aime2025.jsonl", "beyond_aime.jsonl"):
        references += [json.loads(line)["ans_box"] for line in (DATA / name).read_text().splitlines() if line]
    base = []
    for ref in references:
        number = int(str(ref).removesuffix("^\\circ"))
        base.append((f"So the final answer is \\boxed{{{ref}}}.", ref))
        base.append((f"So the final answer is \\boxed{{{number + 1}}}.", ref))
    return (base * (num_checks // len(base) + 1))[:num_checks]


def run_direct(pairs) -> list[bool]:
    from math_verify import parse, verify

    return [verify(parse(normalize_reference(ref)), parse(response)) for response, ref in pairs]


def run_same_work(pairs) -> list[bool]:
    grader = _Grader(timeout_s=4)
    return [
        grader.grade(extract_boxed(response), normalize_reference(ref)) == CORRECT for response, ref in pairs
    ]


def timed(fn, pairs, repeats: int) -> tuple[list[float], list[bool]]:
    times, answers = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        answers = fn(pairs)
        times.append(time.perf_counter() - start)
    return times, answers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checks", type=int, default=2000, help="checks per timed batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per path (median shown)")
    args = parser.parse_args()
    if args.checks < 1 or args.repeats < 1:
        parser.error("--checks and --repeats must be >= 1")
    pairs = make_pairs(args.checks)
    cpus = len(os.sched_getaffinity(0))

    rows = []  # (name, workers, times)
    times, expected = timed(run_direct, pairs, args.repeats)
    rows.append(("direct (main thread)", 1, times))
    times, answers = timed(run_same_work, pairs, args.repeats)
    assert answers == expected, "same-work path disagrees with math-verify direct"
    rows.append(("direct, same work", 1, times))
    for workers in sorted({1, cpus}):
        with AnswerChecker(CheckerConfig(num_workers=workers)) as checker:
            checker.check_many(pairs[:200])  # warm-up: start the workers
            times, results = timed(
                lambda p, c=checker: [r.correct for r in c.check_many(p)], pairs, args.repeats
            )
            assert results == expected, "AnswerChecker disagrees with math-verify direct"
            assert checker.counters.timeouts == 0
        rows.append((f"AnswerChecker ({workers} worker{'s' if workers > 1 else ''})", workers, times))

    anchor = args.checks / statistics.median(rows[0][2])
    print(f"{args.checks} checks ({sum(expected)} correct), median of {args.repeats}, {cpus} CPUs")
    print(f"{'path':<28} {'checks/s':>9} {'range':>15} {'per core':>9} {'vs direct/core':>15}")
    for name, workers, times in rows:
        rate = args.checks / statistics.median(times)
        low, high = args.checks / max(times), args.checks / min(times)
        per_core = rate / workers
        print(
            f"{name:<28} {rate:>9.0f} {low:>7.0f}-{high:<7.0f} {per_core:>9.0f} {per_core / anchor:>14.2f}x"
        )
    best = max(args.checks / statistics.median(t) / w for n, w, t in rows if n.startswith("AnswerChecker"))
    verdict = "meets" if best >= TARGET_PER_CORE else "misses"
    print(f"target >= {TARGET_PER_CORE:.0f} checks/s per core with timeouts enforced: {verdict} ({best:.0f})")


if __name__ == "__main__":
    main()
