"""Pollux policy: valid placements on random clusters and rounds, its search's rules, and its behaviour.

Random rounds (hypothesis): a random cluster (1-3 GPU types, 1-6 nodes of 1-8 GPUs), 1-10 jobs of the
zoo's models with random limits, ages and restarts; a first round from nothing, then a second one in
which the first round's placements are the current ones and some jobs are mid checkpoint-restart.
Small populations keep the whole file fast; the behaviour tests use larger ones where they need it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.base import Decision, RoundState, make_policy, restart_factor
from policies.pollux import (
    PolluxPolicy,
    Search,
    build_problem,
    goodput_lookup,
    power_mean,
    type_rank,
)
from shared.cluster import Cluster, build_cluster, load_cluster
from shared.schema.base import Config
from sim.rounds import job_view, round_state
from sim.zoo import load_zoo

SETTINGS = settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ZOO = load_zoo()
MODELS = sorted(name for name, model in ZOO.items() if not model.group_gpus)  # pollux refuses hybrid jobs
TYPES = ("aws", "rtx", "dgx-ext")
SMALL = dict(population=16, generations=8)


# --- checks -------------------------------------------------------------------------------------


def violations(state: RoundState, decision: Decision, avoid_interference: bool = True) -> list[str]:
    """Everything wrong with a decision: placements, allocations, limits, interference, pinned jobs."""
    problems = []
    nodes = {n.name: n for n in state.cluster.nodes}
    jobs = {j.job_id: j for j in state.jobs}
    total = state.cluster.total_gpus
    used: Counter[str] = Counter()
    distributed_on: Counter[str] = Counter()
    assert decision.placements is not None
    if set(decision.placements) != set(decision.allocations):
        problems.append(f"placements {sorted(decision.placements)} != allocations {sorted(decision.allocations)}")
    for job_id, spots in decision.placements.items():
        job = jobs[job_id]
        if list(spots) != sorted(spots) or len({n for n, _ in spots}) != len(spots):
            problems.append(f"{job_id}: spots not sorted by node or repeated: {spots}")
        if any(name not in nodes or gpus < 1 for name, gpus in spots):
            problems.append(f"{job_id}: unknown node or empty spot in {spots}")
            continue
        kinds = {nodes[name].gpu_type for name, _ in spots}
        if len(kinds) != 1:
            problems.append(f"{job_id}: several GPU types {kinds}")
        gpus = sum(g for _, g in spots)
        config = decision.allocations.get(job_id)
        if config != Config(next(iter(kinds)), len(spots), gpus):
            problems.append(f"{job_id}: allocation {config} does not describe {spots}")
        for name, g in spots:
            used[name] += g
            if len(spots) > 1:
                distributed_on[name] += 1
        pinned = job.mid_restart and job.placement
        if pinned:
            if spots != job.placement:
                problems.append(f"{job_id}: mid-restart, moved from {job.placement} to {spots}")
            continue
        models = job.models
        top = models.fixed_gpus or min(models.gpu_limit, total)
        low = models.fixed_gpus or models.min_gpus
        if not low <= gpus <= top:
            problems.append(f"{job_id}: {gpus} GPUs outside [{low}, {top}]")
    for job in state.jobs:
        if job.mid_restart and job.placement and job.job_id not in decision.placements:
            problems.append(f"{job.job_id}: mid-restart, lost its placement")
    for name, g in used.items():
        if g > nodes[name].gpus:
            problems.append(f"node {name}: {g} GPUs given of {nodes[name].gpus}")
    if avoid_interference:
        for name, count in distributed_on.items():
            if count > 1:
                problems.append(f"node {name}: {count} distributed jobs")
    return problems


def next_round(state: RoundState, decision: Decision, mid_restart: set[str], now_s: float = 3660.0) -> RoundState:
    """The same jobs a minute later, running where `decision` put them; some mid checkpoint-restart."""
    jobs = []
    for job in state.jobs:
        spots = decision.placements.get(job.job_id, ())
        current = decision.allocations.get(job.job_id)
        moved = spots != job.placement
        jobs.append(
            job_view(
                job.job_id,
                job.model,
                state.cluster,
                age_s=job.age_s + 60,
                restarts=job.restarts + moved,
                attained_gpu_s=job.attained_gpu_s + 60 * (current.gpus if current else 0),
                current=current,
                placement=spots,
                mid_restart=job.job_id in mid_restart and bool(spots),
                submit_s=job.submit_s,
                max_gpus_seen=max(job.models.max_gpus_seen, current.gpus if current else 0),
                min_gpus=job.models.min_gpus,
                fixed_gpus=job.models.fixed_gpus,
            )
        )
    return round_state(jobs, state.cluster, now_s)


def speedups_of(state: RoundState, decision: Decision, p: float) -> np.ndarray:
    """Per job (priority order) unscaled speedup over the fair share of a decision, without restart factors."""
    problem = build_problem(state)
    node_at = {name: n for n, name in enumerate(problem.node_names)}
    matrix = np.zeros((1, *problem.shape), dtype=np.int8)
    for j, job_id in enumerate(problem.job_ids):
        for name, gpus in decision.placements.get(job_id, ()):
            matrix[0, j, node_at[name]] = gpus
    scale = len(problem.node_names) / state.cluster.total_gpus
    return Search(problem, np.random.default_rng(0), p).speedups(matrix, restarts=False)[0] / scale


# --- random rounds ------------------------------------------------------------------------------


@st.composite
def clusters(draw) -> Cluster:
    types = draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=3, unique=True))
    groups = [
        {"gpu_type": t, "count": draw(st.integers(1, 6)), "gpus_per_node": draw(st.sampled_from([1, 2, 4, 6, 8]))}
        for t in types
    ]
    return build_cluster("random", groups)


@st.composite
def rounds(draw) -> RoundState:
    cluster = draw(clusters())
    jobs = []
    for i in range(draw(st.integers(1, 10))):
        model = draw(st.sampled_from(MODELS))
        rigid = draw(st.integers(0, 5)) == 0
        jobs.append(
            job_view(
                f"job-{i}",
                model,
                cluster,
                age_s=draw(st.floats(0, 20000)),
                restarts=draw(st.integers(0, 6)),
                attained_gpu_s=draw(st.floats(0, 1e5)),
                submit_s=float(draw(st.integers(0, 3000))),
                progress=draw(st.floats(0, 1)) * ZOO[model].total_progress,
                max_gpus_seen=draw(st.sampled_from([0, 1, 2, 4, 8, 16])),
                min_gpus=draw(st.sampled_from([1, 1, 1, 2])),
                fixed_gpus=draw(st.sampled_from([1, 2, 4])) if rigid else None,
            )
        )
    return round_state(jobs, cluster)


@SETTINGS
@given(state=rounds(), data=st.data())
def test_random_rounds_give_valid_placements(state, data):
    policy = PolluxPolicy(seed=data.draw(st.integers(0, 3)), **SMALL)
    first = policy.allocate(state)
    assert violations(state, first) == []
    restarting = set(data.draw(st.lists(st.sampled_from([j.job_id for j in state.jobs]), unique=True)))
    second_state = next_round(state, first, restarting)
    second = policy.allocate(second_state)
    assert violations(second_state, second) == []


@SETTINGS
@given(state=rounds())
def test_without_interference_avoidance_placements_stay_valid(state):
    decision = PolluxPolicy(avoid_interference=False, **SMALL).allocate(state)
    assert violations(state, decision, avoid_interference=False) == []


@SETTINGS
@given(state=rounds())
def test_collapse_inside_the_search_gives_valid_placements(state):
    decision = PolluxPolicy(collapse_in_search=True, **SMALL).allocate(state)
    assert violations(state, decision) == []


@pytest.mark.parametrize("cluster", ["pollux-homo-64", "sia-hetero-64"])
def test_loaded_cluster_rounds_are_valid_and_use_the_cluster(cluster):
    rng = np.random.default_rng(7)
    c = load_cluster(cluster)
    jobs = [
        job_view(
            f"j{i}",
            MODELS[int(rng.integers(len(MODELS)))],
            c,
            age_s=float(rng.uniform(60, 7200)),
            restarts=int(rng.integers(0, 4)),
            attained_gpu_s=float(rng.uniform(0, 1e5)),
            submit_s=float(i),
            max_gpus_seen=int(rng.choice([1, 2, 4, 8])),
        )
        for i in range(24)
    ]
    state = round_state(jobs, c)
    policy = PolluxPolicy(population=60, generations=40)
    decision = policy.allocate(state)
    assert violations(state, decision) == []
    state = next_round(state, decision, {"j0", "j5"})
    decision = policy.allocate(state)  # warm start from the previous population
    assert violations(state, decision) == []
    # p = -1 with 24 jobs on 64 GPUs: nobody starves.
    assert len(decision.placements) >= 20


def test_distributed_jobs_never_share_a_node_when_many_want_several_nodes():
    cluster = load_cluster("pollux-homo-64")
    jobs = [
        job_view(
            f"j{i}", "imagenet", cluster, max_gpus_seen=8, submit_s=i, progress=0.5 * ZOO["imagenet"].total_progress
        )
        for i in range(10)
    ]
    state = round_state(jobs, cluster)
    policy = PolluxPolicy(population=40, generations=30)
    for _ in range(2):
        decision = policy.allocate(state)
        assert sum(len(spots) > 1 for spots in decision.placements.values()) >= 2  # not vacuous
        assert violations(state, decision) == []
        state = next_round(state, decision, set(), state.now_s + 60)


# --- the search's parts ---------------------------------------------------------------------------


def test_restart_factor_as_pollux_coded_it():
    assert restart_factor(300.0, 1, 30.0) == pytest.approx(270 / 330)
    assert restart_factor(20.0, 1, 30.0) == 0.0  # restarted more than its age pays for
    assert restart_factor(0.0, 0, 0.0) == 1.0  # no age, no penalty: nothing to discount


def test_power_mean_keeps_starved_jobs_finite():
    values = np.array([[1.0, 1.0], [2.0, 0.0]])
    assert power_mean(values, 1.0) == pytest.approx([1.001, 1.001])
    harmonic = power_mean(values, -1.0)
    assert np.isfinite(harmonic).all() and harmonic[0] > harmonic[1]
    assert power_mean(values, 0.0)[1] == pytest.approx(np.sqrt(2.0 * 1e-3))


def test_type_ties_prefer_the_faster_type():
    assert type_rank(["aws", "dgx-ext", "rtx"]) == ["dgx-ext", "rtx", "aws"]
    assert type_rank(["t4", "other", "a100"]) == ["a100", "t4", "other"]


def test_collapse_keeps_the_majority_type_and_breaks_ties_by_speed():
    cluster = load_cluster("sia-hetero-64")
    state = round_state([job_view(f"j{i}", "imagenet", cluster, max_gpus_seen=8) for i in range(3)], cluster)
    problem = build_problem(state)
    search = Search(problem, np.random.default_rng(0), -1.0)
    at = {name: n for n, name in enumerate(problem.node_names)}
    matrix = np.zeros((1, *problem.shape), dtype=np.int8)
    matrix[0, 0, [at["aws-0"], at["aws-1"]]] = 4  # 8 T4 beat 4 RTX
    matrix[0, 0, at["rtx-0"]] = 4
    matrix[0, 1, at["aws-2"]] = 4  # tie: RTX beats T4
    matrix[0, 1, at["rtx-1"]] = 4
    matrix[0, 2, at["dgx-ext-0"]] = 2  # tie: A100 beats RTX
    matrix[0, 2, at["rtx-2"]] = 2
    kept = search.collapse(matrix)[0]
    names = lambda j: {problem.node_names[n] for n in np.flatnonzero(kept[j])}  # noqa: E731
    assert names(0) == {"aws-0", "aws-1"}
    assert names(1) == {"rtx-1"}
    assert names(2) == {"dgx-ext-0"}


def test_repair_enforces_capacity_limits_and_one_distributed_job_a_node():
    cluster = load_cluster("pollux-homo-64")
    jobs = [job_view(f"j{i}", "imagenet", cluster, max_gpus_seen=2, submit_s=i) for i in range(3)]
    problem = build_problem(round_state(jobs, cluster))
    search = Search(problem, np.random.default_rng(0), -1.0)
    matrix = np.zeros((1, *problem.shape), dtype=np.int8)
    matrix[0, 0, :2] = 2  # j0: distributed over nodes 0, 1 (4 GPUs = its limit)
    matrix[0, 1, 1:3] = 2  # j1: distributed over nodes 1, 2: node 1 already has one
    matrix[0, 2, 3] = 4  # j2: 4 GPUs of one node, its limit is 4
    matrix[0, 2, 4] = 4  # ... and 4 more: over its limit
    fixed = search.repair(matrix)[0]
    assert fixed[0].tolist()[:2] == [2, 2]
    assert fixed[1, 1] == 0
    assert fixed[2].sum() == 4
    assert (fixed.sum(axis=0) <= problem.node_gpus).all()


def test_goodput_lookup_matches_the_estimator_cells():
    cluster = load_cluster("sia-hetero-64")
    state = round_state(
        [job_view("a", "bert", cluster, max_gpus_seen=8), job_view("b", "cifar10", cluster, max_gpus_seen=4)], cluster
    )
    types = list(cluster.gpu_types)
    table = goodput_lookup([j.models for j in state.jobs], types, [16, 8])
    for j in range(2):
        for c, config in enumerate(state.table.configs):
            if state.table.valid[j, c]:
                cell = table[j, types.index(config.gpu_type), config.gpus, int(config.nodes > 1)]
                assert cell == pytest.approx(state.table.goodput[j, c], rel=1e-9)


# --- behaviour --------------------------------------------------------------------------------------


def test_same_seed_and_state_give_the_same_decision():
    cluster = load_cluster("sia-hetero-64")
    jobs = [
        job_view(f"j{i}", m, cluster, max_gpus_seen=4, submit_s=i)
        for i, m in enumerate(["bert", "cifar10", "imagenet", "yolov3", "deepspeech2"] * 3)
    ]
    state = round_state(jobs, cluster)
    first = PolluxPolicy(seed=3, population=40, generations=30).allocate(state)
    again = PolluxPolicy(seed=3, population=40, generations=30).allocate(state)
    assert first == again


def test_no_jobs_no_decision():
    assert PolluxPolicy().allocate(round_state([], "pollux-homo-64")) == Decision({}, {})


def test_registered_by_name_with_options():
    policy = make_policy("pollux", p=0.0, population=10)
    assert isinstance(policy, PolluxPolicy) and policy.p == 0.0 and policy.adaptive_batch
    assert (policy.name, policy.round_s) == ("pollux", 60.0)


def test_a_job_alone_that_scales_well_gets_many_gpus():
    cluster = load_cluster("pollux-homo-64")
    job = job_view("solo", "imagenet", cluster, max_gpus_seen=8, progress=0.5 * ZOO["imagenet"].total_progress)
    state = round_state([job], cluster)
    decision = PolluxPolicy(population=30, generations=40).allocate(state)
    assert decision.allocations["solo"].gpus > 8
    assert violations(state, decision) == []


def test_p_minus_one_is_fairer_than_p_one_under_contention():
    cluster = build_cluster("c16", [{"gpu_type": "aws", "count": 4, "gpus_per_node": 4}])
    spec = [
        ("imagenet", 0.5),
        ("bert", 0.5),
        ("cifar10", 0),
        ("yolov3", 0),
        ("deepspeech2", 0.5),
        ("ncf", 0),
        ("imagenet", 0),
        ("cifar10", 0.99),
        ("deepspeech2", 0),
        ("yolov3", 0.5),
    ]
    jobs = [
        job_view(f"j{i}", m, cluster, max_gpus_seen=4, progress=p * ZOO[m].total_progress, submit_s=i)
        for i, (m, p) in enumerate(spec)
    ]
    state = round_state(jobs, cluster)

    def jain(p: float) -> tuple[float, float]:
        x = speedups_of(state, PolluxPolicy(p=p, population=50, generations=60).allocate(state), p)
        return x.min(), x.sum() ** 2 / (len(x) * (x**2).sum())

    fair_min, fair_jain = jain(-1.0)
    util_min, util_jain = jain(1.0)
    assert fair_min > 0 and fair_min > util_min  # p = -1 starves nobody here
    assert fair_jain > util_jain


def young_job_round(penalty: float | None) -> tuple[RoundState, Decision]:
    """deepspeech2 early in training on 2 of a node's 4 GPUs: 3 GPUs would be ~7% better."""
    cluster = build_cluster("one", [{"gpu_type": "aws", "count": 1, "gpus_per_node": 4}])
    job = job_view(
        "young",
        "deepspeech2",
        cluster,
        age_s=120.0,
        restarts=0,
        max_gpus_seen=2,
        current=Config("aws", 1, 2),
        placement=(("aws-0", 2),),
    )
    state = round_state([job], cluster)
    return state, PolluxPolicy(restart_penalty_s=penalty, population=30, generations=30).allocate(state)


