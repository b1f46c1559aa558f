"""A job whose script breaks once it trains (its profiling run passes): it must end failed with
its error, after the executor has restarted it from its checkpoint a few times."""

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from examples.jobs.common import job_arguments, train
from services.executor.protocol import PROFILE_ENV
from services.executor.trainer import AdaptiveTraining


def main() -> None:
    args = job_arguments(__doc__, 1.0)
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(256, 4), torch.randint(2, (256,)))
    training = AdaptiveTraining(model, torch.optim.SGD(model.parameters(), lr=0.1), data, init_batch=8,
                                max_batch=64, target_epochs=args.epochs, checkpoint_path=args.checkpoint)

    def loss_of(net, batch):
        if not os.environ.get(PROFILE_ENV) and training.steps >= 3:
            raise RuntimeError("the data loader broke at step 3")
        return nn.functional.cross_entropy(net(batch[0]), batch[1])

    train(training, loss_of, lambda: 0.0)


if __name__ == "__main__":
    main()
