"""How well the throughput model predicts measured iteration times, fully fitted and bootstrapped.

For every (model, GPU type) of a reference folder:
- fit on all of the type's measured placements and report the relative error of predicted versus
  measured iteration time over those placements (median, p90);
- bootstrap it as a new job would be: the type's 1-GPU profile alone, plus the projection from
  another type the job ran multi-GPU on (fitted on all of that type's placements), once from each
  other type; report how far its predictions are from the fully fitted model's and from the
  measurements, per source and as the median over sources.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from goodput_train.goodput import ThroughputParams, fit_throughput, iteration_time
from services.estimator.core import type_models
from sim.profiles import trace_profile
from sim.reference import Measurements, ModelTrace

FITTED_TARGET = 0.10  # median error of a fitted model with multi-GPU data (Pollux: <= 10%)
BOOTSTRAP_TARGET = 0.25  # median distance of a bootstrapped model from the fitted one

# Profiles of one machine under two names (the reference README: dgx-ext is the DGX of dgx with a
# longer batch sweep). Projecting between them would flatter the bootstrap, so it is not done.
SAME_HARDWARE = {frozenset({"dgx", "dgx-ext"})}


def _predict(params: ThroughputParams, meas: Measurements) -> np.ndarray:
    return iteration_time(params, meas.nodes, meas.gpus, meas.local_bsz, 0)


def _errors(predicted: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    err = np.abs(predicted / reference - 1.0)
    return {"median": float(np.median(err)), "p90": float(np.quantile(err, 0.9))}


@dataclass
class TypeReport:
    model: str
    gpu_type: str
    placements: int
    multi_gpu: bool
    params: dict
    error: dict  # fitted vs measured: median, p90
    bootstrap: dict = field(default_factory=dict)  # source type -> {"vs_fitted", "vs_measured"}
    note: str = ""

    @property
    def fitted_ok(self) -> bool:
        return not self.multi_gpu or self.error["median"] <= FITTED_TARGET

    @property
    def bootstrap_median(self) -> float | None:
        """Median over source types of the bootstrapped model's median distance from the fitted one."""
        if not self.bootstrap:
            return None
        return float(np.median([b["vs_fitted"]["median"] for b in self.bootstrap.values()]))

    @property
    def bootstrap_best(self) -> str | None:
        if not self.bootstrap:
            return None
        return min(self.bootstrap, key=lambda t: self.bootstrap[t]["vs_fitted"]["median"])

    @property
    def bootstrap_ok(self) -> bool | None:
        median = self.bootstrap_median
        return None if median is None else median <= BOOTSTRAP_TARGET

    def to_dict(self) -> dict:
        return asdict(self) | {
            "fitted_ok": self.fitted_ok,
            "bootstrap_median": self.bootstrap_median,
            "bootstrap_best": self.bootstrap_best,
            "bootstrap_ok": self.bootstrap_ok,
        }


def _single_gpu(meas: Measurements) -> bool:
    return bool((meas.gpus == 1).any())


def report_model(trace: ModelTrace) -> list[TypeReport]:
    fitted = {t: fit_throughput(m.observations()) for t, m in trace.placements.items()}
    profiles = {t: trace_profile(trace, t) for t, m in trace.placements.items() if _single_gpu(m)}
    reports = []
    for gpu_type, meas in trace.placements.items():
        params = fitted[gpu_type]
        rep = TypeReport(
            trace.name,
            gpu_type,
            len(meas),
            bool((meas.gpus > 1).any()),
            params._asdict(),
            _errors(_predict(params, meas), meas.step_time),
        )
        sources = [
            t
            for t, m in trace.placements.items()
            if t != gpu_type and t in profiles and (m.gpus > 1).any() and frozenset({t, gpu_type}) not in SAME_HARDWARE
        ]
        if gpu_type not in profiles:
            rep.note = "no 1-GPU measurement to bootstrap from (model-parallel unit)"
        for source in sources:
            pair = {t: profiles[t] for t in (gpu_type, source)}
            boot = type_models(pair, {source: trace.placements[source].observations()})[gpu_type]
            predicted = _predict(boot, meas)
            rep.bootstrap[source] = {
                "vs_fitted": _errors(predicted, _predict(params, meas)),
                "vs_measured": _errors(predicted, meas.step_time),
            }
        reports.append(rep)
    return reports


def report(traces: dict[str, ModelTrace]) -> list[TypeReport]:
    return [r for name in sorted(traces) for r in report_model(traces[name])]