def test_restart_penalty_keeps_a_young_jobs_placement_when_the_gain_is_small():
    _, kept = young_job_round(30.0)
    assert kept.placements == {"young": (("aws-0", 2),)}
    _, moved = young_job_round(0.0)  # no penalty: the small gain is taken
    assert moved.allocations["young"].gpus == 3


def test_restart_penalty_can_come_from_each_jobs_restart_cost():
    state, decision = young_job_round(None)  # the job's own estimate (30 s in the helper)
    assert decision.placements == {"young": (("aws-0", 2),)}


def test_mid_restart_jobs_keep_their_placement():
    cluster = load_cluster("pollux-homo-64")
    jobs = [
        job_view(
            "busy",
            "cifar10",
            cluster,
            max_gpus_seen=8,
            current=Config("aws", 2, 8),
            placement=(("aws-0", 4), ("aws-1", 4)),
            mid_restart=True,
            attained_gpu_s=1e6,
        )
    ]
    jobs += [job_view(f"j{i}", "imagenet", cluster, max_gpus_seen=16, submit_s=i) for i in range(6)]
    state = round_state(jobs, cluster)
    decision = PolluxPolicy(population=30, generations=20).allocate(state)
    assert decision.placements["busy"] == (("aws-0", 4), ("aws-1", 4))
    assert violations(state, decision) == []


