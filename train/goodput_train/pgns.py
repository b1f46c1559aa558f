"""The pre-conditioned gradient noise scale (PGNS), from gradients a training job computes anyway.

With K independent gradients g_k over b examples each (one per data-parallel replica, or per
accumulation step) and their mean g over B = K·b examples:

    E|g_k|² = |G|² + tr(Σ)/b,    E|g|² = |G|² + tr(Σ)/B,

G being the true gradient and Σ the per-example gradient covariance, so both are solved for without
bias. With one gradient per step (one replica, no accumulation) two consecutive steps' gradients are
the two samples (the differenced estimator; it assumes G moves little in one step). For adaptive
optimisers every norm is taken in the preconditioner's metric, |v|²_P = Σ p_i v_i² (Adam: p = 1 /
(sqrt(v̂) + eps)), which makes φ the pre-conditioned noise scale.

A single step's estimate is very noisy (its |G|² can come out negative); `NoiseScale` averages them
exponentially, with bias correction, and skips any that is not finite. It reports in the bus's
convention (`JobFacts.grad_sqr`, `grad_var`): |G|² and the variance of a gradient over M0
examples, tr(Σ)/M0, so that φ = M0·var/sqr = tr(Σ)/|G|² (goodput_train.goodput.pgns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

DEFAULT_SMOOTHING = 0.95  # weight of the past per step


@dataclass(frozen=True)
class NoiseSample:
    """One step's unbiased estimates: sqr of |G|², trace of tr(Σ) (per example)."""

    sqr: float
    trace: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.sqr) and math.isfinite(self.trace)


def sum_of_squares(
    tensors: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None] | None = None
) -> torch.Tensor:
    """|v|² over the tensors (or |s·v|², each tensor times its scale, None: 1) as a 0-dim float64
    tensor on their device, inf or nan if any entry is: one fused pass, and no wait for the device
    (a training step takes several and reads them all at once)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    if scales is not None:
        tensors = [t if s is None else t * s for t, s in zip(tensors, scales)]
    if len(tensors) == 1:
        return torch.linalg.vector_norm(tensors[0]).double().square()
    return torch.stack(torch._foreach_norm(list(tensors), 2)).double().square().sum()


def squared_norm(tensors: Sequence[torch.Tensor], precondition: Sequence[torch.Tensor] | None = None) -> float:
    """|v|² (or |v|²_P with the preconditioner's diagonal, one tensor per parameter); inf or nan
    if any entry is. One fused pass over the tensors (it runs every step)."""
    return float(sum_of_squares(tensors, None if precondition is None else [p.sqrt() for p in precondition]))


def from_replicas(local_sqr: float, mean_sqr: float, local_batch: int, count: int) -> NoiseSample:
    """From `count` >= 2 gradients over `local_batch` examples each: the average of their squared
    norms, and their mean's squared norm."""
    if count < 2:
        raise ValueError("the replica estimator needs at least two gradients; use from_consecutive")
    small, large = local_batch, count * local_batch
    trace = (local_sqr - mean_sqr) / (1 / small - 1 / large)
    return NoiseSample(mean_sqr - trace / large, trace)


def from_consecutive(
    previous: Sequence[torch.Tensor],
    current: Sequence[torch.Tensor],
    batch: int,
    precondition: Sequence[torch.Tensor] | None = None,
    *,
    scales: Sequence[torch.Tensor | None] | None = None,
) -> NoiseSample:
    """The differenced estimator: two consecutive steps' gradients, each over `batch` examples
    (`scales`: the preconditioner's square roots, if already taken, instead of `precondition`)."""
    if precondition is not None:
        scales = [p.sqrt() for p in precondition]
    current, previous = list(current), list(previous)
    difference = sum_of_squares(torch._foreach_sub(current, previous), scales)
    half_sum = torch._foreach_add(current, previous)
    torch._foreach_div_(half_sum, 2.0)
    difference, mean = torch.stack([difference, sum_of_squares(half_sum, scales)]).tolist()
    trace = batch * difference / 2  # E|g_t - g_t-1|² = 2 tr(Σ)/B
    return NoiseSample(mean - trace / (2 * batch), trace)


class NoiseScale:
    """Exponentially averaged estimates (bias-corrected, like Adam's moments); non-finite steps skipped."""

    def __init__(self, init_batch: int, smoothing: float = DEFAULT_SMOOTHING):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.init_batch = init_batch
        self.smoothing = smoothing
        self.sqr = 0.0
        self.trace = 0.0
        self.weight = 0.0  # 1 - smoothing^n: the bias correction after n samples
        self.skipped = 0

    def update(self, sample: NoiseSample) -> bool:
        """Take one step's estimate; False (and nothing changes) when it is not finite."""
        if not sample.finite:
            self.skipped += 1
            return False
        beta = self.smoothing
        self.sqr = beta * self.sqr + (1 - beta) * sample.sqr
        self.trace = beta * self.trace + (1 - beta) * sample.trace
        self.weight = beta * self.weight + (1 - beta)
        return True

    def stats(self) -> tuple[float, float] | None:
        """(grad_sqr, grad_var) as the bus reports them, or None before the first finite step."""
        if self.weight == 0.0:
            return None
        return self.sqr / self.weight, self.trace / self.weight / self.init_batch

    def state_dict(self) -> dict:
        return {"sqr": self.sqr, "trace": self.trace, "weight": self.weight, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.sqr, self.trace = state["sqr"], state["trace"]
        self.weight, self.skipped = state["weight"], state["skipped"]
