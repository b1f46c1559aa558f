"""The `sia` policy around the ILP: restart factors, locks, and decisions the placer can place."""

import pytest

from policies.base import make_policy, restart_factor
from policies.goodput import SHRINK_FLOOR
from services.placer.core import place
from shared.cluster import load_cluster
from shared.schema.base import Config
from sim.rounds import job_view, round_state

CLUSTER = load_cluster("sia-hetero-64")


def test_restart_factor():
    sia = dict(free_while_young=True)
    assert restart_factor(age_s=20, restarts=3, restart_cost_s=30, **sia) == 1.0  # younger than S
    assert restart_factor(age_s=20, restarts=3, restart_cost_s=30) == 0.0  # Pollux: no such grace
    assert restart_factor(age_s=600, restarts=2, restart_cost_s=30, **sia) == pytest.approx((600 - 60) / 630)
    assert restart_factor(age_s=100, restarts=10, restart_cost_s=30, **sia) == 0.0  # never negative


def test_only_running_jobs_pay_the_restart_factor():
    running = job_view("run", "cifar10", CLUSTER, age_s=600, restarts=5, current=Config("rtx", 1, 2), max_gpus_seen=2)
    waiting = job_view("wait", "cifar10", CLUSTER, age_s=600, restarts=5, max_gpus_seen=2)
    problem = make_policy("sia").problem(round_state([running, waiting]))
    assert problem.restart_factor[0] == pytest.approx((600 - 150) / 630)
    assert problem.restart_factor[1] == 1.0


def test_a_job_mid_restart_keeps_its_configuration():
    held = Config("aws", 1, 1)
    jobs = [
        job_view("busy", "imagenet", CLUSTER, current=held, mid_restart=True, max_gpus_seen=8, progress=1e5),
        job_view("other", "cifar10", CLUSTER, max_gpus_seen=4),
    ]
    decision = make_policy("sia").allocate(round_state(jobs))
    assert decision.allocations["busy"] == held


def test_decisions_fit_the_cluster_and_the_placer_places_them():
    jobs = [
        job_view(f"{m}-{i}", m, CLUSTER, max_gpus_seen=g)
        for i, (m, g) in enumerate(
            [
                ("cifar10", 4),
                ("imagenet", 16),
                ("bert", 2),
                ("deepspeech2", 8),
                ("yolov3", 8),
                ("imagenet", 16),
                ("cifar10", 0),
            ]
        )
    ]
    decision = make_policy("sia").allocate(round_state(jobs))
    configs = set(CLUSTER.configurations())
    assert set(decision.allocations.values()) <= configs
    for gpu_type in CLUSTER.gpu_types:
        used = sum(c.gpus for c in decision.allocations.values() if c.gpu_type == gpu_type)
        assert used <= CLUSTER.capacity(gpu_type)
    assert decision.allocations["cifar10-6"].gpus == 1  # a new job starts on one GPU
    assert not place(CLUSTER, decision.allocations, {}).evicted


def test_fairness_exponent_is_an_option():
    assert make_policy("sia", p=-1.0).p == -1.0
    with pytest.raises(ValueError):
        make_policy("sia", p=0.0).allocate(round_state([job_view("a", "cifar10", CLUSTER)]))


def test_goodput_lets_a_new_job_start_on_what_it_asked_for_and_then_doubles_as_sia():
    """A lone imagenet job asking for 8 GPUs: sia starts it on 1; goodput on up to 8 (what the matrix
    finds best, never more than asked); a job that ran is held to twice the most it had, by both."""
    new = job_view("new", "imagenet", CLUSTER, requested_gpus=8, progress=1e5)
    sia, goodput = make_policy("sia"), make_policy("goodput")
    assert sia.allocate(round_state([new])).allocations["new"].gpus == 1
    first = goodput.allocate(round_state([new])).allocations["new"]
    assert 1 < first.gpus <= 8, first
    ran = job_view("ran", "imagenet", CLUSTER, requested_gpus=8, max_gpus_seen=2, progress=1e5)
    assert goodput.allocate(round_state([ran])).allocations["ran"].gpus <= 4
    alone = job_view("one", "imagenet", CLUSTER, requested_gpus=1, progress=1e5)
    assert goodput.allocate(round_state([alone])).allocations["one"].gpus == 1  # asked for one: as sia


def test_goodput_never_stops_a_running_job_to_let_another_grow_while_every_job_fits():
    """Two nodes of 4 GPUs: an ncf job on 1, a young deepspeech2 job (its restart still free, Sia's
    rule) on the other 4. sia stops the ncf job, as leaving it out costs only lam - 1 = 0.1, to give
    deepspeech2 both nodes; goodput keeps it running (mechanism 2, with no job waiting)."""
    cluster = load_cluster("pollux-homo-64")
    cluster = type(cluster)("eight", cluster.nodes[:2])
    gpu_type, (a, b) = cluster.nodes[0].gpu_type, (n.name for n in cluster.nodes)
    small = job_view(
        "small",
        "ncf",
        cluster,
        age_s=60,
        current=Config(gpu_type, 1, 1),
        placement=((a, 1),),
        requested_gpus=1,
        max_gpus_seen=1,
        progress=1e3,
    )
    big = job_view(
        "big",
        "deepspeech2",
        cluster,
        age_s=60,
        restart_cost_s=250,
        current=Config(gpu_type, 1, 4),
        placement=((b, 4),),
        requested_gpus=4,
        max_gpus_seen=4,
        progress=1e5,
    )
    state = round_state([small, big], cluster)
    assert make_policy("sia").allocate(state).allocations == {"big": Config(gpu_type, 2, 8)}
    kept = make_policy("goodput").allocate(state).allocations
    assert (
        kept["small"].gpus >= 1 and not place(cluster, kept, {"small": small.placement, "big": big.placement}).evicted
    )