def test_heterogeneous_cluster_collapses_to_one_type_per_job():
    cluster = load_cluster("sia-hetero-64")
    jobs = [
        job_view(f"j{i}", m, cluster, max_gpus_seen=8, submit_s=i)
        for i, m in enumerate(["imagenet", "bert", "deepspeech2", "cifar10", "yolov3", "imagenet"])
    ]
    state = round_state(jobs, cluster)
    for collapse_in_search in (True, False):
        decision = PolluxPolicy(collapse_in_search=collapse_in_search, population=40, generations=30).allocate(state)
        assert violations(state, decision) == []
        types = {n.name: n.gpu_type for n in cluster.nodes}
        for job_id, spots in decision.placements.items():
            assert {types[name] for name, _ in spots} == {decision.allocations[job_id].gpu_type}


def test_jobs_without_a_model_of_a_type_never_run_on_it():
    cluster = load_cluster("sia-hetero-64")  # no T4 model
    jobs = [
        job_view(f"g{i}", "imagenet", cluster, max_gpus_seen=4, submit_s=i, gpu_types=("dgx-ext", "rtx"))
        for i in range(3)
    ]
    state = round_state(jobs, cluster)
    decision = PolluxPolicy(population=30, generations=20).allocate(state)
    assert decision.allocations
    assert all(config.gpu_type != "aws" for config in decision.allocations.values())
