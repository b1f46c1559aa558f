"""A job too big for a slot: its gradients alone (134 MB) exceed a 64 MB slot at any batch size."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.jobs.small import run_small

GOODPUT_JOB = True

if __name__ == "__main__":
    run_small(
        nn.Linear(2048, 16384),
        TensorDataset(torch.randn(64, 2048), torch.randint(16384, (64,))),
        lambda net, batch: nn.functional.cross_entropy(net(batch[0]), batch[1]),
    )
