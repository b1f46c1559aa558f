"""The round-based simulator: exact progress accounting, restarts, capacity, determinism, output."""

import json

import numpy as np
import pytest

from cli.main import main
from goodput_train.goodput import efficiency, iteration_time, pgns
from services.simulated.truth import canonical_placement, job_sources, reference_truth
from shared.settings import PRESETS
from sim.reference import WorkloadJob, discover_models
from sim.run import Simulation, simulate
from sim.zoo import load_zoo

ZOO = job_sources(use_zoo=True)


def small_workload():
    return [
        WorkloadJob("cifar10-0", 0, "cifar10", 2, 256),
        WorkloadJob("bert-1", 30, "bert", 1, 12),
        WorkloadJob("cifar10-2", 200, "cifar10", 4, 512),
        WorkloadJob("deepspeech2-3", 400, "deepspeech2", 2, 40),
        WorkloadJob("cifar10-4", 900, "cifar10", 1, 128),
    ]


def test_single_rigid_job_progress_matches_hand_computation():
    # One cifar10 job alone, FIFO at its request (1 GPU, batch 128 = M0): JCT = first-start delay +
    # sum over epochs of the epoch's progress / rate, rate = eff * M/M0 / t_iter / slowdown.
    job = WorkloadJob("only", 0, "cifar10", 1, 128)
    result = simulate(Simulation([job], "pollux-homo-64", "fifo", calibration="sia"), sources=ZOO)
    zoo = load_zoo()["cifar10"]
    settings = PRESETS["sia"]
    t_iter = float(iteration_time(zoo.types["aws"].params, 1, 1, 128))
    expected = settings.restart_delay("cifar10")
    previous = 0.0
    for boundary, sqr, var in zip(zoo.progress, zoo.grad_sqr, zoo.grad_var):
        eff = float(efficiency(pgns(sqr, var, 128), 128, 128))
        expected += (boundary - previous) / (eff * 1.0 / t_iter * settings.goodput_factor("cifar10"))
        previous = boundary
    assert result["jobs"][0]["jct_s"] == pytest.approx(expected, rel=1e-9)
    assert result["jobs"][0]["restarts"] == 0
    assert result["jobs"][0]["gpu_seconds"] == pytest.approx(expected, abs=1e-3)  # one GPU the whole time
    steps_per_s = settings.goodput_factor("cifar10") / t_iter
    assert result["jobs"][0]["feedback_s"] == pytest.approx(
        settings.restart_delay("cifar10") + 1 / steps_per_s, abs=1e-3
    )


@pytest.mark.parametrize("policy", ["sia", "fifo", "pollux", "gavel", "tiresias"])
def test_every_job_completes_within_capacity_and_runs_are_deterministic(policy):
    # The runs of each job alone (finish-time fairness) are compared once, under the cheapest policy.
    first = simulate(Simulation(small_workload(), "sia-hetero-64", policy), sources=ZOO, fairness=policy == "fifo")
    second = simulate(Simulation(small_workload(), "sia-hetero-64", policy), sources=ZOO, fairness=policy == "fifo")
    assert first["jobs_unfinished"] == 0
    assert all(j["jct_s"] > 0 and j["finish_s"] >= j["submit_s"] for j in first["jobs"])
    assert all(sum(r["gpus"].values()) <= 64 for r in first["timeline"])
    strip = lambda r: {k: v for k, v in r.items() if not k.endswith("runtime_ms")}  # noqa: E731
    assert strip(first) == strip(second)


def test_sia_scales_a_lone_job_up_by_at_most_twice_a_round():
    result = simulate(
        Simulation([WorkloadJob("imagenet-0", 0, "imagenet", 1, 200)], "sia-hetero-64", "sia", calibration="none"),
        sources=ZOO,
    )
    gpus = [r["gpus"].get("imagenet-0", 0) for r in result["timeline"]]
    assert gpus[0] == 1  # new jobs start on one GPU
    seen = 0
    for g in gpus:
        assert g <= max(2 * seen, 1)  # at most twice the most it ever had
        seen = max(seen, g)
    assert seen >= 8 and result["jobs"][0]["restarts"] >= 2


