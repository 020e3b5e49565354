"""Check 6 of the device check (``tools/device_check/speed.py``): its ``--cpu`` mode end to end (tiny dense
and MoE models, the trainer's step against the bare Megatron-Core loop, two pack lengths), and the rows it
derives on a GPU from measured values: MFU against the card's nominal peak, the planner's error against
the allocator's peak, the ``mars plan`` command the row names."""

from __future__ import annotations

import io
import json
import math
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from tools.device_check import speed
from tools.device_check.common import Context


def _ctx(workdir: Path, cpu: bool = True) -> Context:
    return Context(cpu=cpu, device=torch.device("cpu"), dtype=torch.float32, workdir=workdir, log=print)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    workdir = tmp_path_factory.mktemp("speed")
    return speed.run(_ctx(workdir)), workdir


@pytest.mark.multiproc
def test_cpu_mode_times_both_models_at_both_pack_lengths(cpu_run: tuple[list, Path]) -> None:
    rows, _ = cpu_run
    assert len(rows) == 12 and all(r.passed for r in rows), [r for r in rows if not r.passed]
    for k, name in enumerate(["dense 64", "dense 128", "moe 64", "moe 128"]):
        ratio, throughput, memory = rows[3 * k : 3 * k + 3]
        assert all(r.what.startswith(name + ":") for r in (ratio, throughput, memory))
        assert 0 < ratio.figures["ratio"] <= speed.RATIO_BOUND["cpu"]
        assert ratio.figures["dgrad"] <= 1e-5  # fp32: both loops compute the same gradient
        assert len(ratio.figures["ours_s"]) == len(ratio.figures["bare_s"]) == 2
        assert throughput.figures["tokens_per_s"] > 0 and throughput.figures["mfu"] is None  # no CPU peak
        assert memory.value.startswith("n/a on CPU") and memory.figures["planned_bytes"] > 0


@pytest.mark.multiproc
def test_the_memory_row_names_the_mars_plan_command_that_predicts_it(cpu_run: tuple[list, Path]) -> None:
    from mars_megatron.cli import main

    rows, _ = cpu_run
    memory = rows[5]  # dense 128
    argv = shlex.split(memory.figures["command"])
    assert argv[:2] == ["mars", "plan"]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([*argv[1:], "--json"]) == 0
    (fit,) = json.loads(out.getvalue())["fitting"]
    assert fit["gib"]["train"] == pytest.approx(memory.figures["planned_bytes"] / 2**30, abs=6e-4)


def test_gpu_rows_from_measured_values(cpu_run: tuple[list, Path]) -> None:
    """On the card the memory row compares the allocator's peak with the plan (±10 %), and MFU divides
    the model FLOPs per second by the card's nominal bf16 peak."""
    from mars_megatron.launch.planner import param_counts
    from mars_megatron.models.hf_config import load_hf_config

    _, workdir = cpu_run
    model = workdir / "speed" / "dense"
    arch = load_hf_config(model)
    shape = speed.plan_for(True).shapes[1]
    predicted, _, _ = speed.planned(model, shape.pack_length)
    lengths = [100, 28, 64]
    cpu_s = {"ours_cpu": [0.4, 0.5], "bare_cpu": [0.2, 0.2]}
    got = {"times": {"ours": [0.5, 0.6], "bare": [0.5, 0.5], **cpu_s}, "grad_diff": 1e-4, "grad_scale": 1.0,
           "lengths": lengths, "packs": 3, "pack_tokens": 384, "state_bytes": predicted // 2,
           "breakdown_s": {"masks": 0.01}}  # fmt: skip
    ctx = _ctx(workdir, cpu=False)
    near = speed.shape_rows(ctx, "dense", arch, model, shape, {**got, "peak_bytes": round(predicted / 1.05)},
                            "NVIDIA H100 80GB HBM3")  # fmt: skip
    ratio, throughput, memory = near
    assert ratio.passed and ratio.figures["ratio"] == pytest.approx(1.1)  # medians 0.55 / 0.5
    assert ratio.figures["ours_cpu_s"] == [0.4, 0.5] and ratio.figures["breakdown_s"] == {"masks": 0.01}
    flops = 6 * param_counts(arch).matmul_active * sum(lengths)
    flops += 6 * arch.num_layers * arch.num_attention_heads * arch.head_dim * sum(n * n for n in lengths)
    assert throughput.figures["mfu"] == pytest.approx(flops / 0.55 / 989e12)
    assert memory.passed and memory.figures["error_pct"] == pytest.approx(5.0, abs=0.01)
    far = speed.shape_rows(ctx, "dense", arch, model, shape, {**got, "peak_bytes": 2 * predicted}, "cpu")
    assert not far[2].passed and far[2].figures["error_pct"] == pytest.approx(-50.0)
    assert far[1].figures["mfu"] is None  # not a card with a known peak
    slow = {**got, "times": {"ours": [0.6, 0.6], "bare": [0.5, 0.5], **cpu_s}, "peak_bytes": predicted}
    assert not speed.shape_rows(ctx, "dense", arch, model, shape, slow, "cpu")[0].passed  # 1.2x


def test_peak_flops_by_card_name() -> None:
    assert speed.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert speed.peak_flops("NVIDIA H200") == 989e12
    assert speed.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert speed.peak_flops("NVIDIA H100 NVL") == speed.peak_flops("NVIDIA H200 NVL") == 835e12
    assert speed.peak_flops("NVIDIA A100-SXM4-80GB") is None and speed.peak_flops("cpu") is None
    assert math.isfinite(speed.peak_flops("NVIDIA GH200 480GB") or math.nan)
