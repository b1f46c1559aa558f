"""The work a job declares (target_epochs): carried by workloads and submissions, filled from the
truth or scaled by noise on request, and read against the progress the job reports into the
remaining work the policy sees; a job past its declaration loses it and is never stopped for it."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from cli.main import main
from services.estimator.core import remaining_samples
from services.simulated.truth import job_sources
from services.simulated.world import SimulatedJob
from shared.schema.jobs import JobSpec
from sim.reference import WorkloadJob, load_workload
from sim.run import Simulation, simulate
from sim.workload import BUILT_IN_WORKLOAD, declare_targets, write_workload


@pytest.fixture(scope="module")
def zoo():
    return job_sources(use_zoo=True)


def test_a_workload_carries_declarations_and_refuses_a_bad_one_with_its_line(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text(
        "name,time,application,num_replicas,batch_size,target_epochs\na,0,cifar10,1,128,90\nb,5,bert,2,64,\n"
    )
    jobs = load_workload(path)
    assert [j.target_epochs for j in jobs] == [90.0, None]
    write_workload(jobs, tmp_path / "again.csv")
    assert load_workload(tmp_path / "again.csv") == jobs
    for bad in ("0", "-3", "lots"):
        path.write_text(f"name,time,application,num_replicas,batch_size,target_epochs\na,0,cifar10,1,128,{bad}\n")
        with pytest.raises(ValueError, match="line 2"):
            load_workload(path)


def test_a_submission_declares_positive_epochs_or_none():
    assert (
        msgspec.json.decode(b'{"id": "a", "application": "cifar10", "target_epochs": 12.5}', type=JobSpec).target_epochs
        == 12.5
    )
    for bad in (b"0", b"-1", b'"ten"'):
        with pytest.raises(msgspec.ValidationError, match="target_epochs"):
            msgspec.json.decode(b'{"id": "a", "application": "cifar10", "target_epochs": ' + bad + b"}", type=JobSpec)


def test_targets_are_kept_filled_from_the_truth_dropped_or_scaled_the_same_way_every_run():
    jobs = [WorkloadJob("a", 0, "cifar10", 1, 128, target_epochs=10.0), WorkloadJob("b", 0, "bert", 1, 64)]
    real = {"cifar10": 100, "bert": 2}.__getitem__
    assert [j.target_epochs for j in declare_targets(jobs, real)] == [10.0, None]
    assert [j.target_epochs for j in declare_targets(jobs, real, "from-truth")] == [10.0, 2.0]
    assert [j.target_epochs for j in declare_targets(jobs, real, "none")] == [None, None]
    noisy = declare_targets(jobs * 50, real, "from-truth", (0.5, 2.0))
    factors = [n.target_epochs / j for n, j in zip(noisy, [10.0, 2.0] * 50)]
    assert all(0.5 <= f <= 2.0 for f in factors) and len({round(f, 12) for f in factors}) == 2  # per name
    assert declare_targets(jobs, real, "from-truth", (0.5, 2.0)) == declare_targets(
        jobs, real, "from-truth", (0.5, 2.0)
    )
    assert declare_targets(jobs, real, "from-truth", (0.5, 2.0), seed=1) != declare_targets(
        jobs, real, "from-truth", (0.5, 2.0)
    )
    with pytest.raises(ValueError, match="LO <= HI"):
        declare_targets(jobs, real, "given", (2.0, 0.5))


def test_the_remaining_work_falls_with_progress_and_is_gone_past_the_declaration(zoo):
    truth = zoo.truths["cifar10"]
    total = truth.epochs_total
    job = SimulatedJob(WorkloadJob("a", 0, "cifar10", 1, 128, target_epochs=total / 2), None, 30.0, 1.0)
    seen = []
    for share in (0.0, 0.1, 0.3, 0.49):
        job.progress = share * truth.total_progress
        facts = job.facts(truth, 100.0)
        assert facts.target_epochs == total / 2 and 0 <= facts.epochs <= total
        seen.append(remaining_samples(facts))
    assert all(a > b > 0 for a, b in zip(seen, seen[1:])), seen
    # At the start, what is left is the declared epochs at the first epoch's size.
    assert seen[0] == pytest.approx(total / 2 * truth.epoch_samples(0.0))
    job.progress = 0.6 * truth.total_progress  # past what it declared: no estimate, and it goes on
    assert remaining_samples(job.facts(truth, 200.0)) is None
    undeclared = SimulatedJob(WorkloadJob("b", 0, "cifar10", 1, 128), None, 30.0, 1.0)
    assert remaining_samples(undeclared.facts(truth, 0.0)) is None


def test_jobs_that_declare_a_quarter_of_their_work_still_finish_it(zoo):
    jobs = declare_targets(load_workload(BUILT_IN_WORKLOAD)[:12], lambda m: zoo.truths[m].epochs_total, "from-truth")
    short = [dataclasses.replace(j, target_epochs=j.target_epochs / 4) for j in jobs]
    result = simulate(Simulation(short, "sia-hetero-64", "goodput"), sources=zoo, fairness=False)
    assert result["jobs_unfinished"] == 0
    assert all(parts["compute"] > 0 for parts in result["job_jct_parts_s"].values())


def test_the_commands_take_targets_and_refuse_bad_noise(tmp_path, capsys):
    out = tmp_path / "s.json"
    args = ["simulate", "--zoo", "--no-fairness", "--out", str(out), "--targets", "from-truth"]
    assert main(args + ["--target-noise", "0.5,2"]) == 0
    with pytest.raises(SystemExit) as exit_:
        main(args + ["--target-noise", "2,0.5"])
    assert exit_.value.code == 2
    assert "expected 0 < LO <= HI" in capsys.readouterr().err
    assert json.loads(out.read_text())["jobs_unfinished"] == 0  # the run before the refusal
