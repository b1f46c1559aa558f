"""The rigid baselines: fifo, tiresias, gavel.

Hand-made rounds check each policy's rule; a small round-by-round replay (jobs arrive, run at what
the policy placed, accumulate service and finish) checks, every round, that decisions are valid
placements and that each policy's invariant holds on states it produced itself.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import cvxpy as cp
import numpy as np
import pytest

from goodput_train.goodput import split_batch
from policies.base import Decision, JobView, RoundState, make_policy
from policies.fifo import FifoPolicy
from policies.gavel import GavelPolicy, max_min_fair, priority_order, proportional_throughput
from policies.rigid import requested_throughput_matrix
from policies.tiresias import TiresiasPolicy
from shared.cluster import Cluster, build_cluster, load_cluster
from shared.schema.base import Config
from sim.rounds import job_view, round_state

HOUR = 3600.0


def small_cluster(**per_type: int) -> Cluster:
    """One node of `n` GPUs per type, e.g. small_cluster(aws=4, rtx=4)."""
    return build_cluster("small", [{"gpu_type": t, "count": 1, "gpus_per_node": n} for t, n in per_type.items()])


def view(
    job_id: str,
    model: str,
    cluster: Cluster,
    *,
    gpus: int,
    submit_s: float = 0.0,
    by_type: dict[str, float] | None = None,
    placement=(),
    age_s: float = 3600.0,
    gpu_types: tuple[str, ...] | None = None,
) -> JobView:
    """A job requesting `gpus` GPUs; running on `placement` if given, with service `by_type` (GPU-s);
    profiled on `gpu_types` only if given."""
    by_type = {t: 0.0 for t in cluster.gpu_types} | (by_type or {})
    node_type = {n.name: n.gpu_type for n in cluster.nodes}
    current = Config(node_type[placement[0][0]], len(placement), gpus) if placement else None
    job = job_view(
        job_id,
        model,
        cluster,
        requested_gpus=gpus,
        submit_s=submit_s,
        age_s=age_s,
        current=current,
        placement=tuple(placement),
        gpu_types=gpu_types,
    )
    return dataclasses.replace(job, attained_by_type=by_type, attained_gpu_s=sum(by_type.values()))


def assert_valid(state: RoundState, decision: Decision) -> None:
    """Existing nodes, per-node capacity, one type per job, exactly the requested GPUs, allocations
    that describe the placements, only known jobs."""
    nodes = {n.name: n for n in state.cluster.nodes}
    jobs = {j.job_id: j for j in state.jobs}
    assert decision.placements is not None
    assert set(decision.allocations) == set(decision.placements)
    used: Counter[str] = Counter()
    for job_id, spots in decision.placements.items():
        assert job_id in jobs
        assert spots == tuple(sorted(spots)) and len({n for n, _ in spots}) == len(spots)
        assert all(node in nodes and gpus > 0 for node, gpus in spots), spots
        types = {nodes[node].gpu_type for node, _ in spots}
        assert len(types) == 1, f"{job_id} spans types {types}"
        total = sum(g for _, g in spots)
        assert total == jobs[job_id].requested_gpus
        assert decision.allocations[job_id] == Config(types.pop(), len(spots), total)
        for node, gpus in spots:
            used[node] += gpus
    for node, gpus in used.items():
        assert gpus <= nodes[node].gpus, f"{node} over capacity: {gpus} > {nodes[node].gpus}"


# --- a small replay ---------------------------------------------------------------------------

MODELS = ("bert", "cifar10", "deepspeech2", "imagenet", "yolov3")


@dataclasses.dataclass
class SimJob:
    job_id: str
    model: str
    gpus: int
    submit_s: float
    work_gpu_s: float
    by_type: dict[str, float]
    placement: tuple = ()
    gpu_types: tuple[str, ...] | None = None  # profiled only on these


def workload(cluster: Cluster, seed: int, n: int = 40) -> list[SimJob]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        model = rng.choice(MODELS)
        gpus = rng.choice((1, 1, 2, 4, 4, 8, 16))
        jobs.append(
            SimJob(
                f"j{i:02d}",
                model,
                gpus,
                float(rng.randrange(0, 900, 60)),
                gpus * rng.uniform(600, 4000),
                {t: 0.0 for t in cluster.gpu_types},
            )
        )
    # one job no type can hold, and (heterogeneous) one that runs on only two of the types
    jobs.append(SimJob("huge", "cifar10", 4 * cluster.total_gpus, 0.0, 1e9, {t: 0.0 for t in cluster.gpu_types}))
    if "dgx-ext" in cluster.gpu_types:
        jobs.append(
            SimJob(
                "two-types",
                "imagenet",
                4,
                120.0,
                4 * 1200.0,
                {t: 0.0 for t in cluster.gpu_types},
                gpu_types=("dgx-ext", "rtx"),
            )
        )
    return jobs


def replay(policy, cluster: Cluster, jobs: list[SimJob], rounds: int):
    """Yield (state, decision, previous placements) each round; jobs run at what was placed."""
    dt = policy.round_s
    node_type = {n.name: n.gpu_type for n in cluster.nodes}
    for r in range(rounds):
        now = r * dt
        active = [j for j in jobs if j.submit_s <= now and sum(j.by_type.values()) < j.work_gpu_s]
        views = [
            view(
                j.job_id,
                j.model,
                cluster,
                gpus=j.gpus,
                submit_s=j.submit_s,
                by_type=dict(j.by_type),
                placement=j.placement,
                age_s=now - j.submit_s,
                gpu_types=j.gpu_types,
            )
            for j in active
        ]
        state = round_state(views, cluster, now_s=now)
        decision = policy.allocate(state)
        yield state, decision
        for job in active:
            job.placement = decision.placements.get(job.job_id, ())
            if job.placement:
                job.by_type[node_type[job.placement[0][0]]] += job.gpus * dt


def type_capacity(cluster: Cluster) -> dict[str, int]:
    return {t: cluster.capacity(t) for t in cluster.gpu_types}


def runnable_types(state: RoundState, job: JobView) -> list[str]:
    row = requested_throughput_matrix([job], state.cluster)[0]
    return [t for t, v in zip(state.cluster.gpu_types, row) if v > 0]


def used_by_type(state: RoundState, decision: Decision, jobs=None) -> Counter[str]:
    used: Counter[str] = Counter()
    for job_id, config in decision.allocations.items():
        if jobs is None or job_id in jobs:
            used[config.gpu_type] += config.gpus
    return used


CLUSTERS = ("sia-hetero-64", "pollux-homo-64")


def check_fifo(state: RoundState, decision: Decision) -> None:
    placed = decision.placements
    for job in state.jobs:
        if job.placement:  # never preempted, never moved
            assert placed.get(job.job_id) == job.placement
    waiting = sorted((j for j in state.jobs if not j.placement), key=lambda j: (j.submit_s, j.job_id))
    blocked = [j for j in waiting if j.job_id not in placed and runnable_types(state, j)]
    if blocked:  # strict: nothing that arrived after the blocked head started
        head = blocked[0]
        for job in waiting:
            if (job.submit_s, job.job_id) > (head.submit_s, head.job_id):
                assert job.job_id not in placed, f"{job.job_id} started ahead of {head.job_id}"


def check_no_room_left(state: RoundState, decision: Decision, before=lambda job: None) -> None:
    """A runnable job left out found no room on any type it runs on, among the jobs placed before it
    (`before(job)`: the set of those; None: all placed jobs)."""
    capacity = type_capacity(state.cluster)
    for job in state.jobs:
        if job.job_id in decision.placements:
            continue
        used = used_by_type(state, decision, before(job))
        for gpu_type in runnable_types(state, job):
            assert used[gpu_type] + job.requested_gpus > capacity[gpu_type], (job.job_id, gpu_type)


def check_tiresias(policy: TiresiasPolicy):
    def check(state: RoundState, decision: Decision) -> None:
        key = {j.job_id: (policy.queue(j.attained_gpu_s), j.submit_s, j.job_id) for j in state.jobs}
        check_no_room_left(state, decision, lambda job: {i for i in decision.placements if key[i] < key[job.job_id]})
        for job in state.jobs:  # staying on its type means staying in place
            config = decision.allocations.get(job.job_id)
            if job.placement and config and config.gpu_type == job.current.gpu_type:
                assert decision.placements[job.job_id] == job.placement

    return check


def check_gavel(state: RoundState, decision: Decision) -> None:
    check_no_room_left(state, decision)
    for job in state.jobs:
        config = decision.allocations.get(job.job_id)
        if job.placement and config and config.gpu_type == job.current.gpu_type:
            assert decision.placements[job.job_id] == job.placement


@pytest.mark.parametrize("cluster_name", CLUSTERS)
@pytest.mark.parametrize("name", ["fifo", "fifo-backfill", "tiresias", "tiresias-low", "gavel"])
def test_replay_valid_and_invariants(name, cluster_name):
    cluster = load_cluster(cluster_name)
    policy, check = {
        "fifo": lambda: (FifoPolicy(), check_fifo),
        "fifo-backfill": lambda: (FifoPolicy(backfill=True), lambda s, d: None),
        "tiresias": lambda: (TiresiasPolicy(), None),
        "tiresias-low": lambda: (TiresiasPolicy(threshold_gpu_h=0.2), None),  # demotions happen
        "gavel": lambda: (GavelPolicy(), check_gavel),
    }[name]()
    check = check or check_tiresias(policy)
    seen_events, placed_any, preempted = set(), False, 0
    for state, decision in replay(policy, cluster, workload(cluster, seed=7), rounds=14):
        assert_valid(state, decision)
        check(state, decision)
        assert "huge" not in decision.placements
        seen_events.update(decision.events)
        placed_any |= bool(decision.placements)
        preempted += sum(1 for j in state.jobs if j.placement and j.job_id not in decision.placements)
    assert placed_any
    if name.startswith("fifo"):
        assert preempted == 0
        assert any("huge" in e for e in seen_events)  # skipped with a reason, never a blocker
    if name == "tiresias-low":
        assert preempted > 0


@pytest.mark.parametrize("name", ["fifo", "tiresias", "gavel"])
def test_registry_and_interface(name):
    policy = make_policy(name)
    assert policy.name == name
    assert policy.adaptive_batch is False
    assert policy.round_s == {"fifo": 60.0, "tiresias": 60.0, "gavel": 360.0}[name]
    assert type(policy) is {"fifo": FifoPolicy, "tiresias": TiresiasPolicy, "gavel": GavelPolicy}[name]
    assert make_policy("tiresias", threshold_gpu_h=2.0).threshold_gpu_h == 2.0


@pytest.mark.parametrize("name", ["fifo", "tiresias", "gavel"])
def test_deterministic_and_order_independent(name):
    cluster = load_cluster("sia-hetero-64")
    jobs = workload(cluster, seed=3)
    states = [state for state, _ in replay(make_policy(name), cluster, jobs, rounds=6)]
    state = states[-1]
    first = make_policy(name).allocate(state)
    assert make_policy(name).allocate(state) == first
    shuffled = list(state.jobs)
    random.Random(1).shuffle(shuffled)
    again = make_policy(name).allocate(round_state(shuffled, cluster, now_s=state.now_s))
    assert again.placements == first.placements and again.allocations == first.allocations


# --- shared helpers ---------------------------------------------------------------------------


def test_split_batch():
    assert split_batch(512, 4, 1024) == (128, 0)
    assert split_batch(64, 4, 8) == (8, 1)  # 16 a GPU > 8: two micro-batches of 8
    assert split_batch(100, 4, 8) == (7, 3)  # s = ceil(100/32) - 1 = 3, m = ceil(100/16) = 7
    assert split_batch(3, 4, 8) == (1, 0)


def test_requested_throughput_zero_where_it_cannot_run():
    cluster = small_cluster(aws=4, rtx=8)
    jobs = [view("a", "imagenet", cluster, gpus=8), view("b", "bert", cluster, gpus=2, gpu_types=("rtx",))]
    thr = requested_throughput_matrix(jobs, cluster)
    assert thr[0, 0] == 0 and thr[0, 1] > 0  # 8 GPUs do not exist on aws
    assert thr[1, 0] == 0 and thr[1, 1] > 0  # b has no aws model


# --- fifo -------------------------------------------------------------------------------------


def test_fifo_strict_blocks_and_backfill_passes():
    cluster = small_cluster(aws=8)
    state = round_state(
        [
            view("run", "cifar10", cluster, gpus=6, submit_s=0, placement=(("aws-0", 6),)),
            view("head", "cifar10", cluster, gpus=4, submit_s=10),
            view("small", "cifar10", cluster, gpus=2, submit_s=20),
        ],
        cluster,
    )
    strict = FifoPolicy().allocate(state)
    assert strict.placements == {"run": (("aws-0", 6),)}
    backfill = FifoPolicy(backfill=True).allocate(state)
    assert backfill.placements == {"run": (("aws-0", 6),), "small": (("aws-0", 2),)}


def test_fifo_starts_in_arrival_order_on_the_fastest_type_with_room():
    cluster = small_cluster(aws=4, rtx=4)
    # imagenet is faster on rtx, yolov3 on aws (the zoo's fitted models)
    thr = requested_throughput_matrix(
        [view("i", "imagenet", cluster, gpus=4), view("y", "yolov3", cluster, gpus=4)], cluster
    )
    assert thr[0, 1] > thr[0, 0] and thr[1, 0] > thr[1, 1]
    state = round_state(
        [
            view("i2", "imagenet", cluster, gpus=4, submit_s=5),
            view("i1", "imagenet", cluster, gpus=4, submit_s=5),
            view("i3", "imagenet", cluster, gpus=4, submit_s=9),
        ],
        cluster,
    )
    decision = FifoPolicy().allocate(state)
    # i1 first (same time, job_id), on rtx; i2 takes what is left (aws); i3 waits
    assert decision.allocations == {"i1": Config("rtx", 1, 4), "i2": Config("aws", 1, 4)}


def test_fifo_never_preempts_an_older_running_job():
    cluster = small_cluster(aws=4)
    state = round_state(
        [
            view("late", "cifar10", cluster, gpus=4, submit_s=100, placement=(("aws-0", 4),)),
            view("early", "cifar10", cluster, gpus=4, submit_s=0),
        ],
        cluster,
    )
    assert FifoPolicy().allocate(state).placements == {"late": (("aws-0", 4),)}


# --- tiresias ---------------------------------------------------------------------------------


def test_tiresias_demotes_past_threshold_and_preempts_for_queue_zero():
    cluster = small_cluster(aws=4)
    policy = TiresiasPolicy()
    assert policy.queue(16 * HOUR - 1) == 0 and policy.queue(16 * HOUR) == 1

    def state(service_h):
        return round_state(
            [
                view(
                    "old",
                    "cifar10",
                    cluster,
                    gpus=4,
                    submit_s=0,
                    placement=(("aws-0", 4),),
                    by_type={"aws": service_h * HOUR},
                ),
                view("new", "cifar10", cluster, gpus=4, submit_s=500),
            ],
            cluster,
        )

    # below the threshold the earlier job keeps its GPUs
    assert policy.allocate(state(15.0)).placements == {"old": (("aws-0", 4),)}
    # past it, it is in queue 1 and the queue-0 job that needs its GPUs takes them
    assert policy.allocate(state(17.0)).placements == {"new": (("aws-0", 4),)}
    # the threshold is an option
    assert TiresiasPolicy(threshold_gpu_h=20).allocate(state(17.0)).placements == {"old": (("aws-0", 4),)}


def test_tiresias_keeps_placements_and_skips_what_does_not_fit():
    cluster = build_cluster("two-nodes", [{"gpu_type": "aws", "count": 2, "gpus_per_node": 4}])
    state = round_state(
        [
            view("a", "cifar10", cluster, gpus=2, submit_s=0, placement=(("aws-0", 1), ("aws-1", 1))),
            view("big", "cifar10", cluster, gpus=8, submit_s=10),  # queue 0, does not fit: skipped
            view("b", "cifar10", cluster, gpus=4, submit_s=20),
            view("c", "cifar10", cluster, gpus=4, submit_s=30),  # no room left after a and b
        ],
        cluster,
    )
    decision = TiresiasPolicy().allocate(state)
    assert_valid(state, decision)
    assert decision.placements["a"] == (("aws-0", 1), ("aws-1", 1))  # kept exactly, even if scattered
    assert set(decision.placements) == {"a", "b"}


def test_tiresias_uses_the_fastest_type_with_room():
    cluster = small_cluster(aws=4, rtx=4)
    state = round_state(
        [
            view("y", "yolov3", cluster, gpus=4, submit_s=0),
            view("i", "imagenet", cluster, gpus=4, submit_s=1),
            view("i2", "imagenet", cluster, gpus=4, submit_s=2),
        ],
        cluster,
    )
    decision = TiresiasPolicy().allocate(state)
    assert decision.allocations == {"y": Config("aws", 1, 4), "i": Config("rtx", 1, 4)}


# --- gavel ------------------------------------------------------------------------------------


def max_min_value_cvxpy(thr, gpus, capacity) -> float:
    """The same LP through cvxpy, as an independent check of the optimum."""
    thr, gpus, capacity = (np.asarray(a, float) for a in (thr, gpus, capacity))
    norm = thr / proportional_throughput(thr, capacity)[:, None]
    x = cp.Variable(thr.shape, nonneg=True)
    constraints = (
        [cp.sum(x, axis=1) <= 1, gpus @ x <= capacity, x[thr == 0] == 0]
        if (thr == 0).any()
        else [cp.sum(x, axis=1) <= 1, gpus @ x <= capacity]
    )
    problem = cp.Problem(cp.Maximize(cp.min(cp.sum(cp.multiply(norm, x), axis=1))), constraints)
    problem.solve(solver="CLARABEL")
    return float(problem.value)


def test_gavel_lp_opposite_speedups_each_gets_its_faster_type():
    thr = np.array([[2.0, 1.0], [1.0, 2.0]])
    fair = max_min_fair(thr, gpus=np.array([1, 1]), capacity=np.array([1, 1]))
    np.testing.assert_allclose(fair.x, [[1, 0], [0, 1]], atol=1e-7)
    assert fair.value == pytest.approx(2.0 / 1.5)  # thr_eq = (2 + 1) / 2


def test_gavel_lp_equalises_normalised_throughput():
    # three jobs, one slow and one fast type of one GPU each; job 2 gains nothing from the fast type
    thr = np.array([[1.0, 3.0], [1.0, 2.0], [1.0, 1.0]])
    gpus, capacity = np.array([1, 1, 1]), np.array([1, 1])
    fair = max_min_fair(thr, gpus, capacity)
    normalised = (fair.x * thr).sum(axis=1) / proportional_throughput(thr, capacity)
    np.testing.assert_allclose(normalised, fair.value, rtol=1e-5)  # everyone at the optimum
    assert fair.value == pytest.approx(max_min_value_cvxpy(thr, gpus, capacity), rel=1e-5)
    assert (fair.x.sum(axis=1) <= 1 + 1e-9).all() and ((gpus @ fair.x) <= capacity + 1e-9).all()


@pytest.mark.parametrize("seed", range(5))
def test_gavel_lp_matches_cvxpy_on_random_instances(seed):
    rng = np.random.default_rng(seed)
    jobs, types = 8, 3
    thr = rng.uniform(0.2, 3.0, (jobs, types)) * (rng.random((jobs, types)) > 0.2)
    thr[:, 0] = np.maximum(thr[:, 0], 0.1)  # every job runs somewhere
    gpus = rng.choice([1, 2, 4], jobs)
    capacity = np.array([4, 8, 4])
    for refine in (False, True):
        fair = max_min_fair(thr, gpus, capacity, refine=refine)
        assert fair.status == "optimal"
        normalised = (fair.x * thr).sum(axis=1) / proportional_throughput(thr, capacity)
        assert normalised.min() == pytest.approx(fair.value, rel=1e-5)
        assert fair.value == pytest.approx(max_min_value_cvxpy(thr, gpus, capacity), rel=1e-5)
        assert (fair.x[thr == 0] == 0).all()
        assert (fair.x.sum(axis=1) <= 1 + 1e-7).all() and ((gpus @ fair.x) <= capacity + 1e-7).all()


def test_gavel_places_each_job_on_its_faster_type():
    cluster = small_cluster(aws=4, rtx=4)
    for first, second in (("y", "i"), ("i", "y")):  # whichever arrived first
        jobs = {"y": "yolov3", "i": "imagenet"}
        state = round_state(
            [
                view(first, jobs[first], cluster, gpus=4, submit_s=0),
                view(second, jobs[second], cluster, gpus=4, submit_s=1),
            ],
            cluster,
        )
        decision = GavelPolicy().allocate(state)
        assert_valid(state, decision)
        assert decision.allocations == {"y": Config("aws", 1, 4), "i": Config("rtx", 1, 4)}


def test_gavel_priority_favours_the_job_behind_its_share():
    cluster = small_cluster(aws=4)
    age = 3600.0

    def state(a_share, b_share, running="a"):
        # X = 1/2 each (two identical jobs, room for one); shares are fractions of their age
        placement = {running: (("aws-0", 4),)}
        return round_state(
            [
                view(
                    "a",
                    "cifar10",
                    cluster,
                    gpus=4,
                    submit_s=0,
                    age_s=age,
                    placement=placement.get("a", ()),
                    by_type={"aws": 4 * a_share * age},
                ),
                view(
                    "b",
                    "cifar10",
                    cluster,
                    gpus=4,
                    submit_s=0,
                    age_s=age,
                    placement=placement.get("b", ()),
                    by_type={"aws": 4 * b_share * age},
                ),
            ],
            cluster,
        )

    # a ran 60% of the time, b 40%: b's priority 0.5/0.4 beats a's 0.5/0.6, a is preempted
    assert GavelPolicy().allocate(state(0.6, 0.4)).placements == {"b": (("aws-0", 4),)}
    assert GavelPolicy().allocate(state(0.4, 0.6)).placements == {"a": (("aws-0", 4),)}
    # a job that never ran has infinite priority
    assert GavelPolicy().allocate(state(0.2, 0.0)).placements == {"b": (("aws-0", 4),)}


def test_gavel_priority_order_ranks_by_share_over_received():
    cluster = small_cluster(aws=4, rtx=4)
    jobs = [
        view("a", "cifar10", cluster, gpus=4, by_type={"aws": 4 * 0.5 * 3600}),  # f = 0.5 on aws
        view("b", "cifar10", cluster, gpus=4, by_type={"aws": 4 * 0.1 * 3600}),
    ]  # f = 0.1 on aws
    x = np.array([[0.5, 0.0], [0.3, 0.0]])
    runnable = np.array([[True, True], [True, True]])
    order = priority_order(jobs, cluster.gpu_types, x, runnable)
    # b on aws: 0.3/0.1 = 3 > a on aws: 1; X = 0 pairs come last
    assert order[:2] == [(1, 0), (0, 0)]
    assert set(order[2:]) == {(0, 1), (1, 1)}


def test_gavel_keeps_a_running_job_in_place_and_fills_leftovers():
    cluster = build_cluster("two-nodes", [{"gpu_type": "aws", "count": 2, "gpus_per_node": 4}])
    state = round_state(
        [
            view(
                "a",
                "cifar10",
                cluster,
                gpus=2,
                submit_s=0,
                placement=(("aws-0", 1), ("aws-1", 1)),
                by_type={"aws": 2 * 1800.0},
            ),
            view("b", "cifar10", cluster, gpus=4, submit_s=5),
            view("c", "cifar10", cluster, gpus=1, submit_s=6),
        ],
        cluster,
    )
    decision = GavelPolicy().allocate(state)
    assert_valid(state, decision)
    assert decision.placements["a"] == (("aws-0", 1), ("aws-1", 1))
    assert set(decision.placements) == {"a", "b", "c"}


# --- edges ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fifo", "tiresias", "gavel"])
def test_edges_empty_unrunnable_and_mismatched_placements(name):
    cluster = small_cluster(aws=4, rtx=4)
    empty = make_policy(name).allocate(round_state([], cluster))
    assert empty.placements == {} and empty.allocations == {}
    state = round_state(
        [
            view("too-big", "cifar10", cluster, gpus=8, submit_s=0),  # no type has 8 GPUs
            view("no-model", "bert", small_cluster(aws=4), gpus=2, submit_s=1, gpu_types=("rtx",)),  # no aws model
            # placed by another policy at 2 GPUs, requests 4: re-placed at its request
            view("resized", "cifar10", cluster, gpus=4, submit_s=2, placement=(("aws-0", 2),)),
        ],
        cluster,
    )
    decision = make_policy(name).allocate(state)
    assert_valid(state, decision)
    assert set(decision.allocations) == {"resized"} and decision.allocations["resized"].gpus == 4
    assert any("too-big" in e for e in decision.events) and any("no-model" in e for e in decision.events)
