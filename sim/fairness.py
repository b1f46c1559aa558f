"""Finish-time fairness: how much longer a job took in the shared cluster than it would have alone
on its fair share of it.

    rho = JCT in the shared cluster / JCT alone on 1/N of the cluster,

N being the average number of jobs active during the job's lifetime (Themis' definition, as the
Pollux and Sia papers use it). The denominator comes from the same job model and the same policy:
the simulator runs the job alone on a cluster made of 1/N of each GPU type's GPUs (the first nodes
of each type, the last one partly), so a job that was alone all along has rho = 1 exactly. When 1/N
of the cluster is less than one GPU of any type, the job runs alone on one GPU of each type and its
time is stretched by the slice it would get (1 / (largest type's GPUs / N)). A hybrid-parallel job's
unit is its model-parallel group instead of a GPU: a type's share counts only if it holds a group,
and under one group of every type it runs on, on one group of each of those types.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from policies.base import Policy
from services.simulated.truth import ModelTruth
from shared.cluster import Cluster
from shared.schema.base import Node
from shared.settings import SimSettings
from sim.reference import WorkloadJob
from sim.simulator import Simulator


def jobs_sharing(timeline: list[dict], start_s: float, end_s: float) -> float:
    """N: the average number of active jobs over the rounds in [start, end); at least 1."""
    active = [r["active"] for r in timeline if start_s <= r["t"] < end_s]
    return max(1.0, float(np.mean(active))) if active else 1.0


def fair_share(cluster: Cluster, n: float, units: Mapping[str, int] | None = None) -> tuple[Cluster, float]:
    """The cluster's 1/n (each type's GPUs / n, rounded down, on its first nodes), and how much
    slower than that cluster the job is for getting only a slice of one of its units (1 unless
    under a unit of every type). `units`: the GPUs of the job's unit on each type it runs on (a
    hybrid-parallel job's model-parallel group); default one GPU on every type."""
    if n <= 1.0:
        return cluster, 1.0
    units = units or {t: 1 for t in cluster.gpu_types}
    usable = [t for t in cluster.gpu_types if t in units and cluster.gpus_per_node(t) >= units[t]]
    shares = {t: int(cluster.capacity(t) / n) for t in cluster.gpu_types}
    if not any(shares[t] >= units[t] for t in usable):
        one_each = tuple(
            next(Node(node.name, t, units[t]) for node in cluster.nodes if node.gpu_type == t and node.gpus >= units[t])
            for t in usable
        )
        return Cluster(f"{cluster.name}/{n:.2f}", one_each), n / max(cluster.capacity(t) / units[t] for t in usable)
    nodes = []
    for node in cluster.nodes:
        gpus = min(node.gpus, shares[node.gpu_type])
        if gpus:
            nodes.append(Node(node.name, node.gpu_type, gpus))
            shares[node.gpu_type] -= gpus
    return Cluster(f"{cluster.name}/{n:.2f}", tuple(nodes)), 1.0


class AloneRuns:
    """Each job's JCT alone on a cluster, by simulation, cached per (model, request, cluster)."""

    def __init__(
        self,
        make_policy: Callable[[], Policy],
        settings: SimSettings,
        truths: Mapping[str, ModelTruth],
        profiles,
        feedback_iterations: int,
    ):
        self.make_policy = make_policy
        self.settings = settings
        self.truths = truths
        self.profiles = profiles
        self.feedback_iterations = feedback_iterations
        self._jct: dict[tuple, float | None] = {}

    def jct(self, job: WorkloadJob, cluster: Cluster) -> float | None:
        key = (job.application, job.num_replicas, job.batch_size, cluster.nodes)
        if key not in self._jct:
            alone = WorkloadJob(job.name, 0.0, job.application, job.num_replicas, job.batch_size)
            sim = Simulator(
                [alone],
                cluster,
                self.make_policy(),
                self.settings,
                self.truths,
                self.profiles,
                self.feedback_iterations,
            )
            sim.run()
            self._jct[key] = sim.records()[0].finish_s
        return self._jct[key]


def finish_time_fairness(result: dict, workload: list[WorkloadJob], cluster: Cluster, alone: AloneRuns) -> None:
    """Add each job's rho (None if it, or its alone run, did not finish), the fraction of finished
    jobs with rho > 1 and the largest rho to a simulation's result document."""
    spec = {job.name: job for job in workload}
    for job in result["jobs"]:
        job["rho"] = None
        if job["jct_s"] is None:
            continue
        truth = alone.truths[job["application"]]
        units = {t: truth.group_gpus.get(t, 1) for t in truth.types}
        share, stretch = fair_share(cluster, jobs_sharing(result["timeline"], job["submit_s"], job["finish_s"]), units)
        alone_jct = alone.jct(spec[job["name"]], share)
        if alone_jct:
            job["rho"] = round(job["jct_s"] / (alone_jct * stretch), 4)
    rhos = [j["rho"] for j in result["jobs"] if j["rho"] is not None]
    result["rho_max"] = max(rhos) if rhos else None
    result["rho_over_1"] = round(sum(r > 1 + 1e-9 for r in rhos) / len(rhos), 4) if rhos else None
    result["rho_p99"] = round(float(np.percentile(rhos, 99)), 4) if rhos else None
