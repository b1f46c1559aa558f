"""Round states built from the model zoo, for policy tests and benchmarks (no reference data needed)."""

from __future__ import annotations

from policies.base import JobView, RoundState
from shared.cluster import Cluster, load_cluster
from shared.schema.base import Config, Spots
from shared.schema.rounds import JobModels
from sim.zoo import load_zoo

_ZOO = load_zoo()


def job_models(
    job_id: str,
    model: str,
    cluster: Cluster,
    progress: float = 0.0,
    max_gpus_seen: int = 0,
    min_gpus: int = 1,
    fixed_gpus: int | None = None,
    fixed_batch: int | None = None,
    gpu_types: tuple[str, ...] | None = None,
) -> JobModels:
    """The estimator's view of a job of a zoo model, fully profiled on every type of the cluster (or
    only on `gpu_types`)."""
    zoo = _ZOO[model]
    types = {t: zoo.types[t] for t in cluster.gpu_types if t in zoo.types and (gpu_types is None or t in gpu_types)}
    sqr, var = zoo.stats_at(progress)
    return JobModels(
        job_id,
        {t: z.params for t, z in types.items()},
        {t: (z.min_local, z.max_local) for t, z in types.items()},
        zoo.init_batch,
        zoo.max_batch,
        sqr,
        var,
        min_gpus=min_gpus,
        max_gpus_seen=max_gpus_seen,
        fixed_gpus=fixed_gpus,
        fixed_batch=fixed_batch,
        group_gpus={t: g for t, g in zoo.group_gpus.items() if t in types},
    )


def job_view(
    job_id: str,
    model: str,
    cluster: Cluster,
    *,
    age_s: float = 600.0,
    restarts: int = 0,
    restart_cost_s: float = 30.0,
    attained_gpu_s: float = 0.0,
    current: Config | None = None,
    placement: Spots = (),
    mid_restart: bool = False,
    requested_gpus: int = 4,
    requested_batch: int | None = None,
    submit_s: float = 0.0,
    **model_kw,
) -> JobView:
    models = job_models(job_id, model, cluster, **model_kw)
    by_type = {t: 0.0 for t in cluster.gpu_types}
    if current is not None:
        by_type[current.gpu_type] = attained_gpu_s
    return JobView(
        job_id,
        model,
        submit_s,
        age_s,
        restarts,
        restart_cost_s,
        attained_gpu_s,
        by_type,
        current,
        placement,
        mid_restart,
        requested_gpus,
        requested_batch or models.init_batch * requested_gpus,
        models,
    )


def round_state(jobs: list[JobView], cluster: Cluster | str = "sia-hetero-64", now_s: float = 3600.0) -> RoundState:
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    return RoundState(now_s, cluster, tuple(jobs))