def test_restart_delay_is_charged_per_start():
    lone = [WorkloadJob("cifar10-0", 0, "cifar10", 1, 128)]

    def run(policy, delay):
        return simulate(
            Simulation(lone, "sia-hetero-64", policy, calibration="none", restart_delay_s=delay), sources=ZOO
        )["jobs"][0]

    # fifo starts the job once: exactly one delay more.
    assert run("fifo", 40.0)["jct_s"] == pytest.approx(run("fifo", 0.0)["jct_s"] + 40.0)
    # sia restarts it as it scales it up; each start pays the delay (and a slower job may be rescaled more).
    fast, slow = run("sia", 0.0), run("sia", 40.0)
    assert fast["restarts"] >= 1 and slow["restarts"] >= fast["restarts"]
    assert slow["jct_s"] > fast["jct_s"] + 40.0


def test_feedback_time_is_recorded_for_k_iterations():
    result = simulate(Simulation(small_workload(), "sia-hetero-64", "sia", feedback_iterations=50), sources=ZOO)
    for job in result["jobs"]:
        assert 0 < job["feedback_s"] <= job["jct_s"]
    assert result["feedback_iterations"] == 50


def test_unknown_models_and_policies_are_refused():
    with pytest.raises(ValueError, match="no profile data: resnet9000"):
        simulate(Simulation([WorkloadJob("x", 0, "resnet9000", 1, 32)], "sia-hetero-64", "sia"), sources=ZOO)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(Simulation(small_workload(), "sia-hetero-64", "magic"), sources=ZOO)


# --- the reference truth ----------------------------------------------------------------------


def test_canonical_placement_is_the_smallest_rotation():
    assert canonical_placement([2, 1, 1, 3]) == "1132"
    assert canonical_placement([4, 4]) == "44"
    assert canonical_placement([8, 1]) == "18"


def test_measured_placements_are_interpolated_and_others_are_estimated():
    trace = discover_models()["cifar10"]
    truth = reference_truth(trace).types["aws"]
    meas = trace.placements["aws"]
    row = int(np.flatnonzero(np.array(meas.placement) == "1244")[0])
    step, sync = truth.times([4, 4, 1, 2], int(meas.local_bsz[row]))  # a rotation of 1244
    rows = [i for i, p in enumerate(meas.placement) if p == "1244" and meas.local_bsz[i] == meas.local_bsz[row]]
    assert step == pytest.approx(float(np.interp(meas.local_bsz[row], meas.local_bsz[rows], meas.step_time[rows])))
    # Six nodes of four is not a measured placement: interpolated from the scalability table.
    far, _ = truth.times([4] * 6, 128)
    near, _ = truth.times([4] * 4, 128)
    assert np.isfinite(far) and far > 0 and far >= 0.5 * near


def test_reference_run_matches_the_zoo_run_in_shape(tmp_path):
    workload = tmp_path / "w.csv"
    workload.write_text(
        "name,time,application,num_replicas,batch_size\ncifar10-0,0,cifar10,2,256\nbert-1,10,bert,1,12\n"
    )
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "simulate",
                "--workload",
                str(workload),
                "--cluster",
                "sia-hetero-64",
                "--policy",
                "sia",
                "--out",
                str(out),
                "--plot",
                str(tmp_path / "r.png"),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    for key in (
        "policy",
        "cluster",
        "workload",
        "jobs",
        "avg_jct_s",
        "p99_jct_s",
        "makespan_s",
        "gpu_hours_per_job",
        "restarts_per_job",
        "policy_runtime_ms",
    ):
        assert key in doc
    assert {"name", "submit_s", "finish_s", "jct_s", "restarts", "gpu_seconds"} <= set(doc["jobs"][0])
    assert set(doc["policy_runtime_ms"]) == {"p50", "p95", "max"}
    assert doc["truth"].startswith("reference:")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_workload_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("name,time,application,num_replicas,batch_size\nx,-5,cifar10,1,128\n")
    assert main(["simulate", "--workload", str(bad), "--out", str(tmp_path / "o.json")]) == 2
    assert "negative time" in capsys.readouterr().err


