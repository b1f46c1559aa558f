"""The lower bounds on a workload's average JCT (sim.bound, `goodput bound`): no schedule of the
simulator beats them, the capacity LP prices a full cluster, and the command says what it found."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cli.main import main
from services.simulated.truth import job_sources
from sim.bound import Placement, hull, workload_bounds
from sim.reference import load_workload, reference_root
from sim.run import Simulation, simulate
from sim.workload import BUILT_IN_WORKLOAD

PHILLY = "sia/sia-simulator/workloads/philly/workload-1.csv"


@pytest.fixture(scope="module")
def zoo():
    return job_sources(use_zoo=True)


def per_job_bounds(jobs, cluster, sources) -> dict[str, float]:
    """Each job's infinite-cluster JCT bound, by name."""
    from shared.cluster import load_cluster
    from shared.settings import simulation_settings
    from sim.bound import job_bounds

    bounds, _ = job_bounds(jobs, load_cluster(cluster), sources.truths, simulation_settings(None, cluster))
    return {b.name: b.jct_s for b in bounds}


@pytest.mark.parametrize("policy", ["goodput", "sia"])
def test_no_job_finishes_sooner_than_its_infinite_cluster_bound(policy, zoo):
    jobs = load_workload(BUILT_IN_WORKLOAD)
    result = simulate(Simulation(jobs, "sia-hetero-64", policy), sources=zoo, fairness=False)
    bound = per_job_bounds(jobs, "sia-hetero-64", zoo)
    finished = [j for j in result["jobs"] if j["jct_s"] is not None]
    assert len(finished) == len(jobs)
    assert all(j["jct_s"] >= bound[j["name"]] - 1e-6 for j in finished), [
        (j["name"], j["jct_s"], bound[j["name"]]) for j in finished if j["jct_s"] < bound[j["name"]]
    ]
    # And not a trivial bound: some job comes within a quarter of it.
    assert min(j["jct_s"] / bound[j["name"]] for j in finished) < 1.25


def test_the_bound_holds_on_the_measured_profiles_too():
    root = reference_root()
    sources = job_sources(str(root))
    jobs = load_workload(root / PHILLY)[:24]
    result = simulate(Simulation(jobs, "sia-hetero-64", "goodput"), sources=sources, fairness=False)
    bound = per_job_bounds(jobs, "sia-hetero-64", sources)
    assert all(j["jct_s"] >= bound[j["name"]] - 1e-6 for j in result["jobs"])


def test_the_capacity_lp_lies_between_the_infinite_cluster_bound_and_every_policy(zoo):
    jobs = load_workload(BUILT_IN_WORKLOAD)[:16]
    bounds = workload_bounds(jobs, "sia-hetero-64", sources=zoo, lp=True)
    policies = [
        simulate(Simulation(jobs, "sia-hetero-64", p), sources=zoo, fairness=False)["avg_jct_s"]
        for p in ("goodput", "sia")
    ]
    assert bounds["infinite_cluster_s"] <= bounds["capacity_lp_s"] + 1e-6
    assert bounds["capacity_lp_s"] <= min(policies)


def test_a_cluster_too_small_for_every_job_at_once_raises_the_lp_above_the_infinite_cluster_bound(zoo, tmp_path):
    # Eight cifar10 jobs at once on 4 GPUs: alone each would take all four; together they queue.
    cluster = tmp_path / "four.yaml"
    cluster.write_text("nodes: [{gpu_type: dgx-ext, count: 1, gpus_per_node: 4}]\n")
    jobs = [replace(j, time=0.0) for j in load_workload(BUILT_IN_WORKLOAD) if j.application == "cifar10"][:8]
    bounds = workload_bounds(jobs, str(cluster), sources=zoo, lp=True, slot_s=60.0)
    assert bounds["capacity_lp_s"] > 2 * bounds["infinite_cluster_s"]
    policy = simulate(Simulation(jobs, str(cluster), "goodput"), sources=zoo, fairness=False)["avg_jct_s"]
    assert bounds["capacity_lp_s"] <= policy


def test_hull_keeps_only_placements_that_no_shared_slot_beats():
    a = {Placement("a", 1): 100.0, Placement("a", 2): 60.0, Placement("a", 3): 58.0, Placement("a", 4): 30.0}
    a[Placement("a", 5)] = 40.0  # slower than 4: never kept
    kept = [p.gpus for p, _ in hull(a | {Placement("b", 2): 10.0}, ["a", "b"])]
    # 2 and 3 GPUs of a: half a slot on 1 and half on 4 is faster for no more GPUs on average.
    assert kept == [1, 4, 2]


def test_goodput_bound_prints_the_infinite_cluster_bound_last_and_as_json(capsys):
    path = str(reference_root() / PHILLY)
    assert main(["bound", path]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("  infinite cluster (each job alone, from its first round):")
    assert main(["bound", path, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 700 <= result["infinite_cluster_s"] <= 800
    assert float(last.split(":")[1].removesuffix(" s")) == pytest.approx(result["infinite_cluster_s"], abs=0.1)
    assert result["models"]["cifar10"]["jobs"] == 134


def test_goodput_bound_refuses_bad_input_clearly(tmp_path, capsys):
    assert main(["bound", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err
    assert main(["bound", str(BUILT_IN_WORKLOAD), "--zoo", "--slot", "0"]) == 2
    assert "--slot is a number of seconds above 0" in capsys.readouterr().err
    unknown = tmp_path / "w.csv"
    unknown.write_text("name,time,application,num_replicas,batch_size\nj,0,nosuchmodel,1,32\n")
    assert main(["bound", str(unknown), "--zoo"]) == 2
    assert "nosuchmodel" in capsys.readouterr().err


def test_compare_shows_each_policys_way_from_sia_to_the_bound(tmp_path, capsys):
    out = tmp_path / "c.json"
    lines = BUILT_IN_WORKLOAD.read_text().splitlines(keepends=True)
    files = [tmp_path / "a.csv", tmp_path / "b.csv"]  # two sets of one file each
    files[0].write_text("".join(lines[:13]))
    files[1].write_text("".join(lines[:1] + lines[13:21]))
    args = ["compare", "--workloads", *map(str, files), "--policies", "sia", "fifo", "--zoo", "--no-fairness"]
    assert main([*args, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["table"]
    for f in files:
        table = {row["policy"]: row for row in rows if row["workloads"] == str(f)}
        assert table["sia"]["to_bound"] == pytest.approx(0.0)
        bound, sia, fifo = table["sia"]["bound_s"], table["sia"]["avg_jct_s"], table["fifo"]["avg_jct_s"]
        assert table["fifo"]["to_bound"] == pytest.approx((sia - fifo) / (sia - bound))
    assert "sia→bound" in capsys.readouterr().out
