"""Interference: distributed jobs sharing a node train slower; pollux's avoidance keeps them apart."""

from collections import defaultdict
from dataclasses import replace

import pytest

from policies.base import make_policy
from services.simulated.truth import job_sources
from shared.cluster import load_cluster
from shared.settings import simulation_settings
from sim.reference import WorkloadJob
from sim.run import Simulation, simulate
from sim.simulator import DirectWiring, Simulator

ZOO = job_sources(use_zoo=True)
# Distributed-capable jobs arriving a minute apart on 16 4-GPU nodes: room to pack two on a node.
CROWD = [
    WorkloadJob(f"{model}-{i}", 60 * i, model, 4, batch)
    for i, (model, batch) in enumerate(
        [
            ("cifar10", 512),
            ("imagenet", 400),
            ("deepspeech2", 80),
            ("yolov3", 32),
            ("cifar10", 512),
            ("imagenet", 400),
            ("deepspeech2", 80),
            ("bert", 24),
        ]
    )
]


def shared_nodes_per_round(avoid: bool, interference: float = 0.0) -> list[int]:
    """For each decision, how many nodes held two or more distributed jobs."""
    cluster = load_cluster("pollux-homo-64")
    settings = simulation_settings("pollux", "pollux-homo-64", interference=interference)
    sim = Simulator(
        CROWD,
        cluster,
        make_policy("pollux", avoid_interference=avoid),
        replace(settings, horizon_s=4 * 3600),
        ZOO.truths,
        ZOO.profile,
    )
    counts = []
    apply = DirectWiring.apply

    async def recording_apply(wiring, request):
        holders = defaultdict(int)
        for spots in request.placements.values():
            if len(spots) > 1:
                for node, _ in spots:
                    holders[node] += 1
        counts.append(sum(n > 1 for n in holders.values()))
        await apply(wiring, request)

    sim.wiring.apply = recording_apply.__get__(sim.wiring)
    sim.run()
    return counts


def test_with_avoidance_no_node_ever_holds_two_distributed_jobs():
    assert max(shared_nodes_per_round(avoid=True)) == 0


def test_without_avoidance_distributed_jobs_do_share_nodes():
    assert max(shared_nodes_per_round(avoid=False)) > 0  # so the check above could fail


def test_interfered_jobs_are_the_distributed_ones_sharing_a_node():
    from services.simulated.world import SimulatedExecutors

    cluster = load_cluster("pollux-homo-64")
    executors = SimulatedExecutors(cluster, simulation_settings("pollux", "pollux-homo-64", interference=0.5), 1)
    truth = ZOO.truths["cifar10"]
    for name in "abcd":
        executors.add(WorkloadJob(name, 0, "cifar10", 4, 512), truth)
    node = [n.name for n in cluster.nodes]
    executors.jobs["a"].placement = ((node[0], 2), (node[1], 2))
    executors.jobs["b"].placement = ((node[1], 2), (node[2], 2))  # shares node 1 with a
    executors.jobs["c"].placement = ((node[3], 4),)  # one node: not distributed
    executors.jobs["d"].placement = ((node[4], 2), (node[5], 2))  # alone on its nodes
    assert executors.interfered("abcd") == {"a", "b"}
    assert executors.interfered("ad") == set()  # only the jobs running count


def test_a_slowdown_slows_training_by_that_fraction():
    from services.simulated.world import SimulatedJob

    cluster = load_cluster("pollux-homo-64")
    truth = ZOO.truths["cifar10"]
    spots = tuple((n.name, 4) for n in cluster.nodes[:2])
    iterations = {}
    for slowdown in (0.0, 0.25):
        job = SimulatedJob(
            WorkloadJob("j", 0, "cifar10", 8, 1024),
            None,
            0.0,
            1.0,
            placement=spots,
            config=cluster.config_of(spots),
            m=128,
            s=0,
        )
        job.advance(truth, 0.0, 60.0, 1, slowdown)
        iterations[slowdown] = job.iterations
    assert iterations[0.25] == pytest.approx(0.75 * iterations[0.0], rel=1e-12)


def test_interference_is_a_fraction_below_one():
    with pytest.raises(ValueError, match="interference"):
        simulate(
            Simulation([WorkloadJob("j", 0, "cifar10", 2, 256)], "pollux-homo-64", "fifo", interference=1.5),
            sources=ZOO,
        )


def test_the_command_refuses_a_bad_slowdown_before_running_anything(capsys):
    from cli.main import main

    assert main(["interference", "--workloads", "examples/workloads/mixed-40.csv", "--slowdowns", "0", "1.5"]) == 2
    assert "slowdowns are fractions in [0, 1)" in capsys.readouterr().err
