"""A small CNN on generated images (no download): which quadrant of a noisy 16x16 image holds the
bright square. Adam, so the library scales its learning rate by the square root of the batch.

    python -m examples.jobs.cnn_shapes --epochs 4 --checkpoint out/cnn.pt
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from examples.jobs.common import job_arguments, train
from goodput_train import AdaptiveTraining

GOODPUT_JOB = True  # a job: the executors may run this module (a helper module may not)

SIZE = 16


def squares(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    images = 0.5 * torch.randn(n, 1, SIZE, SIZE, generator=generator)
    quadrant = torch.randint(4, (n,), generator=generator)
    corner = torch.randint(SIZE // 2 - 4, (n, 2), generator=generator)
    for i in range(n):
        row = corner[i, 0] + (SIZE // 2) * (quadrant[i] // 2)
        col = corner[i, 1] + (SIZE // 2) * (quadrant[i] % 2)
        images[i, 0, row : row + 4, col : col + 4] += 1.5
    return TensorDataset(images, quadrant)


def main(argv: list[str] | None = None) -> dict:
    args = job_arguments(__doc__, 4.0, argv)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 4),
    )
    data, test = squares(4096, seed=1), squares(1024, seed=2)
    training = AdaptiveTraining(
        model,
        torch.optim.Adam(model.parameters(), lr=2e-3),
        data,
        init_batch=32,
        max_batch=512,
        max_local=128,
        target_epochs=args.epochs,
        checkpoint_path=args.checkpoint,
    )

    def accuracy() -> float:
        with torch.no_grad():
            predicted = model(test.tensors[0].to(training.device)).argmax(dim=1).cpu()
            return float((predicted == test.tensors[1]).float().mean())

    return train(training, lambda net, batch: nn.functional.cross_entropy(net(batch[0]), batch[1]), accuracy)


if __name__ == "__main__":
    main()
