"""The loop every example job shares: train until the target, stop cleanly on SIGTERM, print one
JSON line with the outcome (the executor and the tests read it)."""

from __future__ import annotations

import json
from typing import Callable

import torch

from services.executor.trainer import AdaptiveTraining, Stopped


def train(training: AdaptiveTraining, loss_of: Callable[[torch.nn.Module, tuple], torch.Tensor],
          evaluate: Callable[[], float]) -> dict:
    """Run `training` to its target epochs; `loss_of(model, batch)` is one micro-batch's loss."""
    batches = set()
    try:
        while not training.done():
            for batch in training.micro_batches():
                training.backward(loss_of(training.model, batch))
            training.step()
            batches.add(training.batch)
    except Stopped:
        result = {"stopped": True, "epochs": training.epochs, "steps": training.steps}
    else:
        training.save()
        result = {"stopped": False, "epochs": training.epochs, "steps": training.steps, "batches": sorted(batches),
                  "metric": evaluate(), "noise": training.noise.stats(), "world": training.placement.world,
                  "skipped": training.skipped}
    print(json.dumps(result), flush=True)
    return result
