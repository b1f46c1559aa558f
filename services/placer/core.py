"""The placer's core: the policy's allocations -> physical GPUs, keeping jobs where they are.

Rules (Sia's placer, DESIGN §4):
- a partial-node allocation (1 node, fewer GPUs than the type's node size R) sits on one node;
- a whole-node allocation (n >= 2 nodes, or all R GPUs of one node) takes whole nodes of size R;
- no two distributed (multi-node) jobs share a node — automatic with whole nodes, and checked;
- a job whose configuration is unchanged and whose previous placement is still valid stays put;
- otherwise a job moves, and only when a new job cannot fit around the ones that stay are stayers
  displaced: as few as possible, the smallest first. They move, which counts as a restart;
- a hybrid-parallel job's model-parallel group (`groups`: its GPUs) never spans two nodes: its
  allocation must give every node whole groups, and so must its placement.

Why one pass, largest first, is enough. Node sizes are powers of two (build_cluster splits a
6-GPU node into 4 + 2) and so is every job's per-node share s (1, 2, 4 .. R; sorting by total GPUs
sorts by share within a type). When the first job of share s comes, every node of size >= s holds
only jobs of share >= s, so its free GPUs are a whole number of s-blocks, and smaller nodes are
still empty. Which node a job takes therefore never changes how many s-blocks are left for the
rest: the pass leaves a job out only when no placement of all the jobs exists, and it may choose
freely among fitting nodes — keeping a job in place, best fit, sparing jobs that want to stay.
(This is the guarantee Sia gets from its configuration set, "submesh shape covering".) The same
argument gives the exact test for "some placement exists" (`is_placeable`): for every s, the jobs
of share >= s fit into the GPUs of nodes of size >= s. Per-type capacity alone is enough when all
nodes of a type have one size; with mixed sizes it is not (two 6-GPU nodes, split 4 + 2, cannot
take three 4-GPU jobs), and the jobs that do not fit end in `evicted`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

from shared.cluster import Cluster, replica_count
from shared.schema.base import Config, Node, Spots
from shared.schema.rounds import PlacementResult

Allocation = dict[str, Config]  # job id -> configuration chosen by the policy
Placement = dict[str, Spots]  # job id -> where its GPUs are


def place(
    cluster: Cluster,
    allocations: Mapping[str, Config],
    previous: Mapping[str, Spots],
    groups: Mapping[str, int] | None = None,
) -> PlacementResult:
    """Physical GPUs for every allocated job; `previous` is the last round's placements (any, even
    stale); `groups` the GPUs of one model-parallel group of each hybrid-parallel job."""
    groups = groups or {}
    validate_allocations(cluster, allocations, groups)
    stayers = _stay_candidates(cluster, allocations, previous)
    board = _Board(cluster, stayers)
    placements: Placement = {}
    evicted: list[str] = []
    for job in _placement_order(allocations, stayers):
        spots = _place_one(board, job, allocations[job], stayers.get(job))
        if spots is None:
            evicted.append(job)
        else:
            placements[job] = spots
    _check(cluster, allocations, placements, groups)
    ordered = {job: placements[job] for job in allocations if job in placements}
    restarts = sorted(job for job, spots in ordered.items() if previous.get(job) and spots != _canonical(previous[job]))
    return PlacementResult(ordered, tuple(restarts), tuple(sorted(evicted)))


def validate_allocations(
    cluster: Cluster, allocations: Mapping[str, Config], groups: Mapping[str, int] | None = None
) -> None:
    """ValueError, naming the job, for anything the policy could not have meant."""
    names = [n.name for n in cluster.nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"cluster {cluster.name!r} has duplicate node names; placements would be ambiguous")
    configurations = cluster.configurations()
    known = set(configurations)
    for job, config in allocations.items():
        if not isinstance(config, Config):
            raise ValueError(f"job {job!r}: allocation {config!r} is not a Config")
        if config.gpu_type not in cluster.gpu_types:
            raise ValueError(
                f"job {job!r}: GPU type {config.gpu_type!r} is not in cluster {cluster.name!r} "
                f"(types: {', '.join(cluster.gpu_types)})"
            )
        if config not in known:
            valid = ", ".join(str(c) for c in configurations if c.gpu_type == config.gpu_type)
            raise ValueError(
                f"job {job!r}: {config} ({config.nodes} nodes, {config.gpus} GPUs) is not in "
                f"the configuration set of cluster {cluster.name!r}; valid: {valid}"
            )
        group = (groups or {}).get(job, 1)
        if not replica_count([config.gpus // config.nodes] * config.nodes, group):
            raise ValueError(
                f"job {job!r}: {config} would split its model-parallel groups of {group} GPUs across nodes"
            )
    for gpu_type, jobs in _jobs_by_type(allocations).items():
        asked = sum(allocations[job].gpus for job in jobs)
        if asked > cluster.capacity(gpu_type):
            raise ValueError(
                f"GPU type {gpu_type!r}: jobs {', '.join(map(repr, jobs))} ask for {asked} GPUs, "
                f"the cluster has {cluster.capacity(gpu_type)}"
            )


def is_placeable(cluster: Cluster, configs: Iterable[Config]) -> bool:
    """Whether all `configs` fit the empty cluster at once (exact; see the module docstring).

    The policy can add the same inequalities to its program when a type has nodes of mixed sizes.
    """
    configs = list(configs)
    for gpu_type in cluster.gpu_types:
        of_type = [c for c in configs if c.gpu_type == gpu_type]
        share = 1
        while share <= cluster.gpus_per_node(gpu_type):
            demand = sum(c.gpus for c in of_type if c.gpus // c.nodes >= share)
            supply = sum(n.gpus for n in cluster.nodes if n.gpu_type == gpu_type and n.gpus >= share)
            if demand > supply:
                return False
            share *= 2
    return True


def placement_violations(
    cluster: Cluster,
    allocations: Mapping[str, Config],
    placements: Mapping[str, Spots],
    groups: Mapping[str, int] | None = None,
) -> list[str]:
    """Every broken rule, as readable lines; empty for a valid placement."""
    nodes = {n.name: n for n in cluster.nodes}
    problems: list[str] = []
    used: dict[str, int] = defaultdict(int)
    jobs_on: dict[str, list[str]] = defaultdict(list)
    for job, spots in placements.items():
        config = allocations.get(job)
        if config is None:
            problems.append(f"job {job!r}: placed but not allocated")
            continue
        problems += [f"job {job!r}: {p}" for p in _shape_problems(cluster, nodes, config, spots)]
        group = (groups or {}).get(job, 1)
        if not replica_count((gpus for _, gpus in spots), group):
            problems.append(f"job {job!r}: {spots} splits its model-parallel groups of {group} GPUs")
        for name, gpus in spots:
            used[name] += gpus
            jobs_on[name].append(job)
    for name, jobs in jobs_on.items():
        if name in nodes and used[name] > nodes[name].gpus:
            problems.append(f"node {name!r}: {used[name]} GPUs given out, it has {nodes[name].gpus}")
        distributed = [j for j in jobs if j in allocations and allocations[j].nodes >= 2]
        if distributed and len(jobs) > 1:
            problems.append(
                f"node {name!r}: distributed job {distributed[0]!r} shares it with "
                f"{', '.join(repr(j) for j in jobs if j != distributed[0])}"
            )
    return problems


# --- the pass ----------------------------------------------------------------------------------


def _placement_order(allocations: Mapping[str, Config], stayers: Mapping[str, Spots]) -> list[str]:
    """Largest first (what makes the pass complete); among equals, stayers first so they keep their spot."""
    return sorted(allocations, key=lambda job: (-allocations[job].gpus, job not in stayers, job))


def _place_one(board: _Board, job: str, config: Config, stay_at: Spots | None) -> Spots | None:
    if stay_at is not None:
        board.unreserve(job)  # its own reservation must not stand in its way
        if board.fits(stay_at):
            board.occupy(stay_at)
            return stay_at
    choice = _whole_nodes(board, config) if config.nodes >= 2 else _best_fit(board, config)
    if choice is None:
        return None
    spots, displaced = choice
    for other in displaced:
        board.unreserve(other)
    board.occupy(spots)
    return spots


def _best_fit(board: _Board, config: Config) -> tuple[Spots, tuple[str, ...]] | None:
    """One node: fewest stayers displaced, then fewest of their GPUs, then least free left (fragmentation)."""
    options = []
    for node in board.nodes_of(config.gpu_type):
        free = board.free[node.name]
        if free < config.gpus:
            continue
        waiting = board.reserved_on(node.name)
        slack = free - sum(waiting.values())
        displaced = _fewest_to_displace(waiting, config.gpus - slack)
        freed = sum(waiting[j] for j in displaced)
        key = (len(displaced), freed, slack + freed - config.gpus, board.index[node.name])
        options.append((key, node.name, displaced))
    if not options:
        return None
    _, name, displaced = min(options, key=lambda option: option[0])
    return ((name, config.gpus),), displaced


def _whole_nodes(board: _Board, config: Config) -> tuple[Spots, tuple[str, ...]] | None:
    """n empty nodes of full size: those displacing fewest stayers, from the highest node down (as Sia),
    which leaves the low nodes to single-node jobs packed best fit."""
    size = board.node_size[config.gpu_type]
    empty = [node for node in board.nodes_of(config.gpu_type) if node.gpus == size and board.free[node.name] == size]
    if len(empty) < config.nodes:
        return None

    def cost(node: Node) -> tuple[int, int, int]:
        waiting = board.reserved_on(node.name)
        return len(waiting), sum(waiting.values()), -board.index[node.name]

    chosen = sorted(empty, key=cost)[: config.nodes]
    displaced = tuple(dict.fromkeys(job for node in chosen for job in board.reserved_on(node.name)))
    return _canonical((node.name, size) for node in chosen), displaced


def _fewest_to_displace(waiting: Mapping[str, int], need: int) -> tuple[str, ...]:
    """The fewest stayers whose GPUs add up to `need`, preferring small ones among equally few."""
    if need <= 0:
        return ()
    largest_first = sorted(waiting.values(), reverse=True)
    count = next(k for k in range(1, len(largest_first) + 1) if sum(largest_first[:k]) >= need)
    remaining = sorted(waiting.items(), key=lambda item: (item[1], item[0]))
    chosen: list[str] = []
    for slots_left in range(count, 0, -1):
        for i, (job, gpus) in enumerate(remaining):  # the smallest job that still lets the rest reach `need`
            others = remaining[:i] + remaining[i + 1 :]
            best_rest = sum(sorted((g for _, g in others), reverse=True)[: slots_left - 1])
            if gpus + best_rest >= need:
                chosen.append(job)
                need -= gpus
                remaining = others
                break
    return tuple(chosen)


class _Board:
    """Free GPUs per node, and the GPUs that stayers not yet placed hope to keep (reservations)."""

    def __init__(self, cluster: Cluster, stayers: Mapping[str, Spots]):
        self._by_type = {t: [n for n in cluster.nodes if n.gpu_type == t] for t in cluster.gpu_types}
        self.node_size = {t: cluster.gpus_per_node(t) for t in cluster.gpu_types}
        self.index = {n.name: i for i, n in enumerate(cluster.nodes)}
        self.free = {n.name: n.gpus for n in cluster.nodes}
        self._reservations = dict(stayers)
        self._reserved: dict[str, dict[str, int]] = defaultdict(dict)
        for job, spots in stayers.items():
            for name, gpus in spots:
                self._reserved[name][job] = gpus

    def nodes_of(self, gpu_type: str) -> list[Node]:
        return self._by_type[gpu_type]

    def reserved_on(self, name: str) -> dict[str, int]:
        return self._reserved.get(name, {})

    def unreserve(self, job: str) -> None:
        for name, _ in self._reservations.pop(job, ()):
            self._reserved[name].pop(job, None)

    def fits(self, spots: Spots) -> bool:
        return all(self.free[name] >= gpus for name, gpus in spots)

    def occupy(self, spots: Spots) -> None:
        for name, gpus in spots:
            self.free[name] -= gpus


# --- helpers -----------------------------------------------------------------------------------


def _stay_candidates(
    cluster: Cluster, allocations: Mapping[str, Config], previous: Mapping[str, Spots]
) -> dict[str, Spots]:
    """Jobs whose previous spots are a valid placement of their (unchanged) configuration today."""
    nodes = {n.name: n for n in cluster.nodes}
    stayers = {}
    for job, config in allocations.items():
        if job in previous:
            spots = _canonical(previous[job])
            if not _shape_problems(cluster, nodes, config, spots):
                stayers[job] = spots
    return stayers


def _shape_problems(cluster: Cluster, nodes: Mapping[str, Node], config: Config, spots: Spots) -> list[str]:
    """What is wrong with `spots` as a placement of `config` on its own (sharing is checked elsewhere)."""
    if config.gpu_type not in cluster.gpu_types:
        return [f"GPU type {config.gpu_type!r} is not in the cluster"]
    names = [name for name, _ in spots]
    if names != sorted(set(names)):
        return [f"nodes {names} are not distinct and sorted by name"]
    problems = []
    for name, gpus in spots:
        node = nodes.get(name)
        if node is None:
            problems.append(f"node {name!r} is not in the cluster")
        elif node.gpu_type != config.gpu_type:
            problems.append(f"node {name!r} is {node.gpu_type}, the allocation is {config.gpu_type}")
        elif not 0 < gpus <= node.gpus:
            problems.append(f"{gpus} GPUs on node {name!r} of {node.gpus}")
    if problems:
        return problems
    if len(spots) != config.nodes:
        problems.append(f"on {len(spots)} nodes, the allocation {config} wants {config.nodes}")
    if sum(gpus for _, gpus in spots) != config.gpus:
        problems.append(f"{sum(g for _, g in spots)} GPUs placed, the allocation {config} wants {config.gpus}")
    size = cluster.gpus_per_node(config.gpu_type)
    if config.nodes >= 2 or config.gpus == size:
        problems += [
            f"whole-node allocation {config} takes {gpus} GPUs of node {name!r} ({nodes[name].gpus})"
            for name, gpus in spots
            if not gpus == nodes[name].gpus == size
        ]
    return problems


def _canonical(spots: Iterable[tuple[str, int]]) -> Spots:
    return tuple(sorted((str(name), int(gpus)) for name, gpus in spots))


def _jobs_by_type(allocations: Mapping[str, Config]) -> dict[str, list[str]]:
    by_type: dict[str, list[str]] = defaultdict(list)
    for job, config in allocations.items():
        by_type[config.gpu_type].append(job)
    return by_type


def _check(
    cluster: Cluster, allocations: Mapping[str, Config], placements: Placement, groups: Mapping[str, int]
) -> None:
    """The rules as an invariant: a broken one is a bug here, never something to hand to executors."""
    problems = placement_violations(cluster, allocations, placements, groups)
    if problems:
        raise RuntimeError("placer produced an invalid placement: " + "; ".join(problems))
