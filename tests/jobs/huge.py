"""A job too big for a slot: its gradients alone (134 MB) exceed a 64 MB slot at any batch size."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from examples.jobs.common import job_arguments, train
from services.executor.trainer import AdaptiveTraining


def main() -> None:
    args = job_arguments(__doc__, 1.0)
    model = nn.Linear(2048, 16384)
    data = TensorDataset(torch.randn(64, 2048), torch.randint(16384, (64,)))
    training = AdaptiveTraining(model, torch.optim.SGD(model.parameters(), lr=0.1), data, init_batch=8,
                                max_batch=64, target_epochs=args.epochs, checkpoint_path=args.checkpoint)
    train(training, lambda net, batch: nn.functional.cross_entropy(net(batch[0]), batch[1]), lambda: 0.0)


if __name__ == "__main__":
    main()
