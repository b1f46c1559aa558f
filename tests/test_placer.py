"""Placer core: properties over random clusters, allocations and previous placements, and hand-made cases.

A random round: a random cluster (1-3 GPU types, 1-8 nodes of 1-8 GPUs, non-powers of two split
virtually), a first allocation placed from nothing, then a next allocation in which each old job
stays, changes configuration or leaves and new jobs arrive, all drawn from the configuration set
within per-type capacity. An independent brute-force search checks, on small clusters, that the
placer evicts only when no placement exists at all.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.placer.core import is_placeable, place, placement_violations
from shared.cluster import Cluster, build_cluster, load_cluster
from shared.schema.base import Config
from shared.schema.rounds import PlacementResult

SETTINGS = settings(
    max_examples=200,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TYPES = ("a100", "t4", "rtx")
POWER_OF_TWO_SIZES = (1, 2, 4, 8)
ANY_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)


# --- strategies --------------------------------------------------------------------------------


@st.composite
def clusters(draw, sizes=ANY_SIZES, max_nodes=8, max_types=3):
    types = draw(st.lists(st.sampled_from(TYPES[:max_types]), min_size=1, max_size=max_types, unique=True))
    groups = [
        {"gpu_type": t, "count": draw(st.integers(1, max_nodes)), "gpus_per_node": draw(st.sampled_from(sizes))}
        for t in types
    ]
    return build_cluster("random", groups)


def draw_jobs(draw, cluster: Cluster, prefix: str, left: dict[str, int], max_jobs: int = 10) -> dict[str, Config]:
    """Random configurations that fit what is `left` of each type; sometimes filled up to full load."""
    configs = cluster.configurations()
    jobs: dict[str, Config] = {}
    for config in draw(st.lists(st.sampled_from(configs), max_size=max_jobs)):
        if config.gpus <= left[config.gpu_type]:
            left[config.gpu_type] -= config.gpus
            jobs[f"{prefix}{len(jobs)}"] = config
    # full load is where fragmentation bites: small jobs leave holes that large ones cannot use
    fill = draw(st.sampled_from(["no", "random", "smallest", "largest"]))
    pick = {
        "random": lambda fitting: draw(st.sampled_from(fitting)),
        "smallest": lambda fitting: min(fitting, key=lambda c: c.gpus),
        "largest": lambda fitting: max(fitting, key=lambda c: c.gpus),
    }.get(fill)
    while pick and (fitting := [c for c in configs if c.gpus <= left[c.gpu_type]]):
        config = pick(fitting)
        left[config.gpu_type] -= config.gpus
        jobs[f"{prefix}{len(jobs)}"] = config
    return jobs


def capacities(cluster: Cluster) -> dict[str, int]:
    return {t: cluster.capacity(t) for t in cluster.gpu_types}


@st.composite
def rounds(draw, sizes=ANY_SIZES):
    """(cluster, previous placements, old allocation, next allocation)."""
    cluster = draw(clusters(sizes))
    old = draw_jobs(draw, cluster, "old", capacities(cluster))
    previous = place(cluster, old, {}).placements
    left = capacities(cluster)
    fate = {job: draw(st.sampled_from(["stay", "stay", "change", "leave"])) for job in old}
    current = {job: config for job, config in old.items() if fate[job] == "stay"}
    for config in current.values():
        left[config.gpu_type] -= config.gpus
    for job in (j for j in old if fate[j] == "change"):
        fitting = [c for c in cluster.configurations() if c.gpus <= left[c.gpu_type]]
        if fitting:
            current[job] = draw(st.sampled_from(fitting))
            left[current[job].gpu_type] -= current[job].gpus
    current.update(draw_jobs(draw, cluster, "new", left))
    return cluster, previous, old, current


@st.composite
def garbage_previous(draw, cluster: Cluster, jobs: list[str]):
    """Previous placements that may name missing nodes, overlap, overfill or mismatch the shape."""
    names = [n.name for n in cluster.nodes] + ["gone-0"]
    spots = st.lists(
        st.tuples(st.sampled_from(names), st.integers(1, 8)), min_size=1, max_size=3, unique_by=lambda spot: spot[0]
    )
    return {job: tuple(sorted(draw(spots))) for job in jobs if draw(st.booleans())}


# --- helpers -----------------------------------------------------------------------------------


def changed(previous, placements) -> list[str]:
    return sorted(job for job, spots in placements.items() if job in previous and previous[job] != spots)


def assert_sound(cluster: Cluster, allocations, previous, result: PlacementResult) -> None:
    """The properties every result must have, whatever the input."""
    assert placement_violations(cluster, allocations, result.placements) == []
    assert set(result.placements) | set(result.evicted) == set(allocations)
    assert not set(result.placements) & set(result.evicted)
    assert list(result.restarts) == changed(previous, result.placements)
    assert bool(result.evicted) == (not is_placeable(cluster, allocations.values()))
    for gpu_type in cluster.gpu_types:
        placed = sum(g for spots in result.placements.values() for name, g in spots if name.startswith(f"{gpu_type}-"))
        assert placed <= cluster.capacity(gpu_type)


def brute_force_placeable(cluster: Cluster, configs: list[Config]) -> bool:
    """Exhaustive search, type by type; nodes of equal (size, free) are interchangeable."""
    for gpu_type in cluster.gpu_types:
        size = cluster.gpus_per_node(gpu_type)
        jobs = tuple(c for c in configs if c.gpu_type == gpu_type)
        start = tuple(sorted((n.gpus, n.gpus) for n in cluster.nodes if n.gpu_type == gpu_type))

        @lru_cache(maxsize=None)
        def search(i: int, nodes: tuple[tuple[int, int], ...]) -> bool:
            if i == len(jobs):
                return True
            job = jobs[i]
            if job.nodes >= 2 or job.gpus == size:  # whole empty nodes of full size
                empty = [k for k, (s, f) in enumerate(nodes) if s == f == size]
                if len(empty) < job.nodes:
                    return False
                rest = list(nodes)
                for k in empty[: job.nodes]:
                    rest[k] = (size, 0)
                return search(i + 1, tuple(sorted(rest)))
            for k in sorted({k for k, (s, f) in enumerate(nodes) if f >= job.gpus}, key=lambda k: nodes[k]):
                rest = list(nodes)
                rest[k] = (nodes[k][0], nodes[k][1] - job.gpus)
                if search(i + 1, tuple(sorted(rest))):
                    return True
            return False

        if not search(0, start):
            return False
    return True


# --- properties --------------------------------------------------------------------------------


@SETTINGS
@given(rounds())
def test_random_rounds_are_valid_and_keep_unchanged_jobs(round_):
    cluster, previous, old, current = round_
    result = place(cluster, current, previous)
    assert_sound(cluster, current, previous, result)
    moved = {job for job, spots in result.placements.items() if previous.get(job) != spots}
    for job in current:
        if job in previous and current[job] == old[job] and job in moved:
            # a stayer moves only to make room: a job that moved (or is new) now sits on one of its nodes
            its_nodes = {name for name, _ in previous[job]}
            assert any(
                other in moved and other != job and its_nodes & {name for name, _ in spots}
                for other, spots in result.placements.items()
            )


@SETTINGS
@given(rounds(sizes=POWER_OF_TWO_SIZES))
def test_nothing_evicted_when_node_sizes_are_uniform(round_):
    # Sia's buddy argument: power-of-two configurations, one node size per type, capacity respected
    cluster, previous, _, current = round_
    result = place(cluster, current, previous)
    assert is_placeable(cluster, current.values())
    assert result.evicted == ()
    assert_sound(cluster, current, previous, result)


@SETTINGS
@given(st.data())
def test_any_previous_placement_is_survived(data):
    cluster = data.draw(clusters())
    current = draw_jobs(data.draw, cluster, "j", capacities(cluster))
    previous = data.draw(garbage_previous(cluster, list(current) + ["left-0"]))
    assert_sound(cluster, current, previous, place(cluster, current, previous))


@SETTINGS
@given(rounds())
def test_jobs_leaving_or_staying_never_restart_anyone(round_):
    cluster, previous, old, current = round_
    stayed = {job: old[job] for job in current if job in previous and current[job] == old[job]}
    result = place(cluster, stayed, previous)
    assert result.restarts == () and result.evicted == ()
    assert result.placements == {job: previous[job] for job in stayed}


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_is_placeable_agrees_with_exhaustive_search(data):
    cluster = data.draw(clusters(max_nodes=3, max_types=2))
    configs = list(draw_jobs(data.draw, cluster, "j", capacities(cluster), max_jobs=8).values())
    assert is_placeable(cluster, configs) == brute_force_placeable(cluster, configs)


# --- hand-made cases ---------------------------------------------------------------------------


def test_one_eviction_makes_room_on_a_fragmented_cluster():
    cluster = build_cluster("frag", [{"gpu_type": "t4", "count": 2, "gpus_per_node": 4}])
    previous = {"a": (("t4-0", 2),), "b": (("t4-1", 1),), "c": (("t4-1", 1),)}
    allocations = {"a": Config("t4", 1, 2), "b": Config("t4", 1, 1), "c": Config("t4", 1, 1), "d": Config("t4", 1, 4)}
    result = place(cluster, allocations, previous)
    # emptying t4-0 displaces one job, t4-1 two: a moves next to b and c
    assert result.placements == {"a": (("t4-1", 2),), "b": (("t4-1", 1),), "c": (("t4-1", 1),), "d": (("t4-0", 4),)}
    assert result.restarts == ("a",) and result.evicted == ()


def test_the_smallest_of_equally_few_is_displaced():
    cluster = build_cluster("frag", [{"gpu_type": "rtx", "count": 2, "gpus_per_node": 8}])
    previous = {"big": (("rtx-0", 4),), "small": (("rtx-1", 2),)}
    allocations = {"big": Config("rtx", 1, 4), "small": Config("rtx", 1, 2), "whole": Config("rtx", 1, 8)}
    result = place(cluster, allocations, previous)
    assert result.placements == {"big": (("rtx-0", 4),), "small": (("rtx-0", 2),), "whole": (("rtx-1", 8),)}
    assert result.restarts == ("small",)


def test_distributed_jobs_take_whole_nodes_from_the_top_and_displace_fewest():
    cluster = build_cluster("dist", [{"gpu_type": "a100", "count": 4, "gpus_per_node": 8}])
    previous = {"x": (("a100-0", 1),), "y": (("a100-3", 2),), "z": (("a100-3", 2),)}
    allocations = {
        "x": Config("a100", 1, 1),
        "y": Config("a100", 1, 2),
        "z": Config("a100", 1, 2),
        "dist": Config("a100", 3, 24),
    }
    result = place(cluster, allocations, previous)
    # free nodes first (a100-2, a100-1), then the node whose stayers are fewest (a100-0: x)
    assert result.placements["dist"] == (("a100-0", 8), ("a100-1", 8), ("a100-2", 8))
    assert result.placements["x"] == (("a100-3", 1),)
    assert result.restarts == ("x",)


def test_resize_is_a_restart_and_a_new_job_is_not():
    cluster = build_cluster("small", [{"gpu_type": "t4", "count": 2, "gpus_per_node": 4}])
    previous = {"grows": (("t4-0", 2),), "stays": (("t4-1", 2),), "leaves": (("t4-0", 2),)}
    allocations = {"grows": Config("t4", 1, 4), "stays": Config("t4", 1, 2), "fresh": Config("t4", 1, 2)}
    result = place(cluster, allocations, previous)
    assert result.placements["stays"] == (("t4-1", 2),)
    assert result.placements["grows"] == (("t4-0", 4),)
    assert result.restarts == ("grows",)
    assert "fresh" not in result.restarts and result.evicted == ()


def test_a_placement_that_went_stale_is_a_restart():
    cluster = build_cluster("shrunk", [{"gpu_type": "t4", "count": 2, "gpus_per_node": 4}])
    previous = {"a": (("t4-7", 2),), "b": (("t4-0", 1), ("t4-1", 1))}  # node gone; a 2-GPU job straddling
    allocations = {"a": Config("t4", 1, 2), "b": Config("t4", 1, 2)}
    result = place(cluster, allocations, previous)
    assert result.restarts == ("a", "b")
    assert placement_violations(cluster, allocations, result.placements) == []


def test_sia_hetero_64_full_load_then_a_next_round():
    cluster = load_cluster("sia-hetero-64")
    sizes = {
        "aws": [(2, 8), (1, 4), (1, 4), (1, 2), (1, 2), (1, 1), (1, 1), (1, 1), (1, 1)],
        "dgx-ext": [(2, 16)],
        "rtx": [(1, 8), (1, 4), (1, 4), (1, 2), (1, 2), (1, 1), (1, 1), (1, 1), (1, 1)],
    }
    allocations = {f"{t}-job{i}": Config(t, n, g) for t, shapes in sizes.items() for i, (n, g) in enumerate(shapes)}
    assert sum(c.gpus for c in allocations.values()) == cluster.total_gpus == 64
    first = place(cluster, allocations, {})
    assert first.evicted == () and first.restarts == ()
    assert placement_violations(cluster, allocations, first.placements) == []
    assert sum(g for spots in first.placements.values() for _, g in spots) == 64

    # next round: the distributed aws job shrinks to one node, two small rtx jobs merge into a new 2-GPU one
    nxt = dict(allocations)
    nxt["aws-job0"] = Config("aws", 1, 4)
    del nxt["rtx-job5"], nxt["rtx-job6"]
    nxt["rtx-new"] = Config("rtx", 1, 2)
    second = place(cluster, nxt, first.placements)
    assert second.evicted == ()
    assert placement_violations(cluster, nxt, second.placements) == []
    assert "aws-job0" in second.restarts
    assert all(
        second.placements[j] == first.placements[j]
        for j in nxt
        if j in allocations and nxt[j] == allocations[j] and j not in second.restarts
    )
    assert set(second.restarts) <= {"aws-job0"} | {j for j in nxt if j.startswith("rtx")}


def test_split_nodes_can_make_capacity_insufficient():
    # two 6-GPU nodes are 4 + 2 each: three 4-GPU jobs fit the capacity (12) but not the nodes
    cluster = build_cluster("six", [{"gpu_type": "v100", "count": 2, "gpus_per_node": 6}])
    allocations = {"a": Config("v100", 1, 4), "b": Config("v100", 1, 4), "c": Config("v100", 1, 4)}
    assert not is_placeable(cluster, allocations.values())
    result = place(cluster, allocations, {})
    assert len(result.evicted) == 1 and len(result.placements) == 2
    assert placement_violations(cluster, allocations, result.placements) == []


def test_a_large_cluster_places_quickly():
    cluster = build_cluster("scale", [{"gpu_type": "t4", "count": 256, "gpus_per_node": 8}])
    shapes = (
        [Config("t4", 4, 32)] * 16
        + [Config("t4", 1, 8)] * 32
        + [Config("t4", 1, 4)] * 128
        + [Config("t4", 1, 2)] * 128
        + [Config("t4", 1, 1)] * 256
    )
    allocations = {f"j{i}": c for i, c in enumerate(shapes)}
    first = place(cluster, allocations, {})
    again = place(cluster, allocations, first.placements)
    assert first.evicted == () and again.restarts == () and again.placements == first.placements


@pytest.mark.parametrize(
    "config, message",
    [
        (Config("h100", 1, 1), "GPU type 'h100' is not in cluster"),
        (Config("t4", 1, 3), "is not in the configuration set"),
        (Config("t4", 2, 4), "is not in the configuration set"),
        (Config("t4", 3, 12), "is not in the configuration set"),
    ],
)
def test_invalid_allocations_are_refused_with_the_job_named(config, message):
    cluster = build_cluster("small", [{"gpu_type": "t4", "count": 2, "gpus_per_node": 4}])
    with pytest.raises(ValueError, match=message) as error:
        place(cluster, {"job-x": config}, {})
    assert "job-x" in str(error.value)


def test_over_capacity_is_refused_with_the_jobs_named():
    cluster = build_cluster("small", [{"gpu_type": "t4", "count": 2, "gpus_per_node": 4}])
    with pytest.raises(ValueError, match="'p', 'q' ask for 12 GPUs, the cluster has 8"):
        place(cluster, {"p": Config("t4", 2, 8), "q": Config("t4", 1, 4)}, {})


def test_the_checker_sees_every_broken_rule():
    cluster = build_cluster(
        "check",
        [{"gpu_type": "t4", "count": 3, "gpus_per_node": 4}, {"gpu_type": "rtx", "count": 1, "gpus_per_node": 8}],
    )
    allocations = {
        "straddle": Config("t4", 1, 2),
        "dist": Config("t4", 2, 8),
        "wrong": Config("rtx", 1, 1),
        "short": Config("t4", 1, 1),
    }
    placements = {
        "straddle": (("t4-0", 1), ("t4-1", 1)),
        "dist": (("t4-1", 4), ("t4-2", 4)),
        "wrong": (("t4-0", 1),),
        "short": (("t4-0", 2),),
        "ghost": (("t4-0", 1),),
    }
    problems = " | ".join(placement_violations(cluster, allocations, placements))
    for expected in [
        "'straddle': on 2 nodes",
        "node 't4-1': 5 GPUs given out",
        "distributed job 'dist' shares it with 'straddle'",
        "'wrong': node 't4-0' is t4",
        "'short': 2 GPUs placed",
        "'ghost': placed but not allocated",
    ]:
        assert expected in problems
