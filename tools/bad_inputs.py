"""Run every bad-input case (``tests/bad_inputs``) through the classifier and print the table: per category,
inputs tried, clear errors, unclear ones, inputs accepted, tracebacks, data lost and code executed.

Usage (from the repository root, with the project's venv)::

    .venv/bin/python tools/bad_inputs.py                   # every case, the table (markdown)
    .venv/bin/python tools/bad_inputs.py --list            # also one line per case that is not clear
    .venv/bin/python tools/bad_inputs.py -k "server"       # only cases whose id holds a substring

Some cases listen on 127.0.0.1 (the OpenAI-compatible server) or start a gloo process: as root the tool
re-runs itself in a network namespace with only loopback up, as ``scripts/test.sh`` does. The exit status
is 0 when every case is clear.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _in_loopback_namespace(argv: list[str]) -> int | None:
    """As root outside a namespace: the exit status of this tool re-run in one, else ``None``."""
    if os.environ.get("MARS_IN_NETNS") or os.geteuid() != 0 or not shutil.which("unshare"):
        return None
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        return None
    command = 'ip link set lo up && exec "$0" "$@"'
    env = {**os.environ, "MARS_IN_NETNS": "1"}
    return subprocess.run(
        ["unshare", "-n", "sh", "-c", command, sys.executable, __file__, *argv], env=env
    ).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default=None, help="only cases whose id holds this substring")
    parser.add_argument("--list", action="store_true", help="print every case that is not clear")
    args = parser.parse_args(argv)
    rerun = _in_loopback_namespace(sys.argv[1:] if argv is None else argv)
    if rerun is not None:
        return rerun

    import warnings

    warnings.filterwarnings("ignore")
    from tests.bad_inputs.fixtures import Fixtures
    from tests.bad_inputs.harness import OUTCOMES, all_cases, classify, workspace

    cases = [c for c in all_cases() if args.k is None or args.k in c.id]
    counts: dict[str, Counter[str]] = {}
    odd: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mars-bad-inputs-") as tmp:
        fixtures = Fixtures(Path(tmp) / "fixtures")
        try:
            for case in cases:
                with workspace(Path(tmp) / "cases", case, fixtures) as ws:
                    result = classify(case, ws)
                counts.setdefault(case.category, Counter())[result.outcome] += 1
                if result.outcome != "clear":
                    owner = f" [owner: {case.owner}]" if case.owner else ""
                    odd.append(f"{case.id}: {result.outcome}{owner}: {result.message[:300]!r}")
        finally:
            fixtures.close()
    wall = time.monotonic() - started
    header = ["category", "inputs tried", *(o if o != "clear" else "clear error" for o in OUTCOMES)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    total: Counter[str] = Counter()
    for category, counter in counts.items():
        total.update(counter)
        row = [category, str(sum(counter.values())), *(str(counter[o]) for o in OUTCOMES)]
        print("| " + " | ".join(row) + " |")
    print("| **all** | " + " | ".join([str(sum(total.values())), *(str(total[o]) for o in OUTCOMES)]) + " |")
    print(f"\n{sum(total.values())} inputs in {wall:.0f} s", file=sys.stderr)
    if args.list and odd:
        print("\nnot clear:", *odd, sep="\n")
    return 0 if not odd else 1


if __name__ == "__main__":
    sys.exit(main())
