"""The built-in model zoo: what the embedded default knows of each model without reference data.

Per model: batch limits, training length in epochs, a PGNS-versus-progress curve (the gradient
statistics of each epoch of the validation run at the initial batch), and per GPU type the throughput parameters fitted on every
measured placement plus the per-GPU batch limits. A hybrid-parallel model (gpt_pmp) also has the
GPUs of one model-parallel replica per type (`group_gpus`); its parameters and batch limits are
per replica (`sim.reference` says how its rows are read). `goodput models zoo` makes `zoo.json` from the
reference profiles; the fitted numbers are committed beside this module, with the command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from goodput_train.goodput import ThroughputParams, fit_throughput, pgns, rmsle
from sim.reference import ModelTrace

ZOO_PATH = Path(__file__).with_name("zoo.json")
ZOO_COMMAND = "goodput models zoo --reference ../shared/reference/sia --out sim/zoo.json"


@dataclass(frozen=True)
class ZooType:
    params: ThroughputParams
    min_local: int
    max_local: int
    rmsle: float


@dataclass(frozen=True)
class ZooModel:
    name: str
    init_batch: int
    max_batch: int
    epochs: int
    progress: np.ndarray  # cumulative statistical progress at the end of each epoch
    grad_sqr: np.ndarray  # |g|^2 during that epoch
    grad_var: np.ndarray  # tr(Sigma) / M0 during that epoch
    types: dict[str, ZooType]
    group_gpus: dict[str, int] = field(default_factory=dict)  # hybrid-parallel: GPUs of a replica per type

    def stats_at(self, progress: float) -> tuple[float, float]:
        """(grad_sqr, grad_var) at a point of training: the epoch's values, the last epoch's past the end."""
        epoch = min(int(np.searchsorted(self.progress, progress, side="right")), len(self.progress) - 1)
        return float(self.grad_sqr[epoch]), float(self.grad_var[epoch])

    def pgns_at(self, progress: float) -> float:
        """PGNS at a point of training (inf once the gradient signal has vanished: efficiency 1)."""
        return pgns(*self.stats_at(progress), self.init_batch)

    @property
    def total_progress(self) -> float:
        return float(self.progress[-1])


def build_zoo(traces: dict[str, ModelTrace]) -> dict:
    """The JSON document of the zoo, fitted from reference traces."""
    models = {}
    for name in sorted(traces):
        trace = traces[name]
        run = trace.validation[trace.init_batch]
        groups = trace.group_gpus
        types = {}
        for gpu_type, meas in trace.placements.items():
            obs = meas.observations(groups.get(gpu_type, 1))
            params = fit_throughput(obs)
            lo, hi = trace.local_bsz_limits(gpu_type)
            types[gpu_type] = {
                "params": params._asdict(),
                "min_local": lo,
                "max_local": hi,
                "rmsle": round(rmsle(params, obs), 4),
            }
        models[name] = {
            "init_batch": trace.init_batch,
            "max_batch": trace.max_batch,
            "epochs": len(run),
            "progress": [float(p) for p in run.progress],
            "grad_sqr": [float(v) for v in run.grad_sqr],
            "grad_var": [float(v) for v in run.grad_var],
            "group_gpus": groups,
            "types": types,
        }
    return {"made_by": ZOO_COMMAND, "models": models}


def load_zoo(path: str | Path = ZOO_PATH) -> dict[str, ZooModel]:
    doc = json.loads(Path(path).read_text())
    return {
        name: ZooModel(
            name=name,
            init_batch=m["init_batch"],
            max_batch=m["max_batch"],
            epochs=m["epochs"],
            progress=np.asarray(m["progress"]),
            grad_sqr=np.asarray(m["grad_sqr"]),
            grad_var=np.asarray(m["grad_var"]),
            types={
                t: ZooType(ThroughputParams(**v["params"]), v["min_local"], v["max_local"], v["rmsle"])
                for t, v in m["types"].items()
            },
            group_gpus=m.get("group_gpus", {}),
        )
        for name, m in doc["models"].items()
    }
