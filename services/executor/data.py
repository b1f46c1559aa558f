"""Elastic data order: an epoch is one permutation of the dataset, consumed from a global position,
so a job that stops and resumes with another world size or batch neither repeats nor skips an
example of the epoch.

Each optimizer step takes the next B = world · m · (s + 1) examples of the permutation: micro-batch j
of rank r is the slice [position + (j · world + r) · m, ... + m). The position (and the epoch) is
all a checkpoint needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EpochPosition:
    epoch: int = 0
    position: int = 0          # examples of this epoch's permutation already taken


class ElasticOrder:
    def __init__(self, size: int, seed: int = 0, state: EpochPosition | None = None):
        if size < 1:
            raise ValueError("the dataset is empty")
        self.size = size
        self.seed = seed
        self.state = state or EpochPosition()
        self._order = self._permutation(self.state.epoch)

    def _permutation(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))

    def step(self, rank: int, world: int, m: int, s: int) -> list[torch.Tensor]:
        """This rank's s + 1 micro-batches of indices for the next optimizer step (the last step of
        an epoch may be short; the next step starts the next epoch)."""
        if not 0 <= rank < world or m < 1 or s < 0:
            raise ValueError(f"bad step: rank {rank} of {world}, m={m}, s={s}")
        if self.state.position >= self.size:
            self.state = EpochPosition(self.state.epoch + 1, 0)
            self._order = self._permutation(self.state.epoch)
        start = self.state.position
        micro = [self._order[start + (j * world + rank) * m: start + (j * world + rank + 1) * m] for j in range(s + 1)]
        self.state = EpochPosition(self.state.epoch, min(self.size, start + world * m * (s + 1)))
        return [indices for indices in micro if len(indices)]

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "position": self.state.position, "seed": self.seed}

    @classmethod
    def from_state(cls, size: int, state: dict) -> "ElasticOrder":
        return cls(size, state["seed"], EpochPosition(state["epoch"], state["position"]))
