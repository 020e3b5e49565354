"""Module-level workers for tests/test_rl_train.py and test_mismatch.py: a PolicyWorker trains on fixed
samples (spawned ranks)."""

from __future__ import annotations

from typing import Any

from mars_megatron.agents.sample import Sample
from mars_megatron.config import load_config


def train_samples(hf: str, overrides: list[str], samples: list[Sample], steps: int) -> list[dict[str, Any]]:
    """``steps`` calls of PolicyWorker.train on the same samples; every rank returns its metrics."""
    from mars_megatron.rl.worker import PolicyWorker

    cfg = load_config(None, [f"model.hf_dir={hf}", "model.transformer_impl=local", *overrides])
    worker = PolicyWorker(cfg, hf, ["shared"])
    return [worker.train(worker.local_shares({"shared": samples})) for _ in range(steps)]


def train_samples_each(
    hf: str, runs: list[tuple[list[str], int]], samples: list[Sample]
) -> list[list[dict[str, Any]]]:
    """:func:`train_samples` for each (overrides, steps) in turn, in these processes, each with a
    PolicyWorker of its own built from ``hf``: one launch for the settings of one world size."""
    return [train_samples(hf, overrides, samples, steps) for overrides, steps in runs]


def train_once_counting_each(hf: str, runs: list[tuple[list[str], list[Sample]]]) -> list[dict[str, Any]]:
    """:func:`train_once_counting` for each (overrides, samples) in turn, in these processes: each run
    builds its own PolicyWorker (model, optimizer, model-parallel groups) from ``hf``; one launch spares
    the spawn and the imports of a launch per setting."""
    return [train_once_counting(hf, overrides, samples) for overrides, samples in runs]


def train_once_counting(hf: str, overrides: list[str], samples: list[Sample]) -> dict[str, Any]:
    """One PolicyWorker.train on every rank; its metrics and ``scoring_forwards``: how many times the
    policy scored the batch (``forward_logprobs``) before updating on it."""
    from mars_megatron.rl.worker import PolicyWorker

    cfg = load_config(None, [f"model.hf_dir={hf}", "model.transformer_impl=local", *overrides])
    worker = PolicyWorker(cfg, hf, ["shared"])
    engine = worker.policies["shared"].megatron
    scoring = engine.forward_logprobs
    calls = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return scoring(*args, **kwargs)

    engine.forward_logprobs = counted
    metrics = worker.train(worker.local_shares({"shared": samples}))
    return {**metrics, "scoring_forwards": len(calls)}
