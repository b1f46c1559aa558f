"""The loop the small test jobs share: SGD, M0 8, at most 64, the example jobs' options."""

import torch
from torch.utils.data import Dataset

from examples.jobs.common import job_arguments, train
from goodput_train import AdaptiveTraining


def run_small(model: torch.nn.Module, data: Dataset, loss_of) -> None:
    args = job_arguments("a small test job", 1.0)
    training = AdaptiveTraining(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        init_batch=8,
        max_batch=64,
        target_epochs=args.epochs,
        checkpoint_path=args.checkpoint,
    )
    train(training, loss_of, lambda: 0.0)
