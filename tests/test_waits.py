"""Why a job waits (shared/waits.py): the reason names the real cause, from the job's request and
the nodes as they are; a job the nodes cannot take is told apart from one that waits its turn."""

from shared.schema.base import Node
from shared.waits import needs_of, unschedulable, wait_reason

TWO_SLOTS = (Node("cpu-0", "cpu", 1), Node("cpu-1", "cpu", 1))  # `goodput up --nodes 2`
RIGID_2 = needs_of(2, 1, True)
ADAPTIVE = needs_of(4, 1, False)


def test_a_rigid_job_that_no_configuration_of_the_live_nodes_takes_is_unschedulable():
    assert unschedulable(RIGID_2, TWO_SLOTS) is None  # two whole nodes of one slot
    drained = TWO_SLOTS[1:]
    reason = unschedulable(RIGID_2, TWO_SLOTS[:1], drained)
    assert reason.startswith("needs 2 GPUs of one type; the schedulable nodes of its types (cpu) give a job 1 ")
    assert reason.endswith("; it would fit without the drains of cpu-1"), reason
    # Three GPUs are no configuration of nodes of 4: 1, 2 or 4 on one node, 8 on two.
    big = (Node("a-0", "a100", 4), Node("a-1", "a100", 4))
    assert "give a job 1, 2, 4 or 8" in unschedulable(needs_of(3, 1, True), big)
    assert unschedulable(needs_of(8, 1, True), big) is None
    assert unschedulable(needs_of(1, 16, False), big).startswith("needs at least 16 GPUs of one type")


def test_a_job_whose_types_have_no_schedulable_node_says_so():
    nodes = (Node("cpu-0", "cpu", 4),)
    a100 = needs_of(1, 1, False, ("a100",))
    assert unschedulable(a100, nodes) == "no live node has its GPU types (a100)"
    assert unschedulable(a100, nodes, (Node("gpu-0", "a100", 8),)) == "its GPU types (a100) are all drained"
    assert unschedulable(ADAPTIVE, (), ()) == "no node is live"
    assert unschedulable(ADAPTIVE, (), TWO_SLOTS) == "every live node is drained (cpu-0, cpu-1)"
    assert unschedulable(a100, nodes + (Node("gpu-1", "a100", 1),)) is None


def test_a_job_that_can_run_waits_for_a_block_that_fits_it():
    nodes = (Node("a-0", "a100", 4),)
    held = {"x": (("a-0", 2),), "y": (("a-0", 1),)}
    assert wait_reason(RIGID_2, nodes, held) == "needs 2 a100 GPUs on one node, and the largest free block is 1"
    two = (Node("a-0", "a100", 2), Node("a-1", "a100", 2))
    held = {"x": (("a-0", 1),), "y": (("a-1", 1),)}
    assert wait_reason(RIGID_2, two, held, ahead=1) == (
        "needs 2 a100 GPUs on one node, and the largest free block is 1; 1 queued job submitted before it"
    )
    # Where nodes have one slot, 2 GPUs are two whole nodes.
    assert wait_reason(RIGID_2, TWO_SLOTS, {"x": (("cpu-0", 1),)}) == (
        "needs 2 cpu GPUs on 2 whole nodes, and 1 is wholly free"
    )


def test_a_full_cluster_names_the_jobs_holding_its_types():
    nodes = (Node("a-0", "a100", 2), Node("a-1", "a100", 2), Node("k-0", "k80", 4))
    held = {"x": (("a-0", 2),), "y": (("a-1", 1),), "z": (("a-1", 1),)}
    only_a100 = needs_of(1, 1, False, ("a100",))
    assert wait_reason(only_a100, nodes, held, ahead=3) == (
        "the cluster is full: 3 jobs hold its types' 4 GPUs; 3 queued jobs submitted before it"
    )
    # Any type: the free k80s fit it, and the next round may give them.
    assert wait_reason(ADAPTIVE, nodes, held) == "waiting for the next round: 4 GPUs of its types are free and fit it"


def test_profiling_runs_hold_gpus_too_and_no_node_is_ever_less_than_empty():
    nodes = (Node("a-0", "a100", 2),)
    assert wait_reason(ADAPTIVE, nodes, {"x": (("a-0", 1),)}, profiling=("a-0",)) == (
        "the cluster is full: 1 job and 1 profiling run hold its types' 2 GPUs"
    )
    assert wait_reason(ADAPTIVE, nodes, {}, profiling=("a-0", "a-0")) == (
        "the cluster is full: 2 profiling runs hold its types' 2 GPUs"
    )
    # A job leaving a node and the one taking it, both reported there for a moment: full, not -1 free.
    two = needs_of(2, 2, True, ("a100",))
    both = {"x": (("a-0", 2),), "y": (("a-0", 2),)}
    assert wait_reason(two, nodes, both) == "the cluster is full: 2 jobs hold its types' 2 GPUs"