def test_goodput_prices_a_shrink_with_its_floor_and_sia_does_not():
    """The round's ILP under goodput carries the shrink floor (its effect: tests/test_sia_ilp.py)."""
    running = job_view(
        "big", "imagenet", CLUSTER, current=Config("dgx-ext", 1, 8), requested_gpus=8, max_gpus_seen=8, progress=1e5
    )
    state = round_state([running, job_view("small", "cifar10", CLUSTER)])
    assert make_policy("goodput").problem(state).shrink_floor == SHRINK_FLOOR > 0
    assert make_policy("sia").problem(state).shrink_floor == 0


def test_goodput_starts_a_waiting_job_on_a_full_cluster_where_sia_leaves_it_waiting():
    """One node of 4 GPUs, all held by a job that restarted so often that Sia's restart factor pins it: a
    new one-GPU job waits under sia for as long as that lasts; under goodput it starts at once."""
    cluster = load_cluster("pollux-homo-64")
    cluster = type(cluster)("four", cluster.nodes[:1])
    held = Config(cluster.nodes[0].gpu_type, 1, 4)
    old = job_view(
        "old",
        "imagenet",
        cluster,
        age_s=3000,
        restarts=12,
        restart_cost_s=250,
        current=held,
        placement=((cluster.nodes[0].name, 4),),
        requested_gpus=4,
        max_gpus_seen=4,
        progress=1e5,
    )
    new = job_view("new", "ncf", cluster, age_s=0, requested_gpus=1)
    state = round_state([old, new], cluster)
    assert "new" not in make_policy("sia").allocate(state).allocations
    decided = make_policy("goodput").allocate(state).allocations
    assert decided["new"].gpus >= 1 and decided["old"].gpus <= 3
    placed = place(cluster, decided, {"old": old.placement}, {})
    assert not placed.evicted


@pytest.mark.parametrize("policy", ["sia", "goodput"])
def test_of_equal_new_jobs_on_a_full_cluster_the_first_submitted_start(policy):
    """Six alike cifar10 jobs for four GPUs: those submitted first start (the solver's pick among
    equals would be arbitrary; it was newest first)."""
    cluster = load_cluster("examples/clusters/one-node-4xT4.yaml")
    submitted = [50.0, 10.0, 40.0, 0.0, 30.0, 20.0]
    jobs = [job_view(f"c{i}", "cifar10", cluster, submit_s=s, age_s=3600.0 - s) for i, s in enumerate(submitted)]
    started = make_policy(policy).allocate(round_state(jobs, cluster)).allocations
    first = sorted(range(6), key=lambda i: submitted[i])[: len(started)]
    assert set(started) == {f"c{i}" for i in first} and 2 <= len(started) < 6, started


@pytest.mark.parametrize("policy", ["sia", "goodput"])
def test_a_job_waiting_past_max_wait_s_must_run_and_a_rigid_job_holding_the_cluster_makes_room(policy):
    """One node of 4 GPUs held by a rigid job that restarted so often that its restart factor pins
    it: a one-GPU job waits behind it for an hour, unbounded; with max_wait_s it starts once it has
    waited that long, the rigid job left out (it cannot shrink)."""
    cluster = load_cluster("pollux-homo-64")
    cluster = type(cluster)("four", cluster.nodes[:1])
    node = cluster.nodes[0]
    rigid = job_view(
        "rigid",
        "imagenet",
        cluster,
        age_s=3000,
        restarts=12,
        restart_cost_s=250,
        current=Config(node.gpu_type, 1, 4),
        placement=((node.name, 4),),
        requested_gpus=4,
        max_gpus_seen=4,
        fixed_gpus=4,
        progress=1e5,
    )
    waiting = job_view("waiting", "ncf", cluster, submit_s=0.0, age_s=3600.0, requested_gpus=1)
    state = round_state([rigid, waiting], cluster, now_s=3600.0)
    assert make_policy(policy).allocate(state).allocations == {"rigid": Config(node.gpu_type, 1, 4)}
    assert make_policy(policy, max_wait_s=7200.0).allocate(state).allocations == {"rigid": Config(node.gpu_type, 1, 4)}
    decided = make_policy(policy, max_wait_s=1800.0).allocate(state).allocations
    assert set(decided) == {"waiting"}, decided
    with pytest.raises(ValueError, match="max_wait_s must be positive"):
        make_policy(policy, max_wait_s=0)
