"""An ordinary PyTorch training script made adaptive with goodput's library: an MLP classifying
generated Gaussian blobs (no download). Run alone, or under the executor (torchrun's environment).

    python -m examples.jobs.mlp_blobs --epochs 20 --checkpoint out/mlp.pt
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from examples.jobs.common import job_arguments, train
from goodput_train import AdaptiveTraining

GOODPUT_JOB = True  # a job: the executors may run this module (a helper module may not)

CLASSES, FEATURES = 8, 32


def blobs(n: int, seed: int) -> TensorDataset:
    """Eight overlapping Gaussian classes: learnable, but not in one step."""
    generator = torch.Generator().manual_seed(1234)  # the same centres for train and test
    centres = 1.2 * torch.randn(CLASSES, FEATURES, generator=generator)
    generator.manual_seed(seed)
    labels = torch.randint(CLASSES, (n,), generator=generator)
    return TensorDataset(centres[labels] + torch.randn(n, FEATURES, generator=generator), labels)


def accuracy(model: nn.Module, data: TensorDataset, device: torch.device) -> float:
    inputs, labels = data.tensors
    with torch.no_grad():
        return float((model(inputs.to(device)).argmax(dim=1).cpu() == labels).float().mean())


def main(argv: list[str] | None = None) -> dict:
    args = job_arguments(__doc__, 15.0, argv, lambda parser: parser.add_argument("--max-batch", type=int, default=1024))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data, test = blobs(8192, seed=1), blobs(2048, seed=2)
    training = AdaptiveTraining(
        model,
        optimizer,
        data,
        init_batch=32,
        max_batch=args.max_batch,
        max_local=256,
        target_epochs=args.epochs,
        checkpoint_path=args.checkpoint,
    )
    loss_fn = nn.CrossEntropyLoss()
    return train(
        training, lambda net, batch: loss_fn(net(batch[0]), batch[1]), lambda: accuracy(model, test, training.device)
    )


if __name__ == "__main__":
    main()
