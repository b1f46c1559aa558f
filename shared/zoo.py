"""The built-in model zoo: what the embedded default knows of each model without reference data.

Per model: batch limits, training length in epochs, a PGNS-versus-progress curve (from the
validation run at the initial batch), and per GPU type the throughput parameters fitted on every
measured placement plus the per-GPU batch limits. `goodput models zoo` makes `zoo.json` from the
reference profiles; the fitted numbers are committed beside this module, with the command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.goodput import ThroughputParams, fit_throughput, rmsle
from shared.reference import ModelTrace

ZOO_PATH = Path(__file__).with_name("zoo.json")
ZOO_COMMAND = "goodput models zoo --reference ../shared/reference/sia --out shared/zoo.json"


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
    progress: np.ndarray   # cumulative statistical progress at the end of each epoch
    pgns: np.ndarray       # PGNS during that epoch
    types: dict[str, ZooType]

    def pgns_at(self, progress: float) -> float:
        """PGNS at a point of training: the epoch's value, the last epoch's past the end."""
        epoch = min(int(np.searchsorted(self.progress, progress, side="right")), len(self.pgns) - 1)
        return float(self.pgns[epoch])

    @property
    def total_progress(self) -> float:
        return float(self.progress[-1])


def build_zoo(traces: dict[str, ModelTrace]) -> dict:
    """The JSON document of the zoo, fitted from reference traces."""
    models = {}
    for name in sorted(traces):
        trace = traces[name]
        run = trace.validation[trace.init_batch]
        types = {}
        for gpu_type, meas in trace.placements.items():
            obs = meas.observations()
            params = fit_throughput(obs)
            lo, hi = trace.local_bsz_limits(gpu_type)
            types[gpu_type] = {"params": params._asdict(), "min_local": lo, "max_local": hi,
                               "rmsle": round(rmsle(params, obs), 4)}
        models[name] = {
            "init_batch": trace.init_batch,
            "max_batch": trace.max_batch,
            "epochs": len(run),
            "progress": [float(p) for p in run.progress],
            "pgns": [float(trace.init_batch * v / s) for v, s in zip(run.grad_var, run.grad_sqr)],
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
            pgns=np.asarray(m["pgns"]),
            types={t: ZooType(ThroughputParams(**v["params"]), v["min_local"], v["max_local"], v["rmsle"])
                   for t, v in m["types"].items()},
        )
        for name, m in doc["models"].items()
    }
