"""Module-level functions that the engine tests run on spawned gloo ranks via ``parallel.launch``.

Spawned processes import what they run by module path, so these cannot be test-file closures. Arguments
and results are plain picklable data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mars_megatron.config import OptimizerConfig, ParallelConfig
from mars_megatron.conversion.hf_io import HFReader
from mars_megatron.conversion.model_io import load_weights
from mars_megatron.models.hf_config import load_hf_config
from mars_megatron.training import parallel
from mars_megatron.training.logprobs import vocab_parallel_logprobs


@dataclass(frozen=True)
class Case:
    """Score ``score_seqs``, then take ``steps`` optimizer steps on ``train_seqs`` (the same global batch
    every step), with the HF checkpoint ``hf_dir`` loaded into layout ``(tp, pp, ep, etp, cp)``."""

    name: str
    hf_dir: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    score_seqs: list[list[int]] = field(default_factory=list)
    train_seqs: list[list[int]] = field(default_factory=list)
    micro_batch: int = 2  # scoring
    pack_length: int = 32  # training: sequences are packed into packs of this many tokens
    steps: int = 0
    lr: float = 3e-3
    # after training, call train_step on each (global batch, pack_length) and record what it raises;
    # only for batches that every rank rejects before any collective
    bad_batches: list[tuple[list[list[int]], int]] = field(default_factory=list)

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp)


def score_and_train(cases: list[Case], seed: int = 1234) -> dict[str, dict]:
    """Run every case on this rank; per case ``{"logprobs": [[...]] or None, "steps": [metrics...]}``.

    ``logprobs`` is ``None`` on ranks that are not on the last pipeline stage (the engine's contract);
    ``errors`` holds ``(exception type, message)`` per bad batch (``("", "")`` if it was accepted).
    Megatron's parallel state is rebuilt for each case, so one launch covers several layouts.
    """
    out: dict[str, dict] = {}
    for case in cases:
        try:
            out[case.name] = _score_and_train(case, seed)
        except Exception as e:  # name the case in the traceback that launch() reports
            raise RuntimeError(f"case {case.name!r} failed: {type(e).__name__}: {e}") from e
    return out


def _score_and_train(case: Case, seed: int) -> dict:
    from mars_megatron.training.megatron_engine import MegatronEngine

    layout = case.parallel()
    parallel.init_model_parallel(layout, seed)
    arch = load_hf_config(case.hf_dir)
    optimizer = OptimizerConfig(lr=case.lr) if case.steps else None
    engine = MegatronEngine(arch, layout, dtype="float32", transformer_impl="local", optimizer=optimizer)
    load_weights(engine.model, HFReader(case.hf_dir), arch, engine.padded_vocab)
    result: dict = {"logprobs": None, "steps": [], "errors": []}
    if case.score_seqs:
        result["logprobs"] = engine.logprobs(case.score_seqs, case.micro_batch)
    for _ in range(case.steps):
        result["steps"].append(engine.train_step(case.train_seqs, pack_length=case.pack_length))
    for seqs, pack_length in case.bad_batches:
        try:
            engine.train_step(seqs, pack_length=pack_length)
        except (ValueError, RuntimeError) as e:
            result["errors"].append((type(e).__name__, str(e)))
        else:
            result["errors"].append(("", ""))
    return result


def tp_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, upstream: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank holds its contiguous slice of ``logits``' last dimension; returns the log-probs and
    the gradient of ``(logprobs * upstream).sum()`` with respect to the full logits, with every rank's
    slice gathered back into place."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    local = logits.shape[-1] // world
    mine = logits[..., rank * local : (rank + 1) * local].clone().requires_grad_(True)
    lp = vocab_parallel_logprobs(
        mine, targets, vocab_start=rank * local, vocab_size=vocab_size, group=dist.group.WORLD
    )
    (lp * upstream).sum().backward()
    parts = [torch.empty_like(mine.grad) for _ in range(world)]
    dist.all_gather(parts, mine.grad.contiguous())
    return lp.detach(), torch.cat(parts, dim=-1)
