"""What ``tests/test_dist_save.py`` runs on spawned ranks: one model saved by megatron's
``dist_checkpointing.save`` and by :mod:`mars_megatron.checkpoint.dist_save`, then each loaded back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist

from mars_megatron.config import ParallelConfig
from mars_megatron.training import parallel


def save_both_ways(hf: str, root: str, layout: tuple[int, int, int]) -> dict[str, Any]:
    """Fill a model from ``hf`` in ``layout`` (tp, pp, ep), save it into ``root/megatron`` with megatron's
    writer and into ``root/mars`` with ours, load each into a fresh model. Returns, on this rank: the
    digests recorded for the manifest and the files' real ones, and whether each load reproduced every
    parameter bit for bit."""
    from megatron.core import dist_checkpointing

    from mars_megatron.checkpoint import dist_load, dist_save, manifest
    from mars_megatron.checkpoint.tensor_record import records_without_crc
    from mars_megatron.conversion.hf_io import HFReader
    from mars_megatron.conversion.model_io import load_weights
    from mars_megatron.models.hf_config import load_hf_config
    from mars_megatron.training.model_provider import build_model

    tp, pp, ep = layout
    pc = ParallelConfig(tp=tp, pp=pp, ep=ep)
    parallel.init_model_parallel(pc, seed=0)
    arch = load_hf_config(hf)
    model = build_model(arch, pc)
    load_weights(model, HFReader(hf), arch, arch.padded_vocab_size(128))
    ours, theirs = Path(root) / "mars", Path(root) / "megatron"
    for directory in (ours, theirs):
        if dist.get_rank() == 0:
            directory.mkdir()
        dist.barrier()
    with records_without_crc():  # as ours writes them: the data shards must match byte for byte
        dist_checkpointing.save(model.sharded_state_dict(), str(theirs))
    dist_save.save(model.sharded_state_dict(), ours)

    rank_files = sorted(ours.glob(f"__{dist.get_rank()}_*.distcp"))
    recorded = {p.name: manifest._take_written(p) for p in rank_files}
    actual = {p.name: {"size": p.stat().st_size, "blake3": _blake3(p)} for p in rank_files}
    loads, in_place = {}, {}
    for directory in (ours, theirs):
        fresh = build_model(arch, pc)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        state = dist_load.load(fresh.sharded_state_dict(), directory)
        params = dict(fresh.named_parameters())
        fc1 = [k for k in state if k.endswith("linear_fc1.weight")]
        in_place[directory.name] = bool(fc1) and all(state[k] is params[k] for k in fc1)
        fresh.load_state_dict(state)
        pairs = zip(model.parameters(), fresh.parameters(), strict=True)
        loads[directory.name] = all(torch.equal(a, b) for a, b in pairs)
    # records without a CRC-32 are read by megatron's own loader (torch.load) as well
    fresh = build_model(arch, pc)
    state = dist_checkpointing.load(fresh.sharded_state_dict(), str(ours))
    fresh.load_state_dict(state)
    pairs = zip(model.parameters(), fresh.parameters(), strict=True)
    loads["mars, by megatron's loader"] = all(torch.equal(a, b) for a, b in pairs)
    return {"recorded": recorded, "actual": actual, "loads": loads, "in_place": in_place}


def _blake3(path: Path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()
