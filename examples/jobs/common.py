"""The loop every example job shares: train until the target, stop cleanly on SIGTERM, print one
line with the outcome (`goodput-outcome ` and JSON: the executor and the tests read it)."""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from goodput_train import AdaptiveTraining
from goodput_train.protocol import OUTCOME_PREFIX


def job_arguments(
    description: str,
    epochs: float,
    argv: list[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The options every example job takes: its target in statistical epochs and its checkpoint."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--epochs", type=float, default=epochs, help="statistical epochs to train (default: %(default)s)"
    )
    parser.add_argument("--checkpoint", help="checkpoint file (resume from it if present)")
    if extra:
        extra(parser)
    return parser.parse_args(argv)


def train(
    training: AdaptiveTraining, loss_of: Callable[[torch.nn.Module, tuple], torch.Tensor], evaluate: Callable[[], float]
) -> dict:
    """Run `training` to its target epochs; `loss_of(model, batch)` is one micro-batch's loss."""
    outcome = training.run(loss_of)
    result = {"stopped": outcome == "stopped", "epochs": training.epochs, "steps": training.steps}
    if outcome == "done":
        result.update(
            batches=training.batches,
            metric=evaluate(),
            noise=training.noise.stats(),
            world=training.placement.world,
            skipped=training.skipped,
        )
    if outcome != "profiled":
        print(OUTCOME_PREFIX + json.dumps(result), flush=True)
    return result