def test_the_simulated_executors_flag_a_rigid_job_their_cluster_cannot_take():
    """The simulated cluster does not change: a rigid job of 3 GPUs on nodes of 4 never runs, and
    reads unschedulable with why; one of 4 is queued."""
    from services.simulated.truth import job_sources
    from services.simulated.world import SimulatedExecutors
    from shared.cluster import load_cluster
    from shared.schema.jobs import JobSpec
    from shared.settings import simulation_settings

    sources = job_sources(use_zoo=True)
    cluster = load_cluster("sia-hetero-64")
    executors = SimulatedExecutors(cluster, simulation_settings(None, "sia-hetero-64"), 1)
    for name, gpus in (("three", 3), ("four", 4)):
        executors.submit(JobSpec(name, "cifar10", requested_gpus=gpus, rigid=True), sources.truths["cifar10"])
    three, four = executors.jobs["three"].record(), executors.jobs["four"].record()
    assert (three.state, four.state, four.reason) == ("unschedulable", "queued", None)
    assert three.reason.startswith("needs 3 GPUs of one type; the schedulable nodes of its types"), three.reason


def test_the_simulated_executors_say_why_each_queued_job_waits_behind_those_before_it():
    """sia-hetero-64 with its A100s and T4s held and 4 GPUs held on two RTX nodes of 8: a rigid job of
    16 needs two whole nodes and one is free; one of 4, submitted after it, fits now; one of 8 that
    names the A100s finds them full."""
    from services.simulated.truth import job_sources
    from services.simulated.world import SimulatedExecutors
    from shared.cluster import load_cluster
    from shared.schema.jobs import JobSpec
    from shared.schema.rounds import ApplyRequest
    from shared.settings import simulation_settings

    truth = job_sources(use_zoo=True).truths["cifar10"]
    cluster = load_cluster("sia-hetero-64")
    executors = SimulatedExecutors(cluster, simulation_settings(None, "sia-hetero-64"), 1)
    running = {
        "a": (("dgx-ext-0", 8), ("dgx-ext-1", 8)),
        "b": tuple((f"aws-{i}", 4) for i in range(6)),
        "x": (("rtx-0", 4),),
        "y": (("rtx-1", 4),),
    }
    for name, gpus in (("a", 16), ("b", 24), ("x", 4), ("y", 4), ("c", 16), ("d", 4), ("done", 8)):
        executors.submit(JobSpec(name, "cifar10", requested_gpus=gpus, rigid=True, submit_s=0.0), truth)
        executors.jobs[name].placement = running.get(name, ())
    executors.jobs["done"].placement, executors.jobs["done"].finish_s = (("rtx-2", 8),), 60.0  # holds nothing
    executors.submit(JobSpec("e", "cifar10", requested_gpus=8, rigid=True, gpu_types=("A100",), submit_s=0.0), truth)
    waits = executors.waits()
    assert set(waits) == {"c", "d", "e"}
    # The types its submission names, not every type it has a profile on.
    assert waits["e"] == "the cluster is full: 1 job holds its types' 16 GPUs; 2 queued jobs submitted before it"
    assert waits["c"].startswith("needs 16 aws GPUs on 4 whole nodes, and 0 are wholly free"), waits["c"]
    assert "16 rtx GPUs on 2 whole nodes, and 1 is wholly free" in waits["c"]
    assert waits["d"] == (
        "waiting for the next round: 16 GPUs of its types are free and fit it; 1 queued job submitted before it"
    )
    # A round that leaves a job waiting on its team's limits says so, and the executors say it of it
    # until a round says otherwise.
    executors.apply(ApplyRequest(120.0, {}, {}, True, waits={"c": "its team's limits"}, jobs=("c", "d", "e")))
    assert executors.waits()["c"] == "its team's limits" and executors.waits()["d"] == waits["d"]
    executors.apply(ApplyRequest(180.0, {}, {}, True, jobs=("c", "d", "e")))
    assert executors.waits() == waits
    # `goodput nodes` on this cluster: every node alive, each with the jobs running there.
    nodes = {n.name: n for n in executors.node_statuses().nodes}
    assert {n.state for n in nodes.values()} == {"alive"} and len(nodes) == len(cluster.nodes)
    assert (nodes["dgx-ext-1"].jobs, nodes["rtx-0"].jobs, nodes["rtx-2"].jobs) == (("a",), ("x",), ())
