"""The work behind each ``mars`` subcommand, as module-level functions that run on every rank.

They are importable by spawned processes (``parallel.launch``) and equally runnable under torchrun or
Slurm, where the environment already holds RANK/WORLD_SIZE: :func:`run` picks the right way.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mars_megatron.config import ParallelConfig
from mars_megatron.json_file import parse_json
from mars_megatron.training import parallel as par

# megatron warns on every import that Apex/TE are missing; on CPU that is the expected state.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
warnings.filterwarnings("ignore", message=r"Apex is not installed.*")


def run(fn: Callable[..., Any], parallel: ParallelConfig, *args: Any, nproc: int | None = None) -> list[Any]:
    """Run ``fn(*args)`` on every rank: in this process when launched by torchrun/Slurm, else on
    ``nproc`` (default: the layout's minimum world) spawned local processes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        par.init_distributed(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        try:
            return [fn(*args)]
        finally:
            par.destroy()
    return par.launch(fn, nproc or par.min_world_size(parallel), *args)


def _is_writer() -> bool:
    """The one rank that writes shared outputs: last pipeline stage, TP, DP and CP rank 0."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage()
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )


def load_engine(
    model_dir: str,
    parallel: ParallelConfig,
    *,
    dtype: str | None,
    impl: str,
    optimizer: Any = None,
    fp8: str | None = None,
    recompute: str = "none",
    routing_replay: bool = False,
) -> Any:
    """A :class:`MegatronEngine` with weights from an HF directory or a mars Megatron checkpoint
    (``fp8``, ``recompute``, ``routing_replay``: ``model.fp8``, ``train.recompute``, whether
    ``moe.routing_replay`` is on)."""
    from mars_megatron.checkpoint.model_meta import read_meta
    from mars_megatron.conversion.hf_io import HFReader
    from mars_megatron.conversion.model_io import load_weights, validate_hf_checkpoint
    from mars_megatron.convert import is_mcore_checkpoint, load_mcore
    from mars_megatron.models.hf_config import load_hf_config
    from mars_megatron.training.megatron_engine import MegatronEngine

    if is_mcore_checkpoint(model_dir):
        arch, meta = read_meta(model_dir)
        engine = MegatronEngine(
            arch,
            parallel,
            dtype=dtype or meta["dtype"],
            transformer_impl=impl,
            vocab_pad_multiple=meta["vocab_pad_multiple"],
            optimizer=optimizer,
            fp8=fp8,
            recompute=recompute,
            routing_replay=routing_replay,
        )
        load_mcore(engine.model, model_dir)
        return engine
    arch = load_hf_config(model_dir)
    reader = HFReader(model_dir)
    validate_hf_checkpoint(reader, arch)
    engine = MegatronEngine(
        arch,
        parallel,
        dtype=dtype,
        transformer_impl=impl,
        optimizer=optimizer,
        fp8=fp8,
        recompute=recompute,
        routing_replay=routing_replay,
    )
    load_weights(engine.model, reader, arch, engine.padded_vocab)
    return engine


def tokenizer_dir(model_dir: str) -> Path:
    """HF directories carry their tokenizer; mars checkpoints keep it under ``hf/``."""
    from mars_megatron.convert import is_mcore_checkpoint

    return Path(model_dir) / "hf" if is_mcore_checkpoint(model_dir) else Path(model_dir)


# ------------------------------------------------------------------------------------------------ convert
def hf_to_mcore_job(
    hf_dir: str, out_dir: str, parallel: ParallelConfig, dtype: str | None, impl: str
) -> None:
    from mars_megatron.convert import hf_to_mcore

    par.init_model_parallel(parallel, seed=0)
    hf_to_mcore(hf_dir, out_dir, parallel, dtype=dtype, transformer_impl=impl)


def mcore_to_hf_job(
    mcore_dir: str, out_dir: str, parallel: ParallelConfig, max_shard_bytes: int, impl: str
) -> None:
    from mars_megatron.convert import mcore_to_hf

    par.init_model_parallel(parallel, seed=0)
    mcore_to_hf(mcore_dir, out_dir, parallel, max_shard_bytes=max_shard_bytes, transformer_impl=impl)


# -------------------------------------------------------------------------------------------------- score
def model_arch(model_dir: str) -> Any:
    """Architecture of an HF directory or a mars Megatron checkpoint, read from its metadata only."""
    from mars_megatron.convert import is_mcore_checkpoint, preflight
    from mars_megatron.models.hf_config import load_hf_config

    if is_mcore_checkpoint(model_dir):
        return preflight(model_dir)[0]  # refuses a cut, altered or crafted checkpoint before ranks start
    return load_hf_config(model_dir)


def check_model_files(model_dir: str) -> Any:
    """:func:`model_arch`, and for an HF folder its safetensors checked against config.json (names, shapes,
    dtypes; headers only): what :func:`load_engine` checks on the ranks, in the launching process."""
    from mars_megatron.conversion.hf_io import HFReader
    from mars_megatron.conversion.model_io import validate_hf_checkpoint
    from mars_megatron.convert import is_mcore_checkpoint

    arch = model_arch(model_dir)
    if not is_mcore_checkpoint(model_dir):
        reader = HFReader(model_dir)
        try:
            validate_hf_checkpoint(reader, arch)
        finally:
            reader.close()
    return arch


def read_token_lines(
    path: str | Path, vocab_size: int | None = None, max_positions: int | None = None
) -> list[list[int]]:
    """Parse ``{"tokens": [ids...]}`` lines; errors name the file and line, before any rank starts.
    ``max_positions`` (the model's ``max_position_embeddings``) refuses a longer line: rotary positions past
    it were never trained, so its log-probs would be scored without meaning and without a word."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    seqs = []
    with open(path, "rb") as f:
        for lineno, data in enumerate(f, 1):
            if not data.strip():
                continue
            try:
                record = parse_json(data)
            except ValueError as e:  # not UTF-8, bad JSON, huge ints, deep nesting
                raise ValueError(f"{path}:{lineno}: {e}") from None
            tokens = record.get("tokens") if isinstance(record, dict) else None
            if (
                not isinstance(tokens, list)
                or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
            ):
                raise ValueError(f"{path}:{lineno}: field 'tokens' must be a non-empty list of token ids")
            if vocab_size is not None and max(tokens) >= vocab_size:
                raise ValueError(
                    f"{path}:{lineno}: token id {max(tokens)} is out of range for vocab_size {vocab_size}"
                )
            if max_positions is not None and len(tokens) > max_positions:
                raise ValueError(
                    f"{path}:{lineno}: {len(tokens)} tokens, longer than the model's "
                    f"max_position_embeddings {max_positions}"
                )
            seqs.append(tokens)
    if not seqs:
        raise ValueError(f"{path}: no sequences")
    return seqs


def read_routing(path: str | Path, seqs: Sequence[Sequence[int]], arch: Any) -> list[Any]:
    """``mars score --routing``: an ``.npz`` with one array per sequence of ``--input``, in order, as
    ``numpy.savez(path, *arrays)`` writes them (``arr_0``, ``arr_1``, ...), each ``[len(tokens) - 1,
    moe_layers, top_k]`` expert ids (``GenerationOutput.routed_experts``). Checked before any rank
    starts; errors name the file and the sequence."""
    import numpy as np

    from mars_megatron.training.routing_replay import RoutingError, check_routing

    if not arch.is_moe:
        raise RoutingError(f"--routing: {arch.architecture} has no MoE layers to route")
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise RoutingError(f"{path}: not a numpy .npz file ({type(e).__name__}: {e})") from e
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise RoutingError(f"{path}: a single .npy array, expected an .npz of one array per sequence")
    names = [f"arr_{i}" for i in range(len(seqs))]
    extra = sorted(set(data.files) - set(names))
    missing = [n for n in names if n not in data.files]
    if missing or extra:
        raise RoutingError(
            f"{path}: expected arrays arr_0..arr_{len(seqs) - 1}, one per sequence of the input; "
            f"missing {missing[:5]}, unexpected {extra[:5]}"
        )
    out = []
    for i, (name, seq) in enumerate(zip(names, seqs, strict=True)):
        try:
            rows = data[name]
        except (OSError, ValueError, EOFError) as e:  # object arrays (pickles) are refused here, unread
            raise RoutingError(f"{path}: sequence {i} ({name}) is unreadable ({e})") from e
        if rows.dtype.kind not in "iu":
            raise RoutingError(f"{path}: sequence {i} ({name}) has dtype {rows.dtype}, expected integers")
        check_routing(f"{path}:{name}", rows, len(seq), sum(arch.moe_layers), arch.moe_topk, arch.num_experts)
        out.append(rows)
    return out


def score_job(
    model_dir: str,
    seqs: list[list[int]],
    output: str,
    parallel: ParallelConfig,
    micro_batch: int,
    impl: str,
    routing: list[Any] | None = None,
) -> int:
    par.init_model_parallel(parallel, seed=0)
    engine = load_engine(model_dir, parallel, dtype=None, impl=impl, routing_replay=routing is not None)
    logprobs = engine.logprobs(seqs, micro_batch, routing=routing)
    if logprobs is not None and _is_writer():
        tmp = Path(output).with_name(f".{Path(output).name}.partial")
        with open(tmp, "w") as f:
            for lp in logprobs:
                f.write(json.dumps({"logprobs": lp}) + "\n")
        tmp.replace(output)
    return len(seqs)
