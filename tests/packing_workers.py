"""Module-level worker for tests/test_packing.py: a tiny megatron MoE on CPU scores samples packed into one
sequence (block-diagonal causal mask) and each sample alone. Spawned via ``parallel.launch``."""

from __future__ import annotations

import torch

from mars_megatron.config import ParallelConfig
from mars_megatron.conversion.model_io import SeededInit, load_weights
from mars_megatron.models.hf_config import parse_hf_config
from mars_megatron.training import parallel
from mars_megatron.training.model_provider import build_model
from mars_megatron.training.packing import build_pack

HF_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 200, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 48, "max_position_embeddings": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True,
    "mlp_only_layers": [0], "router_aux_loss_coef": 0.001, "dtype": "float32",
}  # fmt: skip


def packed_vs_alone(samples: list[list[int]], changed: list[list[int]], multiple: int) -> dict:
    """Max |logit difference| per sample between packed and alone, for both position modes; and the max
    difference of each sample's packed logits when ``samples`` is replaced by ``changed``."""
    parallel.init_model_parallel(ParallelConfig(), 1234)
    arch = parse_hf_config(HF_CONFIG)
    model = build_model(arch, ParallelConfig(), transformer_impl="local")
    load_weights(model, SeededInit(arch, 7, torch.float32), arch, 256)
    model.eval()

    def packed_logits(seqs: list[list[int]], restart: bool) -> list[torch.Tensor]:
        pack = build_pack(seqs, multiple=multiple, restart_positions=restart)
        with torch.no_grad():
            out = model(pack.tokens, pack.position_ids, attention_mask=pack.attention_mask())
        return pack.unpack(out)

    alone = []
    for s in samples:
        ids = torch.tensor([s])
        with torch.no_grad():
            alone.append(model(ids, torch.arange(len(s))[None], attention_mask=None)[0])
    out: dict = {"length": build_pack(samples, multiple=multiple).length}
    for restart in (True, False):
        got = packed_logits(samples, restart)
        if restart:
            ref = alone
        else:  # positions run on: compare with each sample alone at its offset positions
            ref = []
            start = 0
            for s in samples:
                pos = torch.arange(start, start + len(s))[None]
                with torch.no_grad():
                    ref.append(model(torch.tensor([s]), pos, attention_mask=None)[0])
                start += len(s)
        out[f"diff_restart={restart}"] = [float((a - b).abs().max()) for a, b in zip(got, ref, strict=True)]
    base = packed_logits(samples, True)
    other = packed_logits(changed, True)
    out["changed_diff"] = [float((a - b).abs().max()) for a, b in zip(base, other, strict=True)]
    return out
