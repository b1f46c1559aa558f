"""Hybrid-parallel jobs (Sia §5.3): fixed model-parallel groups of P_t GPUs (gpt_pmp: 2 on dgx-ext,
8 on rtx), scaled only by data-parallel replication. Everything but the reference-data checks runs
on the model zoo."""

from __future__ import annotations

import numpy as np
import pytest

from goodput_train.goodput import BatchLimits, iteration_time
from launcher.replay import replay_over_nats
from policies.base import make_policy
from policies.table import goodput_table
from services.placer.core import place, placement_violations
from services.simulated.truth import job_sources
from services.simulated.world import SimulatedJob
from shared.cluster import load_cluster
from shared.schema.base import Config
from shared.settings import PRESETS
from sim.fairness import fair_share
from sim.profiles import trace_profile
from sim.reference import ReferenceDataMissing, WorkloadJob, discover_models
from sim.rounds import job_models, job_view, round_state
from sim.run import Simulation, simulate
from sim.simulator import DirectWiring, Simulator
from sim.zoo import load_zoo

ZOO = job_sources(use_zoo=True)
CLUSTER = load_cluster("sia-hetero-64")
GROUPS = {"dgx-ext": 2, "rtx": 8}
MIXED = [
    WorkloadJob("gpt_pmp-0", 0, "gpt_pmp", 2, 96),
    WorkloadJob("cifar10-1", 60, "cifar10", 2, 256),
    WorkloadJob("imagenet-2", 300, "imagenet", 4, 800),
    WorkloadJob("gpt_pmp-3", 600, "gpt_pmp", 2, 96),
    WorkloadJob("bert-4", 900, "bert", 4, 48),
    WorkloadJob("deepspeech2-5", 1200, "deepspeech2", 2, 40),
]


def gpt_models(max_gpus_seen: int = 0):
    return job_models("gpt", "gpt_pmp", CLUSTER, max_gpus_seen=max_gpus_seen)


# --- where the group sizes come from -------------------------------------------------------------


def test_zoo_knows_the_groups_and_counts_replicas():
    zoo = load_zoo()
    assert zoo["gpt_pmp"].group_gpus == GROUPS
    assert all(not m.group_gpus for name, m in zoo.items() if name != "gpt_pmp")
    profile = ZOO.profile("gpt_pmp", "rtx")
    assert profile.group_gpus == 8 and (profile.min_local, profile.max_local) == (48, 96)
    assert ZOO.truths["gpt_pmp"].group_gpus == GROUPS and ZOO.profile("cifar10", "rtx").group_gpus == 1


def test_reference_groups_are_the_smallest_placements_and_profiles_one_replica():
    try:
        gpt = discover_models()["gpt_pmp"]
    except ReferenceDataMissing as exc:  # pragma: no cover - depends on the machine
        pytest.skip(str(exc))
    assert gpt.group_gpus == GROUPS
    rtx = gpt.placements["rtx"]
    one_replica = (rtx.gpus == 8) & (rtx.nodes == 1)
    # Read as Sia's simulator does: a 48-micro-batch pass through 8 stages, plus the all-reduce.
    assert rtx.step_time[one_replica][0] == pytest.approx(3 * (8 - 1 + 48) * 0.099 + 0.3275)
    assert gpt.local_bsz_limits("dgx-ext") == (48, 96)
    profile = trace_profile(gpt, "rtx")
    assert profile.group_gpus == 8
    assert [p.step_time for p in profile.points] == pytest.approx(sorted(rtx.step_time[one_replica]))


# --- the goodput table: feasible configurations, valued at replicas -------------------------------


def test_table_gives_no_goodput_where_groups_would_split_or_do_not_fit():
    table = goodput_table([gpt_models(max_gpus_seen=8)], CLUSTER.configurations())
    valid = {str(c) for c, ok in zip(table.configs, table.valid[0]) if ok}
    # 2, 4, 8 A100 on a node and both whole nodes; one to three whole RTX nodes; never a T4.
    assert valid == {"dgx-ext:1x2", "dgx-ext:1x4", "dgx-ext:1x8", "dgx-ext:2x8", "rtx:1x8", "rtx:2x8", "rtx:3x8"}
    assert np.all(table.goodput[0][~table.valid[0]] == 0) and np.all(table.normalized[0][~table.valid[0]] == 0)


def test_a_new_hybrid_job_starts_at_one_replica_of_either_type():
    table = goodput_table([gpt_models()], CLUSTER.configurations())
    assert {str(c) for c, ok in zip(table.configs, table.valid[0]) if ok} == {"dgx-ext:1x2", "rtx:1x8"}
    # Row-normalised to N_min = the GPUs of one replica on the type of the slower cell.
    slower = min(np.flatnonzero(table.valid[0]), key=lambda c: table.goodput[0, c])
    assert table.normalized[0, slower] == pytest.approx(table.configs[slower].gpus)


def test_the_model_at_n_groups_of_gpus_is_the_replica_model_at_n_replicas():
    models = gpt_models(max_gpus_seen=8)
    table = goodput_table([models], CLUSTER.configurations())
    for config, replicas in ((Config("dgx-ext", 1, 4), 2), (Config("dgx-ext", 2, 16), 8), (Config("rtx", 3, 24), 3)):
        lo, hi = models.local_limits[config.gpu_type]
        best = models.model(config.gpu_type).best_batch(
            config.nodes, replicas, BatchLimits(models.init_batch, models.max_batch, lo, hi)
        )
        column = table.configs.index(config)
        assert table.goodput[0, column] == pytest.approx(float(best.goodput), rel=1e-12)
        assert table.m[0, column] == best.m and table.s[0, column] == best.s
    # The zoo's true step times count replicas the same way.
    truth, params = ZOO.truths["gpt_pmp"].types["rtx"], load_zoo()["gpt_pmp"].types["rtx"].params
    assert truth.times([8, 8], 48)[0] == pytest.approx(float(iteration_time(params, 2, 2, 48)))


