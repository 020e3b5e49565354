"""On paper: the seconds one weight push takes for a layout, at stated link bandwidths.

The push (:mod:`mars_megatron.transfer`) has three parts, added up here (they overlap in practice, so the
sum is an upper estimate):

- **gather**: each sender all-gathers its share over its TP (expert-TP) group on NVLink before packing:
  ``share x (tp - 1) / tp / (eff x nvlink)``, for the largest share (one sender per pipeline stage and
  expert-parallel rank, so ``share = dense / pp + experts / (pp x ep)``);
- **wire**: every bucket is broadcast once to every engine worker. NCCL's broadcast pipelines the bytes
  along a chain, so each node takes them in once, over all of its NICs, whatever the number of engines:
  ``bytes / (eff x nics_per_node x nic_bandwidth)``; on one node, NVLink instead of the NICs;
- **load**: each engine worker copies its shard out of the full tensors in device memory:
  ``bytes / engine_tp / hbm_copy``.

``eff`` is the share of the link a large NCCL broadcast reaches (0.7 by default; nccl-tests on H100 + NDR
clusters report 0.7-0.9 of the link for messages of hundreds of MB). ``bytes`` is the rollout copy of
the weights: 2 bytes per parameter (bf16), 1 for FP8 engines' weights moved as bf16 anyway (the engine
quantizes on load), so FP8 does not shrink the push.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars_megatron.launch.planner import Layout, param_counts
from mars_megatron.models.hf_config import Qwen3Arch

ANCHORS: tuple[tuple[str, str], ...] = (
    ("NeMo-RL NCCL refit, Qwen3-30B, H100", "0.74-1.0 s"),
    ("verl checkpoint engine, Qwen3-30B, H20", "4.38 s"),
    ("verl checkpoint engine, Qwen3-235B, H20", "23.7 s"),
    ("slime, GLM-4.5-355B", "48 s"),
)
"""What the peers publish for the same operation (issue 18), printed beside the estimate."""


@dataclass(frozen=True)
class Links:
    """Bandwidths the estimate assumes; defaults are an H100 node with 8 x 400 Gb/s NDR InfiniBand."""

    nic_gbps: float = 400.0  # one NIC, gigabits per second
    nics_per_node: int = 8
    nvlink_gbs: float = 450.0  # one GPU's NVLink, one direction, gigabytes per second (H100: 450)
    hbm_copy_gbs: float = 1500.0  # device-memory copy (H100 HBM3 3.35 TB/s read; a copy reads and writes)
    efficiency: float = 0.7

    def __post_init__(self) -> None:
        for name in ("nic_gbps", "nvlink_gbs", "hbm_copy_gbs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.nics_per_node < 1:
            raise ValueError(f"nics_per_node must be >= 1, got {self.nics_per_node}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def node_gbs(self) -> float:
        return self.nics_per_node * self.nic_gbps / 8


@dataclass(frozen=True)
class SyncEstimate:
    bytes: int
    senders: int
    sender_bytes: int  # the largest share one sender packs
    gather_s: float
    wire_s: float
    load_s: float
    one_node: bool
    links: Links

    @property
    def seconds(self) -> float:
        return self.gather_s + self.wire_s + self.load_s


def estimate_sync(
    arch: Qwen3Arch, layout: Layout, engine_tp: int, *, one_node: bool, links: Links = Links()
) -> SyncEstimate:
    """Seconds per weight push of ``arch`` from a trainer of ``layout`` into engines of ``engine_tp``
    GPUs (module docstring); ``one_node``: trainer and engines share one node (NVLink carries the wire)."""
    c = param_counts(arch)
    per_layer = c.attention + c.norms
    dense = c.embedding + c.output + c.final_norm
    experts = 0
    for moe in c.moe_layers:
        if moe:
            dense += per_layer + c.router
            experts += c.experts
        else:
            dense += per_layer + c.dense_mlp
    bytes_per = 2  # bf16 rollout weights
    total = (dense + experts) * bytes_per
    ep = layout.ep if arch.is_moe else 1
    dense_share = dense * bytes_per / layout.pp
    expert_share = experts * bytes_per / (layout.pp * ep)
    eff = links.efficiency
    gathered = dense_share * (layout.tp - 1) / layout.tp
    gathered += expert_share * (layout.expert_tp - 1) / layout.expert_tp
    gather_s = gathered / (eff * links.nvlink_gbs * 1e9)
    wire_gbs = links.nvlink_gbs if one_node else links.node_gbs
    wire_s = total / (eff * wire_gbs * 1e9)
    load_s = total / engine_tp / (links.hbm_copy_gbs * 1e9)
    return SyncEstimate(
        total,
        layout.pp * ep,
        int(dense_share + expert_share),
        gather_s,
        wire_s,
        load_s,
        one_node,
        links,
    )


def format_estimate(e: SyncEstimate) -> list[str]:
    """Lines for ``mars plan``: the estimate, its assumptions, and the peers' published figures."""
    link = (
        f"NVLink {e.links.nvlink_gbs:g} GB/s"
        if e.one_node
        else f"{e.links.nics_per_node} x {e.links.nic_gbps:g} Gb/s NICs per node = {e.links.node_gbs:g} GB/s"
    )
    return [
        f"weight sync per update: {e.seconds:.2f} s on paper ({e.bytes / 1e9:.1f} GB bf16 from {e.senders} "
        f"sender ranks, largest share {e.sender_bytes / 1e9:.1f} GB)",
        f"  gather {e.gather_s:.3f} s + wire {e.wire_s:.3f} s + load {e.load_s:.3f} s",
        f"  wire at {link} x {e.links.efficiency:g} efficiency (--nic-gbps, --nics-per-node)",
        "  published for comparison: " + "; ".join(f"{who}: {t}" for who, t in ANCHORS[:2]),
        "    " + "; ".join(f"{who}: {t}" for who, t in ANCHORS[2:]),
    ]
