"""The fault-injection suite (chaos/suite.py): its faults on a small workload over the real stack,
and the pieces that make them survivable (a failed solve keeps the previous allocation, a late
apply cannot undo a newer round, invalid messages are refused)."""

from __future__ import annotations

import json

import msgspec
import pytest

from chaos.suite import FIELDS, REQUESTS, invalid_payloads, overfilled
from shared.cluster import load_cluster
from shared.schema.jobs import JobSpec
from shared.schema.rounds import ApplyRequest, JobModels
from sim.reference import WorkloadJob, load_workload

CLUSTER = "sia-hetero-64"


@pytest.mark.e2e
def test_the_suite_loses_nothing_under_its_faults(tmp_path, capsys):
    """Through `goodput chaos`: a NATS restart, the leader paused past its lease, invalid, duplicated
    and reordered messages — each job completes once, no node is over-filled, the average JCT is the
    undisturbed run's. (A failed solve is tested on the direct wiring below, to keep this file short.)"""
    from cli.main import main

    out = tmp_path / "report.json"
    code = main(["chaos", "--jobs", "8", "--out", str(out), "--faults", "restart-nats", "pause-leader", "bad-messages"])
    rows = json.loads(out.read_text())["faults"]
    assert [r["fault"] for r in rows] == ["baseline", "restart-nats", "pause-leader", "bad-messages"]
    for row in rows:
        assert set(FIELDS) <= set(row)
        assert row["jobs_submitted"] == row["jobs_completed"] == 8, row
        assert row["jobs_lost"] == row["jobs_duplicated"] == row["capacity_violations"] == 0, row
        assert row["rounds_checked"] > 0 and not row["services_crashed"], row
        assert abs(row["avg_jct_ratio"] - 1) <= 0.10, row
    notes = {r["fault"]: " ".join(r["notes"]) for r in rows}
    assert "stepped down on waking" in notes["pause-leader"]
    assert "answered error 400: 240" in notes["bad-messages"]  # every invalid request refused
    assert code == 0 and "| restart-nats | 8 | 8 | 0 | 0 | 0 |" in capsys.readouterr().out


def test_a_failed_solve_keeps_the_previous_allocation_for_that_round():
    from sim.run import Simulation, simulate

    jobs = load_workload("examples/workloads/mixed-40.csv")[:8]
    result = simulate(
        Simulation(jobs, CLUSTER, "chaos", use_zoo=True, policy_options={"fail_round": 5, "how": "raise"}),
        fairness=False,
    )
    assert result["jobs_finished"] == 8
    assert [e for e in result["events"] if "chaos" in e] == [
        "300s: policy chaos failed (RuntimeError: chaos: the solver failed in round 5); previous allocation kept"
    ]


def test_the_chaos_policy_refuses_an_unknown_failure():
    from policies.base import make_policy

    with pytest.raises(ValueError, match="how must be one of"):
        make_policy("chaos", how="explode")


def test_a_late_apply_does_not_undo_a_newer_round():
    """A deposed leader's apply, or one repeated on the bus, arrives after the next round ran."""
    from services.simulated.truth import job_sources
    from services.simulated.world import SimulatedExecutors
    from shared.settings import simulation_settings

    cluster = load_cluster(CLUSTER)
    executors = SimulatedExecutors(cluster, simulation_settings(None, CLUSTER), 1)
    executors.add(WorkloadJob("a", 0.0, "cifar10", 1, 128), job_sources(use_zoo=True).truths["cifar10"])
    first, second = ((cluster.nodes[0].name, 1),), ((cluster.nodes[1].name, 1),)
    types = {n.gpu_type for n in cluster.nodes}
    models = {"a": JobModels("a", {}, {t: (1, 256) for t in types}, 128, 1024)}
    executors.apply(ApplyRequest(0.0, {"a": first}, models, False))
    executors.advance(0.0, 60.0, ["a"])
    executors.apply(ApplyRequest(60.0, {"a": second}, models, False))
    executors.advance(60.0, 60.0, ["a"])
    job = executors.jobs["a"]
    before = (job.placement, job.restarts)
    executors.apply(ApplyRequest(60.0, {"a": first}, models, False))  # round 60 again, after it ran
    executors.apply(ApplyRequest(0.0, {"a": first}, models, False))  # round 0, late
    assert (job.placement, job.restarts) == before == (second, 1)


@pytest.mark.parametrize("message_type", [*REQUESTS.values(), JobSpec], ids=lambda t: t.__name__)
def test_invalid_payloads_never_decode(message_type):
    payloads = invalid_payloads(message_type, 30)
    assert len(payloads) == 30
    for data in payloads:
        with pytest.raises((msgspec.DecodeError, ValueError, TypeError)):
            msgspec.msgpack.decode(data, type=message_type)


def test_overfilled_counts_nodes_over_capacity_and_unknown_nodes():
    cluster = load_cluster(CLUSTER)
    node = cluster.nodes[0]
    assert overfilled(cluster, {"a": ((node.name, node.gpus),)}) == 0
    assert overfilled(cluster, {"a": ((node.name, node.gpus),), "b": ((node.name, 1),)}) == 1
    assert overfilled(cluster, {"a": (("nowhere", 1),)}) == 2  # an unknown node, over its zero GPUs
