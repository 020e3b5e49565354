"""Smoke test of tools/bench/train_step.py: tiny sizes, the real trainer step and the bare Megatron loop.

The benchmark itself refuses to time two loops whose gradients differ; here we check that it runs end to
end (one process, and EP2 over two ranks) and prints every figure it promises: both shapes' rows with
median milliseconds, the ratio ours/bare, a zero gradient difference, the breakdown and the verdicts.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "bench" / "train_step.py"
ROW = re.compile(
    r"^(?P<shape>short|long)\s+(?P<samples>\d+)\s+(?P<tokens>\d+)\s+(?P<packs>\d+)\s+(?P<pack>\d+)\s+"
    r"(?P<bare>[\d.]+)\s+(?P<ours>[\d.]+)\s+(?P<ratio>[\d.]+)x\s+(?P<minratio>[\d.]+)x\s+(?P<cpuratio>[\d.]+)x\s+"
    r"(?P<dgrad>\S+)$",
    re.M,
)


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT), "--quick", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _check_figures(out: str, shapes: list[str]) -> None:
    rows = {m["shape"]: m for m in ROW.finditer(out)}
    assert sorted(rows) == sorted(shapes), out
    for name, row in rows.items():
        bare, ours, ratio = float(row["bare"]), float(row["ours"]), float(row["ratio"])
        assert bare > 0 and ours > 0, out
        assert ratio == pytest.approx(ours / bare, abs=2e-3), out
        assert 0.0 <= float(row["dgrad"]) <= 1e-5, out  # the same packs, the same gradient
        assert float(row["minratio"]) > 0 and float(row["cpuratio"]) > 0, out
        assert int(row["packs"]) >= 2 and int(row["tokens"]) > 0, out
        parts = r"plan [\d.]+, rank_packs [\d.]+, loss_inputs [\d.]+, masks [\d.]+, mismatch [\d.]+;"
        assert re.search(rf"^\s+{name}: {parts}", out, re.M)
        assert re.search(rf"^target (MET|NOT MET): {name}: ours <= 1\.10x bare \({ratio:.3f}x\)$", out, re.M)


def test_one_process_prints_both_shapes() -> None:
    out = _run("--shapes", "short,long")
    assert out.startswith("model: tiny-moe, 1 process"), out
    _check_figures(out, ["short", "long"])


@pytest.mark.multiproc
def test_two_ranks_with_expert_parallelism() -> None:
    out = _run("--nproc", "2", "--shapes", "short")
    assert out.startswith("model: tiny-moe, 2 processes, EP2"), out
    _check_figures(out, ["short"])


def test_shapes_are_validated_and_samples_grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_train_step", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    with pytest.raises(ValueError, match=r"Shape\.pack_length"):
        bench.Shape("x", 4, (10, 20), (10, 20), 32)
    with pytest.raises(ValueError, match=r"Shape\.response"):
        bench.Shape("x", 4, (10, 20), (5, 2), 64)
    shape = bench.Shape("x", 20, (3, 5), (2, 4), 16)
    samples = bench.make_samples(shape, vocab=1000)

    def values(batch: list) -> list:
        return [
            {k: v.tolist() if hasattr(v, "tolist") else v for k, v in s.state().items()}
            | {"adv": s.advantage}
            for s in batch
        ]

    assert values(samples) == values(bench.make_samples(shape, vocab=1000))  # seeded
    assert all(3 <= len(s.prompt_ids) <= 5 and 2 <= s.response_len <= 4 for s in samples)
    assert all(s.advantage is not None and s.advantage != 0 for s in samples)
    # engine log-probs, so the timed step measures the mismatch as a run does
    assert all(
        s.behaviour_logprobs is not None and len(s.behaviour_logprobs) == s.response_len for s in samples
    )
    for a, b in itertools.pairwise(samples):  # GRPO groups share one prompt
        assert (a.group_id == b.group_id) == (a.prompt_ids.tolist() == b.prompt_ids.tolist())
