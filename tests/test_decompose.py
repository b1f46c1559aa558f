"""Where a simulated job's time went (sim.decompose): the parts add up to each JCT, its compute is
the bound's best time for its work, and the commands print them."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from services.simulated.truth import job_sources
from shared.cluster import load_cluster
from shared.settings import simulation_settings
from sim.bound import model_times
from sim.decompose import PARTS
from sim.reference import load_workload
from sim.run import Simulation, simulate
from sim.workload import BUILT_IN_WORKLOAD


@pytest.fixture(scope="module")
def zoo():
    return job_sources(use_zoo=True)


@pytest.mark.parametrize("policy", ["goodput", "sia"])
def test_each_jobs_parts_add_up_to_its_jct_and_its_compute_is_its_best_time_alone(policy, zoo):
    jobs = load_workload(BUILT_IN_WORKLOAD)
    result = simulate(Simulation(jobs, "sia-hetero-64", policy), sources=zoo, fairness=False)
    cluster, settings = load_cluster("sia-hetero-64"), simulation_settings(None, "sia-hetero-64")
    best = {m: model_times(cluster, zoo.truths[m], settings).switching for m in {j.application for j in jobs}}
    finished = [j for j in result["jobs"] if j["jct_s"] is not None]
    assert len(finished) == len(jobs)
    for job in finished:
        parts = result["job_jct_parts_s"][job["name"]]
        assert set(parts) == set(PARTS)
        assert sum(parts.values()) == pytest.approx(job["jct_s"], abs=0.01), job
        # All of its work, each epoch at its best placement: what the bound calls its switching time.
        assert parts["compute"] == pytest.approx(best[job["application"]], rel=1e-6, abs=0.01), job
        assert parts["first_start"] > 0 and parts["restarts"] >= 0 and parts["waiting"] >= -0.01, job
        assert parts["slower_type"] >= -0.01, job
    assert sum(result["jct_parts_s"].values()) == pytest.approx(result["avg_jct_s"], rel=1e-9)
    # A policy that restarts jobs pays for it in this column, and no other.
    assert (result["jct_parts_s"]["restarts"] > 0) == (sum(j["restarts"] for j in finished) > 0)


def test_simulate_prints_the_parts_and_compare_tabulates_them(tmp_path, capsys):
    workload = tmp_path / "four.csv"
    workload.write_text("\n".join(BUILT_IN_WORKLOAD.read_text().splitlines()[:5]) + "\n")
    assert (
        main(["simulate", "--workload", str(workload), "--zoo", "--no-fairness", "--out", str(tmp_path / "s.json")])
        == 0
    )
    assert "where the avg JCT goes (s): compute " in capsys.readouterr().out
    out = tmp_path / "c.json"
    assert (
        main(
            ["compare", "--workloads", str(workload), "--policies", "goodput", "sia", "--zoo", "--no-fairness"]
            + ["--workers", "1", "--out", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        "| workloads | policy | compute s | slower type s | fewer gpus s | restarts s | waiting s | first start s |"
        in printed
    )
    rows = json.loads(out.read_text())["table"]
    for row in rows:
        assert sum(row["jct_parts_s"].values()) == pytest.approx(row["avg_jct_s"], rel=1e-9)
