"""Check 3: the collectives rule and the HF-named weight export under NCCL (gloo in ``--cpu`` mode), in a
world of one process.

The rule (``mars_megatron/comm/collectives.py``): a tensor entering a collective is put on the device of
the group's backend, because NCCL moves only GPU tensors and gloo only host tensors; the first GPU run of
the export failed exactly there. Here the wrappers get host tensors under NCCL and must hand back GPU
tensors with the same values (the figures also record whether a raw ``dist.all_reduce`` of a host
tensor is refused under this backend: why the rule exists).

The export (``mars_megatron/conversion/model_io.py``): the weight push walks ``export_at_senders`` with the
plan ``plan_export`` resolves (``training/weight_sync.py``), HF checkpoints are written from
``export_weights``. For a dense (tied embeddings) and a MoE Qwen3 loaded from an HF checkpoint (check 1's
models, written once per run), both must give back every HF tensor bit for bit (same name, dtype, shape,
values: a copy, with nothing to round), on the collectives' device; ``WeightSender.plan`` must list
exactly those tensors. Then every parameter is changed in place (+1, one rounding in the model's dtype,
as an optimizer step changes them) and the push's export must carry the change in every tensor: it reads
the live weights, not a copy made at load time.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from tools.device_check.common import Context, Row, is_true, shared_qwen3, spawn
from tools.device_check.logprobs import model_configs

CHECK = "3 export"


def collectives_rule() -> dict[str, Any]:
    """The wrappers on host tensors under the world's backend."""
    import torch.distributed as dist

    from mars_megatron.comm import collectives

    device = collectives.comm_device(None)
    host = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    gathered = collectives.all_gather(host)
    reduced = collectives.all_reduce(host.clone())  # world of 1: the sum is the tensor itself
    values = collectives.all_reduce_values([1.5, -2.0, 3.0])
    out_devices = sorted({str(t.device) for t in [*gathered, reduced]})
    return {
        "backend": str(dist.get_backend()),
        "device": str(device),
        "out_devices": out_devices,
        "values_kept": all(torch.equal(t.cpu(), host) for t in [*gathered, reduced])
        and values == [1.5, -2.0, 3.0],
    }


def raw_host_all_reduce() -> str:
    """What a bare ``dist.all_reduce`` does with a host tensor under this backend (a figure: why the rule
    exists). Tried last in the process, after everything else, in case a backend takes it badly."""
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.ones(3))
        return "accepted"
    except Exception as e:
        return f"refused: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"


def _compare(
    exported: list[tuple[str, torch.Tensor | None]], expected: dict[str, torch.Tensor], device: torch.device
) -> dict[str, Any]:
    """How an export matches ``expected`` tensor for tensor."""
    names = [n for n, _ in exported]
    wrong, elsewhere = [], []
    for name, t in exported:
        if t is None or name not in expected:
            wrong.append(name)
            continue
        if t.device != device:
            elsewhere.append(f"{name} on {t.device}")
        ref = expected[name]
        if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(t.cpu(), ref):
            wrong.append(name)
    return {
        "tensors": len(names),
        "expected": len(expected),
        "same_names": sorted(names) == sorted(expected) and len(set(names)) == len(names),
        "equal": len(names) - len(wrong),
        "unequal": wrong[:10],
        "off_device": elsewhere[:10],
        "devices": sorted({str(t.device) for _, t in exported if t is not None}),
    }