# --- placer and executors never split a group ----------------------------------------------------


def test_placer_refuses_allocations_that_split_groups_and_checks_placements():
    with pytest.raises(ValueError, match="'gpt'.*groups of 8 GPUs"):
        place(CLUSTER, {"gpt": Config("rtx", 1, 4)}, {}, {"gpt": 8})
    placed = place(CLUSTER, {"gpt": Config("rtx", 2, 16), "other": Config("rtx", 1, 4)}, {}, {"gpt": 8})
    assert all(gpus % 8 == 0 for _, gpus in placed.placements["gpt"])
    split = {"gpt": (("dgx-ext-0", 1), ("dgx-ext-1", 1))}
    assert any(
        "splits its model-parallel groups" in p
        for p in placement_violations(CLUSTER, {"gpt": Config("dgx-ext", 2, 2)}, split, {"gpt": 2})
    )


def test_an_executor_refuses_a_placement_that_splits_its_group():
    job = SimulatedJob(MIXED[0], None, 30.0, 1.0, group_gpus=GROUPS)
    with pytest.raises(RuntimeError, match="splits its model-parallel groups of 8 GPUs"):
        job.apply(CLUSTER, (("rtx-0", 4),), gpt_models(), True, 0.0, 0.05)
    job.apply(CLUSTER, (("rtx-0", 8), ("rtx-1", 8)), gpt_models(), True, 0.0, 0.05)
    assert job.replicas == 2 and job.batch == 2 * job.m * (job.s + 1) and job.max_gpus_seen == 2


# --- a workload mixing hybrid and ordinary jobs ----------------------------------------------------


class RecordingWiring(DirectWiring):
    """The direct wiring, keeping every round's placements."""

    def __init__(self, *args):
        super().__init__(*args)
        self.applied: list[dict] = []

    async def apply(self, request):
        self.applied.append(dict(request.placements))
        await super().apply(request)


def test_sia_runs_a_mixed_workload_keeping_every_group_on_one_node():
    settings = PRESETS["sia"]
    wiring = RecordingWiring(MIXED, CLUSTER, settings, ZOO.truths, ZOO.profile, 1)
    sim = Simulator(MIXED, CLUSTER, make_policy("sia"), settings, wiring=wiring)
    sim.run()
    assert all(record.finish_s is not None for record in sim.records())
    node_type = {n.name: n.gpu_type for n in CLUSTER.nodes}
    replicas = set()
    for placements in wiring.applied:
        for job in ("gpt_pmp-0", "gpt_pmp-3"):
            spots = placements.get(job, ())
            if spots:
                group = GROUPS[node_type[spots[0][0]]]
                assert all(gpus % group == 0 for _, gpus in spots), spots
                replicas.add((node_type[spots[0][0]], sum(g for _, g in spots) // group))
    assert {t for t, _ in replicas} == {"dgx-ext", "rtx"} and max(n for _, n in replicas) > 1  # scaled out


@pytest.mark.e2e
def test_the_services_over_nats_give_the_direct_schedule():
    workload = MIXED[:2]
    direct = simulate(Simulation(workload, "sia-hetero-64", "sia"), sources=ZOO, fairness=False)
    over_nats = simulate(
        Simulation(workload, "sia-hetero-64", "sia"), sources=ZOO, fairness=False, over=replay_over_nats
    )
    assert direct["jobs_unfinished"] == 0
    assert over_nats["jobs"] == direct["jobs"]
    assert [r["gpus"] for r in over_nats["timeline"]] == [r["gpus"] for r in direct["timeline"]]


@pytest.mark.parametrize("policy", ["pollux", "gavel", "tiresias", "fifo", "timeslice"])
def test_policies_that_would_split_groups_refuse_hybrid_jobs(policy):
    state = round_state([job_view("cifar", "cifar10", CLUSTER), job_view("gpt-7", "gpt_pmp", CLUSTER)], CLUSTER)
    with pytest.raises(ValueError, match=rf"policy '{policy}' cannot schedule hybrid-parallel jobs: gpt-7 "):
        make_policy(policy).allocate(state)


def test_a_simulation_with_a_refusing_policy_fails_that_job_with_the_reason_and_runs_the_others():
    result = simulate(Simulation(MIXED[:2], "sia-hetero-64", "fifo"), sources=ZOO, fairness=False)
    failed = [e for e in result["events"] if " failed: " in e]
    assert len(failed) == 1 and "gpt_pmp-0 failed: policy 'fifo' cannot schedule hybrid-parallel jobs" in failed[0]
    outcome = {j["name"]: j["finish_s"] for j in result["jobs"]}
    assert outcome["gpt_pmp-0"] is None and result["jobs_finished"] == len(MIXED[:2]) - 1


def test_fair_share_counts_groups_for_a_hybrid_job():
    share, stretch = fair_share(CLUSTER, 7.0, GROUPS)  # 1/7: 2 A100 hold a group (3 RTX do not)
    assert stretch == 1.0 and ("dgx-ext-0", 2) in [(n.name, n.gpus) for n in share.nodes]
    share, stretch = fair_share(CLUSTER, 12.0, GROUPS)  # 1/12: under a group of both of its types
    assert sorted((n.gpu_type, n.gpus) for n in share.nodes) == [("dgx-ext", 2), ("rtx", 8)]
    assert stretch == pytest.approx(12.0 / 8)  # the best slice: 8 groups of 2 A100 / 12
