"""Learning-rate scaling rules: the factor on the base learning rate (tuned at batch M0) when a job
trains at batch M, and how much statistical progress a step at M makes.

- `adascale` (default for SGD): gain r = (σ² + μ²) / (σ²/k + μ²), k = M/M0, σ² the variance of a
  gradient over M0 examples and μ² = |G|² (the noise scale's own statistics); lr × r, and a step
  counts as r steps at M0 (scale-invariant iterations).
- `sqrt` (default for Adam/AdamW): lr × sqrt(k).
- `linear`: lr × k.
- `legw` (linear-epoch gradual warm-up): sqrt(k) once warm; the warm-up, `warmup` M0-epochs at M0,
  lasts k times longer at batch M, the factor rising linearly to sqrt(k) across it.

Progress is counted in M0-equivalent examples: a step at batch M makes EFFICIENCY(M)·M of them
(adascale: r·M0, which equals it when the statistics are exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from goodput_train.goodput import efficiency, pgns

RULES = ("adascale", "sqrt", "linear", "legw")


def default_rule(optimizer_name: str) -> str:
    """AdaScale for SGD, square-root scaling for the adaptive optimisers."""
    return "adascale" if optimizer_name.lower() == "sgd" else "sqrt"


@dataclass(frozen=True)
class LrScaling:
    rule: str
    init_batch: int
    warmup_epochs: float = 0.0  # legw: warm-up length in epochs at M0

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"unknown learning-rate rule {self.rule!r}; choose one of {', '.join(RULES)}")
        if self.init_batch < 1 or self.warmup_epochs < 0:
            raise ValueError("init_batch must be >= 1 and warmup_epochs >= 0")

    def gain(self, batch: int, grad_sqr: float | None, grad_var: float | None) -> float:
        """AdaScale's gain r in [1, k]; k itself while there are no statistics (as if all noise)."""
        k = batch / self.init_batch
        if grad_sqr is None or grad_var is None or not (grad_sqr > 0 and grad_var >= 0):
            return k
        return (grad_var + grad_sqr) / (grad_var / k + grad_sqr)

    def factor(
        self, batch: int, grad_sqr: float | None = None, grad_var: float | None = None, epochs_done: float = 0.0
    ) -> float:
        """The multiplier on the base learning rate for a step at `batch`."""
        k = batch / self.init_batch
        if self.rule == "adascale":
            return self.gain(batch, grad_sqr, grad_var)
        if self.rule == "linear":
            return k
        if self.rule == "legw" and self.warmup_epochs > 0:
            warm = min(1.0, epochs_done / (self.warmup_epochs * k))
            return math.sqrt(k) * warm
        return math.sqrt(k)

    def progress(self, batch: int, grad_sqr: float | None, grad_var: float | None) -> float:
        """M0-equivalent examples one step at `batch` is worth."""
        if self.rule == "adascale":
            return self.gain(batch, grad_sqr, grad_var) * self.init_batch
        return float(efficiency(pgns(grad_sqr, grad_var, self.init_batch), self.init_batch, batch)) * batch
