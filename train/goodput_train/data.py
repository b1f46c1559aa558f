"""Elastic data order: the examples come as one endless stream, each epoch a new permutation of the
dataset, consumed from a global position. A job that stops and resumes with another world size or
batch neither repeats nor skips an example of an epoch, and every rank's micro-batches are always
full (a step that reaches the end of an epoch goes on into the next), so replicas stay in step.

Each optimizer step takes the next B = world · m · (s + 1) examples: micro-batch j of rank r is
[position + (j · world + r) · m, ... + m). The position is all a checkpoint needs.
"""

from __future__ import annotations

import torch


class ElasticOrder:
    def __init__(self, size: int, seed: int = 0, position: int = 0):
        if size < 1:
            raise ValueError("the dataset is empty")
        self.size = size
        self.seed = seed
        self.position = position  # examples taken since the first epoch began
        self._permutations: dict[int, torch.Tensor] = {}

    @property
    def epoch(self) -> int:
        return self.position // self.size

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._permutations:
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._permutations[epoch] = torch.randperm(self.size, generator=generator)
        return self._permutations[epoch]

    def _take(self, start: int, count: int) -> torch.Tensor:
        parts = []
        while count > 0:
            epoch, offset = divmod(start, self.size)
            n = min(count, self.size - offset)
            parts.append(self._permutation(epoch)[offset : offset + n])
            start, count = start + n, count - n
        return torch.cat(parts)

    def step(self, rank: int, world: int, m: int, s: int) -> list[torch.Tensor]:
        """This rank's s + 1 micro-batches of indices for the next optimizer step."""
        if not 0 <= rank < world or m < 1 or s < 0:
            raise ValueError(f"bad step: rank {rank} of {world}, m={m}, s={s}")
        start = self.position
        self.position += world * m * (s + 1)
        return [self._take(start + (j * world + rank) * m, m) for j in range(s + 1)]

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    @classmethod
    def from_state(cls, size: int, state: dict) -> "ElasticOrder":
        return cls(size, state["seed"], state["position"])
