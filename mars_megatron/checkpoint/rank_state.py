"""The per-rank side of training checkpoints: one policy's model, optimizer and RNG states.

Every trainer rank of a policy calls :func:`save_rank_state` / :func:`load_rank_state` together (they are
collective). A policy's part of a checkpoint is the directory ``<checkpoint>/<name>/``::

    dist/                 megatron dist_checkpointing (torch_dist): model weights and optimizer state
    rng/rank_<r>.pt       this rank's python / numpy / torch / CUDA / megatron-tracker RNG states
    layout.json           the parallel layout it was written with
    engine_state.json     engine counters (skipped steps) and whether the optimizer was saved
    mars_checkpoint.json  + hf/: what makes the folder a mars checkpoint of its own (given the tokenizer
                          assets), so ``model.mcore_dir``, ``mars eval`` and ``mars convert mcore-to-hf``
                          take a trained policy directly
    MANIFEST.sha256.json  every other file's size and SHA-256, hashed by all ranks, written last;
                          checked (digests split between the ranks) before anything is loaded

The distributed optimizer is saved in its ``dp_reshardable`` form (what megatron's own training loop
uses): every rank writes its own buckets (fp32 master weights, Adam moments) with no gathering, and reads
them back the same way; a non-distributed optimizer is saved per parameter, like the model. Together
with the Adam step counters and the RNG states this makes a resumed step bit-identical to the same step of
an uninterrupted run. The price is that the layout on load must equal the layout on save, which is checked
first, with an error that names both. (For a different layout, convert the model alone with
``mars convert``; model weights in ``dist/`` are layout-independent.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mars_megatron.checkpoint.atomic import write_text_atomic
from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.json_file import read_json

__all__ = [
    "load_rank_state",
    "parallel_layout",
    "python_rng_state",
    "save_rank_state",
    "set_python_rng_state",
]

LAYOUT_FILE = "layout.json"
ENGINE_FILE = "engine_state.json"
DIST_DIR = "dist"
RNG_DIR = "rng"
MODEL_KEY = "model"


# ------------------------------------------------------------------------------------- JSON-able python RNG
def python_rng_state(rng: random.Random | None = None) -> list[Any]:
    """``rng.getstate()`` (default: the global ``random``) as JSON-able lists, for the driver's state."""
    version, internal, gauss_next = (rng or random).getstate()
    return [version, list(internal), gauss_next]


def set_python_rng_state(obj: list[Any], rng: random.Random | None = None) -> None:
    """Inverse of :func:`python_rng_state`."""
    if not isinstance(obj, list | tuple) or len(obj) != 3 or not isinstance(obj[1], list | tuple):
        raise ValueError("python RNG state must be [version, [internal state ints], gauss_next]")
    (rng or random).setstate((obj[0], tuple(obj[1]), obj[2]))


