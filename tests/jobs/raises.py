"""A job whose script breaks once it trains (its profiling run passes): it must end failed with
its error, after the executor has restarted it from its checkpoint a few times."""

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from goodput_train.protocol import PROFILE_ENV
from tests.jobs.small import run_small

GOODPUT_JOB = True

STEPS = 0


def loss_of(net, batch):
    global STEPS
    if not os.environ.get(PROFILE_ENV):
        STEPS += 1
        if STEPS > 3:
            raise RuntimeError("the data loader broke at step 3")
    return nn.functional.cross_entropy(net(batch[0]), batch[1])


if __name__ == "__main__":
    run_small(nn.Linear(4, 2), TensorDataset(torch.randn(256, 4), torch.randint(2, (256,))), loss_of)
