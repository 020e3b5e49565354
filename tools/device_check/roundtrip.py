"""Check 5: HF → Megatron → HF (``mars convert``'s code) on the device, bit-identical.

``hf_to_mcore`` builds the model on the GPU, fills it from the HF safetensors and saves a megatron
distributed checkpoint (torch_dist) with its manifest; ``mcore_to_hf`` verifies the manifest, loads it
through the restricted loader into a GPU model and writes HF safetensors through the export's
collectives. Nothing on the way may round, so every tensor of the result must equal the source's bit for
bit (name, dtype, shape, bytes), the config must come back unchanged and the result must load in
transformers (``mcore_to_hf`` checks its config and tokenizer). GPU: a dense Qwen3 with tied embeddings
and a MoE, both bf16; ``--cpu``: the tiny presets in fp32.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from tools.device_check.common import Context, Row, is_true, spawn

CHECK = "5 roundtrip"

GPU_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": (
        "tiny-dense",
        dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
             head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    ),
    "moe": (
        "tiny-moe",
        dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256),
    ),
}  # fmt: skip
CPU_MODELS: dict[str, tuple[str, dict[str, Any]]] = {"dense": ("tiny-dense", {}), "moe": ("tiny-moe", {})}


def convert(jobs: list[tuple[str, str, str, str]]) -> dict[str, Any]:
    """Spawned: for each ``(name, hf_dir, mcore_dir, out_dir)`` HF → Megatron → HF in this world of 1;
    per model the seconds each way, or the traceback of a failure."""
    from mars_megatron.config import ParallelConfig
    from mars_megatron.convert import hf_to_mcore, mcore_to_hf
    from mars_megatron.training import parallel

    layout = ParallelConfig()
    parallel.init_model_parallel(layout, seed=0)
    out: dict[str, Any] = {}
    for name, hf_dir, mcore_dir, out_dir in jobs:
        try:
            t0 = time.perf_counter()
            hf_to_mcore(hf_dir, mcore_dir, layout, transformer_impl="local")
            t1 = time.perf_counter()
            mcore_to_hf(mcore_dir, out_dir, layout, transformer_impl="local", progress=False)
            out[name] = {
                "to_mcore_s": t1 - t0,
                "to_hf_s": time.perf_counter() - t1,
                "model_on": str(torch.device("cuda", 0) if torch.cuda.is_available() else "cpu"),
            }
        except Exception:
            out[name] = traceback.format_exc()
    return out


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def compare(source: Path, result: Path) -> dict[str, Any]:
    """Tensor-by-tensor comparison of two HF directories (bytes, dtype, shape) and of their configs."""
    a, b = _tensors(source), _tensors(result)
    differ = [
        n
        for n in a
        if n not in b
        or a[n].dtype != b[n].dtype
        or a[n].shape != b[n].shape
        or not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))
    ]
    config_a = json.loads((source / "config.json").read_text())
    config_b = json.loads((result / "config.json").read_text())
    return {
        "tensors": len(a),
        "identical": len(a) - len(differ),
        "differ": differ[:10],
        "extra": sorted(set(b) - set(a))[:10],
        "bytes": sum(t.numel() * t.element_size() for t in a.values()),
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in a.values()}),
        "config_equal": config_a == config_b,
    }


def run(ctx: Context) -> list[Row]:
    from mars_megatron.models.presets import init_model

    models = CPU_MODELS if ctx.cpu else GPU_MODELS
    jobs = []
    for name, (preset, overrides) in models.items():
        hf = init_model(preset, ctx.workdir / f"{name}-hf", dtype=ctx.dtype_name, overrides=overrides, seed=3)
        jobs.append((name, str(hf), str(ctx.workdir / f"{name}-mcore"), str(ctx.workdir / f"{name}-back")))
    ctx.log(f"HF → Megatron → HF of {', '.join(models)} ({ctx.dtype_name}) on {ctx.device}")
    got = spawn(convert, jobs, timeout_s=ctx.timeout(300))
    rows = []
    for name, hf, _, back in jobs:
        if isinstance(got[name], str):
            ctx.log(f"{name} failed:\n{got[name]}")
            last = got[name].strip().splitlines()[-1]
            rows.append(Row(CHECK, f"{name}: conversion", f"exception: {last}", "no exception", False))
            continue
        figures = {**got[name], **compare(Path(hf), Path(back))}
        ok = (
            figures["identical"] == figures["tensors"] > 0
            and not figures["extra"]
            and figures["config_equal"]
            and figures["model_on"] == str(ctx.device)
        )
        rows.append(
            is_true(
                CHECK,
                f"{name} {ctx.dtype_name}: HF → Megatron → HF on {figures['model_on']}, every tensor and "
                "the config bit-identical",
                ok,
                f"{figures['identical']}/{figures['tensors']} tensors",
                **figures,
            )
        )
    return rows