# --------------------------------------------------------------------------------------------- rank RNG
def _rng_states() -> dict[str, Any]:
    """This process's generators, as tensors and plain values (loadable with ``weights_only=True``)."""
    from megatron.core import tensor_parallel

    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), cached_gaussian],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": None,
    }
    tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states()
    if tracker_states:  # the CPU (inference) tracker holds none
        states["tracker"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in tracker_states.items()}
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(states["python"])
    name, keys, pos, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if states["tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])


# --------------------------------------------------------------------------------------------- layout
def parallel_layout(engine: Any) -> dict[str, Any]:
    """What decides how model and optimizer state are sharded over ranks; must match between save/load."""
    from megatron.core import parallel_state as ps

    layout = {
        "world_size": dist.get_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "expert_dp": ps.get_expert_data_parallel_world_size(),
    }
    layout.update(dataclasses.asdict(engine.parallel))
    layout["etp"] = engine.parallel.effective_etp
    layout["sequence_parallel"] = engine.parallel.effective_sequence_parallel
    layout.pop("moe_token_dispatcher", None)  # how tokens travel, not how state is sharded
    return layout


def _describe(layout: dict[str, Any]) -> str:
    return ", ".join(f"{k}={layout[k]}" for k in sorted(layout))


def _sharded_metadata(engine: Any) -> dict[str, Any]:
    """The content metadata megatron's own training loop uses (megatron-core >= 0.14)."""
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if engine.parallel.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _sharded_state(engine: Any, metadata: dict[str, Any], *, with_optimizer: bool, loading: bool) -> dict:
    inner = getattr(engine.model, "module", engine.model)
    state: dict[str, Any] = {MODEL_KEY: inner.sharded_state_dict(metadata=metadata)}
    if with_optimizer:
        state["optimizer"] = engine.optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    return state


def _torch_adams(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch Adam/AdamW optimizers inside a megatron (chained) optimizer; empty with TE/Apex Adam."""
    inner = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [o for o in inner if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]


def _allocate_adam_state(optimizer: Any) -> None:
    """Give every parameter the Adam state its first step would create (zeros, step 0): torch's Adam
    treats that exactly like no state, and loading overwrites it.

    megatron-core 0.16.1 with torch's Adam (no TE/Apex, as on CPU) reads the per-parameter ``step`` while
    it builds a state dict, to save or to load into, and asserts if no step has been taken yet.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for p in group["params"]:
                state = adam.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _default_zero_step(loaded: Any) -> None:
    """Put back the step count 0 that megatron-core 0.16.1 leaves out of a non-distributed optimizer's
    checkpoint taken before the first step (it stores the step only ``if step:``); torch's Adam refuses
    to load a state without one."""
    if not isinstance(loaded, dict):
        return
    state = loaded.get("state")
    if isinstance(state, dict) and "param_groups" in loaded and "common_step" not in state:
        if any(isinstance(v, dict) and "step" not in v for v in state.values()):
            state["common_step"] = torch.tensor(0.0)
    for value in loaded.values():
        _default_zero_step(value)


def _restore_adam_steps(optimizer: Any) -> None:
    """Give each parameter its own ``step`` tensor holding the saved step count, after a load.

    megatron-core 0.16.1 with torch's Adam stores the step count in the param groups and on load puts one
    step tensor shared by every parameter into the state (torch then increments it once per parameter
    per step), and then copies the step of the state dict it loaded *into* over it (the pre-load value).
    The param groups hold the right count; this rebuilds the per-parameter steps from it.
    """
    for adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for p in group["params"]:
                state = adam.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    step = group.get("step", state["step"])
                    state["step"] = state["step"].new_tensor(float(step))


def _fsynced_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------------ public
def save_rank_state(
    directory: str | Path, name: str, engine: Any, *, assets: str | Path | None = None
) -> None:
    """Save ``engine``'s model, optimizer (if it has one) and this rank's RNG into ``directory/name``.

    Collective over the engine's world. ``directory`` is normally a staging directory from
    :meth:`CheckpointStore.begin`; ``name`` the policy (``"policy"``, ``"solver"``, ...). ``assets``:
    a folder with the model's config and tokenizer files; with it the policy folder is also a mars
    checkpoint (:mod:`mars_megatron.convert`).
    """
    from megatron.core import dist_checkpointing

    from mars_megatron.checkpoint.manifest import write_collective

    out = Path(directory) / name
    rank = dist.get_rank()
    # every rank creates the folders: on a cluster ranks may see the filesystem at different moments
    (out / DIST_DIR).mkdir(parents=True, exist_ok=True)
    (out / RNG_DIR).mkdir(exist_ok=True)
    dist.barrier()
    rng = _rng_states()
    with_optimizer = engine.optimizer is not None
    if with_optimizer:
        _allocate_adam_state(engine.optimizer)  # a checkpoint before the first step (same as no state)
    metadata = _sharded_metadata(engine)
    saved_with = dict(metadata)  # megatron adds process groups to ``metadata`` while it shards
    state = _sharded_state(engine, metadata, with_optimizer=with_optimizer, loading=False)
    dist_checkpointing.save(state, str(out / DIST_DIR), content_metadata=metadata)
    _fsynced_save(rng, out / RNG_DIR / f"rank_{rank}.pt")
    _set_rng_states(rng)  # a run that saves goes on exactly like one that does not
    if rank == 0:
        write_text_atomic(out / LAYOUT_FILE, json.dumps(parallel_layout(engine), indent=1, sort_keys=True))
        engine_state = {"skipped_steps": engine.skipped_steps, "optimizer": with_optimizer}
        write_text_atomic(out / ENGINE_FILE, json.dumps(engine_state, indent=1, sort_keys=True))
        if assets is not None:
            _write_checkpoint_meta(out, engine, Path(assets), saved_with)
    dist.barrier()
    write_collective(out)


def _write_checkpoint_meta(out: Path, engine: Any, assets: Path, metadata: dict[str, Any]) -> None:
    from mars_megatron.checkpoint.model_meta import copy_assets, write_meta

    (out / "hf").mkdir(exist_ok=True)
    copy_assets(assets, out / "hf")
    write_meta(
        out,
        engine.arch,
        engine.dtype,
        engine.vocab_pad_multiple,
        engine.parallel,
        weights=DIST_DIR,
        state_key=MODEL_KEY,
        sharded_metadata=metadata,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; not a policy checkpoint written by save_rank_state")
    data = read_json(path, CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data


def load_rank_state(directory: str | Path, name: str, engine: Any) -> None:
    """Restore what :func:`save_rank_state` wrote into ``directory/name``: model weights, optimizer state
    (fp32 master weights, Adam moments and step counters), the skipped-step count and this rank's RNG.

    Collective. Raises :class:`CheckpointError` (on every rank) if the folder does not match its manifest,
    the parallel layout differs from the saved one or the engine needs an optimizer state the checkpoint
    lacks; nothing in the folder is unpickled beyond plain data.
    """
    from mars_megatron.checkpoint import dist_load
    from mars_megatron.checkpoint.manifest import verify_collective
    from mars_megatron.checkpoint.safe_load import load_plain

    src = Path(directory) / name
    verify_collective(src)
    saved_layout = _read_json(src / LAYOUT_FILE)
    saved_layout.setdefault("cp", 1)  # written before parallel.cp existed
    layout = parallel_layout(engine)
    if saved_layout != layout:
        differ = sorted(k for k in {*saved_layout, *layout} if saved_layout.get(k) != layout.get(k))
        raise CheckpointError(
            f"{src}: saved with parallel layout ({_describe(saved_layout)}) but this run has "
            f"({_describe(layout)}); they differ in {', '.join(differ)}. Resume with the saved layout."
        )
    engine_state = _read_json(src / ENGINE_FILE)
    with_optimizer = engine.optimizer is not None
    if with_optimizer and not engine_state.get("optimizer"):
        raise CheckpointError(f"{src}: holds no optimizer state, but this engine trains (has an optimizer)")
    # every rank checks every rank's file, so that all of them fail here or none does
    rng_files = [src / RNG_DIR / f"rank_{r}.pt" for r in range(dist.get_world_size())]
    missing = [str(f) for f in rng_files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{src}: RNG state files missing: {', '.join(missing)}")

    metadata = dist_load.load_content_metadata(src / DIST_DIR) or _sharded_metadata(engine)
    if with_optimizer:
        _allocate_adam_state(engine.optimizer)
    state = _sharded_state(engine, metadata, with_optimizer=with_optimizer, loading=True)
    loaded = dist_load.load(state, src / DIST_DIR)
    inner = getattr(engine.model, "module", engine.model)
    # no_grad: with fp32 weights the distributed optimizer's master weights are views of the parameters,
    # which megatron-core 0.16.1 copies into in place (autograd refuses that on a leaf that needs grad).
    with torch.no_grad():
        inner.load_state_dict(loaded[MODEL_KEY])
        if with_optimizer:
            _default_zero_step(loaded["optimizer"])
            engine.optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(engine.optimizer)
    engine.skipped_steps = int(engine_state["skipped_steps"])
    _set_rng_states(load_plain(rng_files[dist.get_rank()]))
    dist.barrier()
