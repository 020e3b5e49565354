"""The order in which training problems are visited: epochs of seeded shuffles, and a cursor into them.

Pure and resumable: the whole state is ``(epoch, index)``, saved in checkpoints, so a resumed run takes
exactly the problems the uninterrupted run would have taken.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from mars_megatron.seeds import derive_seed

T = TypeVar("T")


@dataclass
class StreamState:
    epoch: int = 0
    index: int = 0


class ProblemStream(Generic[T]):
    """Hands out ``take(n)`` items at a time, reshuffling (if ``shuffle``) at each epoch boundary; a batch
    that crosses the boundary continues into the next epoch's order."""

    def __init__(self, items: Sequence[T], *, seed: int, shuffle: bool = True) -> None:
        if not items:
            raise ValueError("ProblemStream: no problems")
        self.items = list(items)
        self.seed = seed
        self.shuffle = shuffle
        self.state = StreamState()
        self._order_epoch = -1
        self._order: list[int] = []

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.items)))
            if self.shuffle:
                random.Random(derive_seed(self.seed, "epoch", epoch)).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def take(self, n: int) -> list[T]:
        if n < 1:
            raise ValueError(f"ProblemStream.take: n must be >= 1, got {n}")
        out = []
        while len(out) < n:
            order = self._epoch_order(self.state.epoch)
            out.append(self.items[order[self.state.index]])
            self.state.index += 1
            if self.state.index == len(order):
                self.state = StreamState(self.state.epoch + 1, 0)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "index": self.state.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < len(self.items):
            raise ValueError(f"ProblemStream: bad saved position epoch={epoch}, index={index}")
        self.state = StreamState(epoch, index)
