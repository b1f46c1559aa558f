"""Finish-time fairness: rho = JCT shared / JCT alone on a 1/N share, from the same job model."""

import pytest

from services.simulated.truth import job_sources
from shared.cluster import load_cluster
from sim.fairness import fair_share, jobs_sharing
from sim.reference import WorkloadJob
from sim.run import Simulation, simulate

ZOO = job_sources(use_zoo=True)


@pytest.mark.parametrize("policy", ["sia", "pollux", "gavel"])
def test_a_job_alone_has_rho_one(policy):
    result = simulate(
        Simulation([WorkloadJob("cifar10-0", 0, "cifar10", 2, 256)], "sia-hetero-64", policy), sources=ZOO
    )
    (job,) = result["jobs"]
    assert job["rho"] == 1.0
    assert result["rho_max"] == 1.0 and result["rho_over_1"] == 0.0


def test_jobs_crowding_a_small_cluster_wait_for_each_other():
    """Eight jobs at once on 4 GPUs: the share is half a GPU, and the last to finish took longer
    than it would have alone on it (rho > 1), while the first finished sooner (rho < 1)."""
    jobs = [WorkloadJob(f"cifar10-{i}", 0, "cifar10", 1, 128) for i in range(8)]
    result = simulate(Simulation(jobs, "examples/clusters/one-node-4xT4.yaml", "sia"), sources=ZOO)
    rhos = [j["rho"] for j in result["jobs"]]
    assert all(r is not None for r in rhos)
    assert max(rhos) > 1.0 > min(rhos)
    assert result["rho_over_1"] == pytest.approx(sum(r > 1 for r in rhos) / len(rhos), abs=1e-4)


def test_the_fair_share_is_a_1_over_n_slice_of_each_type():
    cluster = load_cluster("sia-hetero-64")
    assert fair_share(cluster, 1.0) == (cluster, 1.0)
    share, stretch = fair_share(cluster, 4.0)
    assert stretch == 1.0
    for t in cluster.gpu_types:
        assert share.capacity(t) == cluster.capacity(t) // 4
    assert {n.name for n in share.nodes} <= {n.name for n in cluster.nodes}  # the first nodes of each type
    tiny, stretch = fair_share(cluster, 1000.0)  # under one GPU of any type
    assert all(tiny.capacity(t) == 1 for t in cluster.gpu_types)
    assert stretch == pytest.approx(1000.0 / max(cluster.capacity(t) for t in cluster.gpu_types))


def test_jobs_sharing_is_the_mean_active_count_over_the_jobs_lifetime():
    timeline = [{"t": 0.0, "active": 1}, {"t": 60.0, "active": 3}, {"t": 120.0, "active": 5}, {"t": 180.0, "active": 9}]
    assert jobs_sharing(timeline, 60.0, 180.0) == 4.0
    assert jobs_sharing(timeline, 500.0, 600.0) == 1.0  # no round in the window: alone
    assert jobs_sharing([{"t": 0.0, "active": 0}], 0.0, 60.0) == 1.0