def test_generated_workload_is_deterministic_and_loads(tmp_path):
    from sim.reference import load_workload
    from sim.workload import generate_workload, write_workload

    jobs = generate_workload(jobs=30, hours=1.0, seed=3)
    assert jobs == generate_workload(jobs=30, hours=1.0, seed=3) != generate_workload(jobs=30, hours=1.0, seed=4)
    path = tmp_path / "w.csv"
    write_workload(jobs, path)
    loaded = load_workload(path)
    assert [j.name for j in loaded] == [j.name for j in jobs]
    assert all(0 <= j.time < 3600 and j.num_replicas in (1, 2, 4, 8) for j in loaded)
    with pytest.raises(ValueError, match="not in the zoo"):
        generate_workload(mix={"alexnet": 1.0})


def test_a_rigid_submission_is_reported_rigid_as_a_real_job_is():
    """The simulated executors take a JobSpec as a node agent does: a rigid one's facts say so, with
    its request, and the estimator fixes its GPUs and batch from them (the policy's constraint)."""
    from services.estimator.core import Estimator
    from services.simulated.world import SimulatedExecutors
    from shared.cluster import load_cluster
    from shared.schema.jobs import JobSpec
    from shared.settings import simulation_settings

    executors = SimulatedExecutors(load_cluster("sia-hetero-64"), simulation_settings(None, "sia-hetero-64"), 1)
    truth = ZOO.truths["cifar10"]
    executors.submit(JobSpec("rigid", "cifar10", requested_gpus=4, requested_batch=512, rigid=True, submit_s=5), truth)
    executors.submit(JobSpec("adaptive", "cifar10", requested_gpus=2, min_gpus=2, submit_s=5.0), truth)
    executors.submit(JobSpec("live", "cifar10"), truth)
    rigid, adaptive = executors.facts(10.0, ["rigid", "adaptive"])
    assert (rigid.rigid, rigid.requested_gpus, rigid.requested_batch, rigid.submit_s) == (True, 4, 512, 5.0)
    assert not adaptive.rigid and adaptive.requested_batch == 2 * truth.init_batch
    assert executors.jobs["live"].live and not executors.jobs["rigid"].live
    estimator = Estimator()
    for name in ("rigid", "adaptive"):
        estimator.add(name, {t: ZOO.profile("cifar10", t) for t in truth.types})
    fixed, free = estimator.models([rigid, adaptive])
    assert (fixed.fixed_gpus, fixed.min_gpus, fixed.fixed_batch) == (4, 4, 512)
    assert (free.fixed_gpus, free.fixed_batch, free.min_gpus) == (None, None, 2)  # its floor, to the policy


def test_profiling_at_the_request_gives_the_estimator_the_matrix_gavel_assumes():
    """--profile-request: the estimator's model of a job at its requested GPUs and batch on each
    type is what the job measures there; from the 1-GPU profiles alone it is far off."""
    from services.simulated.world import request_observations
    from shared.cluster import load_cluster
    from shared.settings import simulation_settings
    from sim.simulator import DirectWiring

    sources, cluster = job_sources(), load_cluster("sia-hetero-64")
    assert sources.origin.startswith("reference:")
    spec = WorkloadJob("ds2", 0.0, "deepspeech2", 8, 160)
    measured = request_observations(spec, sources.truths["deepspeech2"], cluster)
    assert sorted(t for t, _ in measured) == sorted(cluster.gpu_types)
    assert all(
        o.nodes == -(-8 // cluster.gpus_per_node(t)) and o.gpus == 8 and o.m * (o.s + 1) * 8 >= 160 for t, o in measured
    )
    errors = {}
    for profiled in (False, True):
        settings = simulation_settings(None, "sia-hetero-64", profile_request=profiled)
        wiring = DirectWiring([spec], cluster, settings, sources.truths, sources.profile, 1)
        params = wiring.estimator.models(wiring.executors.facts(0.0, ["ds2"]))[0].params
        errors[profiled] = [
            abs(float(iteration_time(params[t], o.nodes, o.gpus, o.m, o.s)) / o.t_iter - 1) for t, o in measured
        ]
    assert max(errors[False]) > 0.2
    assert max(errors[True]) < 0.02
