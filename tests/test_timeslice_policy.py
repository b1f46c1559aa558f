"""The `timeslice` policy in the round-based simulator: early feedback for all, paid in switches."""

import pytest

from policies.base import make_policy
from services.simulated.truth import job_sources
from sim.reference import WorkloadJob
from sim.run import Simulation, simulate

ZOO = job_sources(use_zoo=True)


@pytest.fixture()
def one_gpu(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text("name: one-gpu\nnodes:\n  - {gpu_type: aws, count: 1, gpus_per_node: 1}\n")
    return str(path)


def trials(n=4):
    # A small hyper-parameter search: n cifar10 trials submitted together, one GPU each.
    return [WorkloadJob(f"trial-{i}", 0, "cifar10", 1, 128) for i in range(n)]


def run(cluster, policy, **options):
    # Both policies decide every 30 s round, so that they differ only in whom they run.
    return simulate(
        Simulation(
            trials(),
            cluster,
            policy,
            calibration="none",
            feedback_iterations=200,
            restart_delay_s=5.0,
            round_s=30.0,
            policy_options={"round_s": 30.0, **options},
        ),
        sources=ZOO,
    )


def test_every_trial_gets_early_feedback_at_the_cost_of_switches(one_gpu):
    fifo = run(one_gpu, "fifo")
    sliced = run(one_gpu, "timeslice", quantum=200)
    last_feedback = lambda r: max(j["feedback_s"] for j in r["jobs"])  # noqa: E731
    # Run to completion: the last trial's first 200 iterations wait for three whole trials.
    assert last_feedback(sliced) < 0.1 * last_feedback(fifo)
    assert sliced["restarts_per_job"] > 1 and fifo["restarts_per_job"] == 0
    # The same useful work, plus one switch delay per restart: the makespan grows by that much, give or
    # take a round of idle GPUs after each job finishes (decisions are made on round boundaries).
    extra = sum(j["restarts"] for j in sliced["jobs"]) * 5.0
    assert sliced["makespan_s"] == pytest.approx(fifo["makespan_s"] + extra, abs=len(trials()) * 30.0)
    assert all(j["finish_s"] is not None for j in sliced["jobs"])


def test_a_quantum_longer_than_any_job_is_run_to_completion(one_gpu):
    fifo = run(one_gpu, "fifo")
    whole = run(one_gpu, "timeslice", quantum=10**9)
    assert [j["jct_s"] for j in whole["jobs"]] == pytest.approx([j["jct_s"] for j in fifo["jobs"]])


def test_timeslice_options_are_checked():
    with pytest.raises(ValueError, match="quantum"):
        make_policy("timeslice", quantum=0)
    assert make_policy("timeslice", quantum=5).quantum == 5