def export_model(model_dir: str, device: torch.device) -> dict[str, Any]:
    """Load ``model_dir`` into megatron, export it both ways, change it, export again."""
    from mars_megatron.config import ParallelConfig
    from mars_megatron.conversion.hf_io import HFReader
    from mars_megatron.conversion.model_io import export_at_senders, export_weights, plan_export
    from mars_megatron.jobs import load_engine
    from mars_megatron.training.weight_sync import WeightSender

    engine = load_engine(model_dir, ParallelConfig(), dtype=None, impl="local")
    model, arch = engine.model, engine.arch
    reader = HFReader(model_dir)
    source = {n: reader.get(n) for n in reader.names()}
    reader.close()
    plan = WeightSender(arch).plan(model)
    steps = plan_export(model, arch)
    push = _compare(list(export_at_senders(model, arch, steps)), source, device)
    checkpoint = _compare(list(export_weights(model, arch, steps)), source, device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = {n: t + 1.0 for n, t in source.items()}  # the same single rounding, in the same dtype
    after = _compare(list(export_at_senders(model, arch, steps)), changed, device)
    return {
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "push": push,
        "checkpoint": checkpoint,
        "after_update": after,
        "plan_names": sorted(t.name for t in plan.tensors) == sorted(source),
        "plan_senders": sorted({t.sender for t in plan.tensors}),
        "plan_buckets": len(plan.buckets),
    }


def export_models(jobs: list[tuple[str, str]]) -> dict[str, Any]:
    """Spawned: the collectives rule, then :func:`export_model` of every ``(name, model_dir)`` (a model
    that fails gives its traceback, so the others still report)."""
    from mars_megatron.comm.collectives import comm_device
    from mars_megatron.config import ParallelConfig
    from mars_megatron.training import parallel

    parallel.init_model_parallel(ParallelConfig(), seed=0)
    out: dict[str, Any] = {"rule": collectives_rule()}
    device = comm_device(None)
    for name, model_dir in jobs:
        try:
            out[name] = export_model(model_dir, device)
        except Exception:
            out[name] = traceback.format_exc()
    out["rule"]["raw_host_all_reduce"] = raw_host_all_reduce()
    return out


def _rows(name: str, got: dict[str, Any], device: str) -> list[Row]:
    dtype = got["dtype"]
    rows = []
    for key, label in (("push", "push export (export_at_senders)"), ("checkpoint", "export_weights")):
        r = got[key]
        rows.append(
            is_true(
                CHECK,
                f"{name} {dtype}: {label} equals the HF checkpoint, tensor for tensor",
                r["same_names"] and r["equal"] == r["expected"],
                f"{r['equal']}/{r['expected']} bit-identical",
                **r,
            )
        )
    push = got["push"]
    rows.append(
        is_true(
            CHECK,
            f"{name}: every exported tensor on {device}",
            not push["off_device"] and push["devices"] == [device],
            ", ".join(push["devices"]) or "none",
            **push,
        )
    )
    after = got["after_update"]
    rows.append(
        is_true(
            CHECK,
            f"{name}: after an in-place update of every weight, the push export carries it",
            after["same_names"] and after["equal"] == after["expected"],
            f"{after['equal']}/{after['expected']} updated",
            **after,
        )
    )
    rows.append(
        is_true(
            CHECK,
            f"{name}: WeightSender.plan lists every HF tensor once, sent by rank 0",
            got["plan_names"] and got["plan_senders"] == [0],
            f"{got['plan_buckets']} bucket(s), senders {got['plan_senders']}",
            plan_names=got["plan_names"],
            plan_senders=got["plan_senders"],
            plan_buckets=got["plan_buckets"],
        )
    )
    return rows


def run(ctx: Context) -> list[Row]:
    jobs = []
    for name, (model_type, config) in model_configs(ctx.cpu).items():
        jobs.append((name, str(shared_qwen3(ctx, name, model_type, config, seed=1))))
    ctx.log(f"collectives and the export of {len(jobs)} models under {ctx.backend}")
    got = spawn(export_models, jobs, timeout_s=ctx.timeout(300))
    rule = got["rule"]
    expected = "cpu" if ctx.cpu else "cuda:0"
    rows = [
        is_true(
            CHECK,
            f"collectives under {rule['backend']}: host tensors in, results on {expected}, values kept",
            rule["backend"] == ctx.backend
            and rule["device"] == expected
            and rule["out_devices"] == [expected]
            and rule["values_kept"],
            f"{rule['backend']} → {', '.join(rule['out_devices'])}",
            **rule,
        )
    ]
    for name, _ in jobs:
        if isinstance(got[name], str):
            ctx.log(f"{name} failed:\n{got[name]}")
            last = got[name].strip().splitlines()[-1]
            rows.append(Row(CHECK, f"{name}: export", f"exception: {last}", "no exception", False))
        else:
            rows += _rows(name, got[name], expected)
    return rows
