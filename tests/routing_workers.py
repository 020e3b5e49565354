"""What the routing-replay tests run on spawned gloo ranks (importable by module path)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mars_megatron.config import OptimizerConfig, ParallelConfig
from mars_megatron.jobs import load_engine
from mars_megatron.training import parallel


@dataclass(frozen=True)
class RoutingCase:
    """Score ``seqs`` (packed into ``pack_length``) with the checkpoint ``model_dir`` in layout
    ``(tp, pp, ep, cp)``: freely routed and replaying ``routing`` (R3); then, with ``lr``, R2: record the
    routing of the old policy, take a step replaying it, and score again freely and replaying it."""

    name: str
    model_dir: str
    seqs: list[list[int]]
    routing: list[np.ndarray]
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    pack_length: int = 64
    lr: float = 0.0
    recompute: str = "none"


def _per_sample(mbs, logprobs) -> dict[int, list[float]]:
    """Each sample's log-probs (``len - 1`` of them), keyed by its index in the global batch."""
    out = {}
    for mb, lp in zip(mbs, logprobs, strict=True):
        for i, (a, b) in zip(mb.pack.sample_ids, mb.pack.sample_spans, strict=True):
            out[i] = lp[0, a : b - 1].tolist()
    return out


def _differing(a: dict, b: dict) -> tuple[int, int]:
    """(positions whose expert set differs, positions compared) between two routing stores."""
    diff = total = 0
    for pack in a:
        for layer in a[pack]:
            x, y = a[pack][layer].sort(-1).values, b[pack][layer].sort(-1).values
            diff += int((x != y).any(-1).sum())
            total += x.shape[0]
    return diff, total


def score_with_routing(cases: list[RoutingCase], seed: int = 1234) -> dict[str, dict]:
    out = {}
    for case in cases:
        try:
            out[case.name] = _run(case, seed)
        except Exception as e:
            raise RuntimeError(f"case {case.name!r} failed: {type(e).__name__}: {e}") from e
    return out


def _run(case: RoutingCase, seed: int) -> dict:
    layout = ParallelConfig(tp=case.tp, pp=case.pp, ep=case.ep, cp=case.cp)
    parallel.init_model_parallel(layout, seed)
    engine = load_engine(
        case.model_dir,
        layout,
        dtype="float32",
        impl="local",
        optimizer=OptimizerConfig(lr=case.lr) if case.lr else None,
        recompute=case.recompute,
        routing_replay=True,
    )
    plan = engine.plan([len(s) for s in case.seqs], case.pack_length)
    free = engine.rank_packs(case.seqs, plan)
    r3 = engine.rank_packs(case.seqs, plan, routing=case.routing)
    result: dict = {"packs": len(free), "free": None, "r3": None}
    lp_free = engine.forward_logprobs(free)
    lp_r3 = engine.forward_logprobs(r3)
    result["changes"] = engine.routing_changes()  # (replayed, would have differed) in the R3 forward
    if lp_free is not None:
        result["free"], result["r3"] = _per_sample(free, lp_free), _per_sample(r3, lp_r3)
    if case.lr:
        old: dict = {}
        engine.forward_logprobs(free, record_routing=old)
        result["step"] = engine.step(free, replay_routing=old)
        after_free: dict = {}
        engine.forward_logprobs(free, record_routing=after_free)
        after_replay: dict = {}
        engine.forward_logprobs(free, record_routing=after_replay, replay_routing=old)
        result["free_vs_old"] = _differing(after_free, old)
        result["replay_vs_old"] = _differing(after_replay, old)
    return result


def perturb_routers(model_dir: str, out_dir: str, scale: float, seed: int = 0) -> None:
    """A copy of an HF checkpoint whose MoE router weights carry relative noise ``scale``: the same
    network except for which experts near-ties go to."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    g = torch.Generator().manual_seed(seed)
    for path in Path(out_dir).glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if name.endswith("mlp.gate.weight"):
                tensors[name] = t + scale * t.std() * torch.randn(t.shape, generator=g, dtype=t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})


def hf_routed_forward(model: torch.nn.Module, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One transformers forward over ``tokens``: the logits ``[len, vocab]`` and the experts its routers
    picked for every position, ``[len, moe_layers, k]`` (the reference the engines' captures are held to)."""
    picked: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in model.model.layers]
    hooks = [g.register_forward_hook(lambda m, a, out: picked.append(out[2])) for g in gates]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return logits, torch.stack(picked, dim=1)
