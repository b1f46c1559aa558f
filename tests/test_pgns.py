"""The PGNS estimator where the answer is known: least squares with Gaussian inputs and noise.

For y = x·w* + e, x ~ N(0, I_d), e ~ N(0, s²), loss ½(x·w − y)² at w = w* + d: the true gradient is
G = d and the per-example gradient covariance is Σ = (|d|² + s²)·I + d·dᵀ, so |G|² = |d|² and
tr(Σ) = dim·(|d|² + s²) + |d|²; in a diagonal preconditioner's metric P, |G|²_P = Σ p_i d_i² and
tr(PΣ) = Σ p_i (|d|² + s² + d_i²). The weights stay at w (no update), so consecutive gradients are
independent draws around the same G, as the differenced estimator assumes.
"""

import math

import pytest
import torch

from goodput_train.goodput import pgns
from goodput_train.pgns import NoiseSample, NoiseScale, from_consecutive, from_replicas, squared_norm

DIM, NOISE, STEPS = 40, 1.0, 600
TOLERANCE = 0.15


class Regression:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.w_star = torch.randn(DIM, generator=self.generator, dtype=torch.float64)
        self.offset = 0.2 * torch.randn(DIM, generator=self.generator, dtype=torch.float64)
        self.w = (self.w_star + self.offset).requires_grad_(True)

    def gradient(self, batch: int) -> list[torch.Tensor]:
        x = torch.randn(batch, DIM, generator=self.generator, dtype=torch.float64)
        y = x @ self.w_star + NOISE * torch.randn(batch, generator=self.generator, dtype=torch.float64)
        loss = 0.5 * ((x @ self.w - y) ** 2).mean()
        (grad,) = torch.autograd.grad(loss, [self.w])
        return [grad]

    def truth(self, precondition: torch.Tensor | None = None) -> tuple[float, float]:
        """(|G|², tr(Σ)) in the metric of `precondition` (identity if None)."""
        p = torch.ones(DIM, dtype=torch.float64) if precondition is None else precondition
        d2 = float(self.offset.pow(2).sum())
        return float((p * self.offset.pow(2)).sum()), float((p * (d2 + NOISE**2 + self.offset.pow(2))).sum())


def check(scale: NoiseScale, problem: Regression, precondition=None) -> None:
    sqr, var = scale.stats()
    true_sqr, true_trace = problem.truth(precondition)
    assert sqr == pytest.approx(true_sqr, rel=TOLERANCE)
    assert var * scale.init_batch == pytest.approx(true_trace, rel=TOLERANCE)
    assert pgns(sqr, var, scale.init_batch) == pytest.approx(true_trace / true_sqr, rel=TOLERANCE)


@pytest.mark.parametrize("replicas, local_batch", [(4, 16), (2, 64), (8, 4)])
def test_multi_replica_estimate_is_within_15_percent(replicas, local_batch):
    problem, scale = Regression(seed=replicas), NoiseScale(init_batch=32, smoothing=0.99)
    for _ in range(STEPS):
        grads = [problem.gradient(local_batch) for _ in range(replicas)]
        mean = [sum(g[0] for g in grads) / replicas]
        local = sum(squared_norm(g) for g in grads) / replicas
        scale.update(from_replicas(local, squared_norm(mean), local_batch, replicas))
    check(scale, problem)


def test_accumulation_steps_are_samples_too():
    """One replica, 4 micro-batches a step: the per-micro-batch gradients are the K samples."""
    problem, scale = Regression(seed=11), NoiseScale(init_batch=16, smoothing=0.99)
    for _ in range(STEPS):
        micro = [problem.gradient(8) for _ in range(4)]
        total = [sum(g[0] for g in micro) / 4]
        scale.update(from_replicas(sum(squared_norm(g) for g in micro) / 4, squared_norm(total), 8, 4))
    check(scale, problem)


def test_differenced_estimate_with_one_gradient_a_step():
    problem, scale = Regression(seed=5), NoiseScale(init_batch=32, smoothing=0.99)
    previous = problem.gradient(32)
    for _ in range(STEPS):
        current = problem.gradient(32)
        scale.update(from_consecutive(previous, current, 32))
        previous = current
    check(scale, problem)


def test_the_preconditioner_changes_the_metric():
    """Adam-like diagonal preconditioner: the estimate follows |G|²_P and tr(PΣ), not the plain ones."""
    problem, scale = Regression(seed=3), NoiseScale(init_batch=32, smoothing=0.99)
    p = torch.linspace(0.1, 10.0, DIM, dtype=torch.float64)
    for _ in range(STEPS):
        grads = [problem.gradient(16) for _ in range(4)]
        mean = [sum(g[0] for g in grads) / 4]
        scale.update(from_replicas(sum(squared_norm(g, [p]) for g in grads) / 4, squared_norm(mean, [p]), 16, 4))
    check(scale, problem, p)
    plain_sqr, _ = problem.truth()
    assert scale.stats()[0] != pytest.approx(plain_sqr, rel=TOLERANCE)  # the check above could fail


def test_non_finite_steps_are_skipped_never_reported():
    scale = NoiseScale(init_batch=32)
    assert scale.stats() is None
    assert not scale.update(NoiseSample(math.nan, 1.0))
    assert not scale.update(NoiseSample(1.0, math.inf))
    assert scale.stats() is None and scale.skipped == 2
    assert scale.update(NoiseSample(2.0, 64.0))
    assert scale.stats() == pytest.approx((2.0, 2.0))  # bias-corrected: one sample is its own mean
    restored = NoiseScale(init_batch=32)
    restored.load_state_dict(scale.state_dict())
    assert restored.stats() == scale.stats()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least two"):
        from_replicas(1.0, 1.0, 8, 1)
    with pytest.raises(ValueError, match="smoothing"):
        NoiseScale(32, smoothing=1.0)
