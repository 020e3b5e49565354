"""Engines that the pipeline tests run inside Ray actors (importable by module path, unlike test-file
closures)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest
from mars_megatron.rollout.hf_engine import HFEngine


class RecordingEngine(HFEngine):
    """The transformers engine, made :class:`~mars_megatron.rollout.engine.Sleepable`, appending one line
    per call to ``log``: a test reads the order in which the driver and the trainer's weight push reach
    the engine. Its sleep and wakes free nothing (transformers on CPU has nothing to free); they only
    record."""

    def __init__(self, log: str, model_dir: str, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        self.log = Path(log)

    def _note(self, event: str) -> None:
        with self.log.open("a") as f:
            f.write(event + "\n")

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        self._note("generate")
        return super().generate(requests)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        loaded = super().update_weights(named_tensors)
        self._note("update")
        return loaded

    def sleep(self) -> None:
        self._note("sleep")

    def wake_weights(self) -> None:
        self._note("wake_weights")

    def wake(self) -> None:
        self._note("wake")


def events(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []
