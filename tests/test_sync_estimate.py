"""`mars plan`'s weight-sync estimate: the formula by hand, the recipes against the issue's targets, and
the CLI printing it with the bandwidth it assumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mars_megatron.launch import plan_command
from mars_megatron.launch.planner import Layout, PlanError, param_counts, resolve_model
from mars_megatron.launch.sync_estimate import Links, estimate_sync

REPO = Path(__file__).resolve().parents[1]


def _parser():
    import argparse

    p = argparse.ArgumentParser()
    plan_command.add_arguments(p)
    return p


def test_the_formula_by_hand() -> None:
    arch = resolve_model("qwen3-30b-a3b")
    c = param_counts(arch)
    total = c.total * 2  # bf16
    links = Links(nic_gbps=400, nics_per_node=8, efficiency=0.5)
    e = estimate_sync(arch, Layout(tp=1, pp=1, ep=1), 1, one_node=False, links=links)
    assert e.bytes == total and e.senders == 1 and e.gather_s == 0  # tp 1: nothing to gather
    assert e.wire_s == pytest.approx(total / (0.5 * 400e9))  # 8 x 400 Gb/s = 400 GB/s
    assert e.load_s == pytest.approx(total / 1500e9)
    one_nic = estimate_sync(arch, Layout(), 1, one_node=False, links=Links(nics_per_node=1, efficiency=0.5))
    assert one_nic.wire_s == pytest.approx(8 * e.wire_s)
    node = estimate_sync(arch, Layout(), 1, one_node=True, links=links)
    assert node.wire_s == pytest.approx(total / (0.5 * 450e9))  # NVLink carries it on one node


def test_senders_and_gathers_follow_the_layout() -> None:
    arch = resolve_model("qwen3-30b-a3b")
    e = estimate_sync(arch, Layout(tp=4, pp=2, cp=4, ep=8, etp=1), 4, one_node=False)
    assert e.senders == 16  # one per stage and expert-parallel rank
    flat = estimate_sync(arch, Layout(tp=1, pp=2, ep=8, etp=1), 4, one_node=False)
    assert e.gather_s > 0 and flat.gather_s == 0 and e.wire_s == flat.wire_s
    assert e.load_s * 4 == pytest.approx(estimate_sync(arch, Layout(), 1, one_node=False).load_s)


@pytest.mark.parametrize(
    ("recipe", "gpus", "target_s"),
    [("examples/qwen3_30b_a3b.yaml", 64, 1.0), ("examples/qwen3_235b_a22b.yaml", 256, 10.0)],
)
def test_recipes_meet_the_targets_on_paper(
    recipe: str, gpus: int, target_s: float, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(REPO)
    argv = ["--config", recipe, "--gpus", str(gpus), "--rollout-seqs", "4", "--json"]
    plan_command.run(_parser().parse_args(argv))
    sync = json.loads(capsys.readouterr().out)["weight_sync"]
    assert 0 < sync["seconds"] <= target_s
    assert sync["links"]["nic_gbps"] == 400 and sync["links"]["nics_per_node"] == 8
    plan_command.run(_parser().parse_args(argv[:-1]))
    out = capsys.readouterr().out
    assert f"weight sync per update: {sync['seconds']:.2f} s on paper" in out
    assert "8 x 400 Gb/s NICs per node = 400 GB/s x 0.7 efficiency" in out
    assert "NeMo-RL NCCL refit, Qwen3-30B, H100: 0.74-1.0 s" in out


def test_bad_link_options_name_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    argv = ["--config", "examples/qwen3_30b_a3b.yaml", "--gpus", "64", "--nics-per-node", "0"]
    with pytest.raises(PlanError, match="nics_per_node must be >= 1") as err:
        plan_command.run(_parser().parse_args(argv))
    assert err.value.path == "--nic-gbps/--nics-per-node"
