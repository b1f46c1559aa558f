"""Why a job that is not running waits, from its request and the cluster as it is: pure functions,
shared by the executors.

A job's GPUs are one of Sia's configurations (shared/cluster.py): per type with R GPUs a node,
1, 2, 4 .. R GPUs on one node, or n x R GPUs on n whole nodes. So a job of 2 GPUs waits for two
free GPUs on one node, or (where nodes have one GPU) for two wholly free nodes; and a rigid job of
3 GPUs never runs on nodes of 4 (see docs/real-jobs.md).

- `unschedulable` says why a job cannot run on the nodes as they are, however the others move
  (its types have no schedulable node; no configuration of its types has its GPU count), or None.
- `beyond_team` says why a job cannot run while its team's limits stay as they are (no
  configuration that takes it fits within what its team may hold of a type), or None.
- `team_full` says why a job that its team's limits let run waits now: the team's other jobs hold
  so much of what it may hold of each type that no configuration taking it fits in the rest.
- `wait_reason` says why a job that can run is not running now: GPUs that fit it are free (the
  round gave them to others, or has not run since), the cluster's GPUs of its types are all held
  (by jobs, or by profiling runs), or no free block is large enough; and how many queued jobs came
  before it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from shared.cluster import Cluster, real_node
from shared.hardware import hardware_name
from shared.schema.base import Config, Node, Spots


@dataclass(frozen=True)
class Needs:
    """What a job asks of its GPUs: `gpus` of one type (exactly, when `exact`: a rigid job; else at
    least: an adaptive job's minimum), of one of `gpu_types` (empty: any)."""

    gpus: int
    exact: bool = False
    gpu_types: tuple[str, ...] = ()

    def takes(self, config: Config) -> bool:
        allowed = not self.gpu_types or config.gpu_type in self.gpu_types
        return allowed and (config.gpus == self.gpus if self.exact else config.gpus >= self.gpus)

    def phrase(self) -> str:
        return f"{'' if self.exact else 'at least '}{self.gpus} GPU{'s' * (self.gpus != 1)} of one type"


def needs_of(requested_gpus: int, min_gpus: int, rigid: bool, gpu_types: Iterable[str] = ()) -> Needs:
    """A submission's needs: a rigid job's requested GPUs exactly; an adaptive one's minimum."""
    return Needs(requested_gpus if rigid else min_gpus, rigid, tuple(gpu_types))


def _types(needs: Needs, nodes: Iterable[Node]) -> list[str]:
    return list(dict.fromkeys(n.gpu_type for n in nodes if not needs.gpu_types or n.gpu_type in needs.gpu_types))


def _named(types: Iterable[str]) -> str:
    return ", ".join(types)


def unschedulable(needs: Needs, nodes: Collection[Node], drained: Collection[Node] = ()) -> str | None:
    """Why a job cannot run on `nodes` (the schedulable ones: live, not drained) whatever the other
    jobs do, or None when some configuration of them takes it. `drained`: the live nodes drained,
    named when they are what it lacks."""
    types = _types(needs, nodes)
    drained_types = _types(needs, drained)
    if not types:
        if drained_types and not needs.gpu_types:
            return f"every live node is drained ({_machines(drained)})"
        if drained_types:
            return f"its GPU types ({_named(drained_types)}) are all drained"
        if needs.gpu_types:
            return f"no live node has its GPU types ({_named(needs.gpu_types)})"
        return "no node is live"
    configs = Cluster("live", tuple(nodes)).configurations()
    if any(needs.takes(c) for c in configs):
        return None
    offered = sorted({c.gpus for c in configs if c.gpu_type in types})
    reason = (
        f"needs {needs.phrase()}; the schedulable nodes of its types ({_named(types)}) give a job "
        f"{_counts(offered)} (one node: 1, 2, 4 .. its GPUs; more: whole nodes)"
    )
    if drained and any(needs.takes(c) for c in Cluster("all", (*nodes, *drained)).configurations()):
        reason += f"; it would fit without the drains of {_machines(drained)}"
    return reason


def beyond_team(needs: Needs, configs: Iterable[Config], team: str, most: Mapping[str, int]) -> str | None:
    """Why a job of `team` cannot run however the others move, `most` the GPUs of each type it may
    use that the team may hold at most (`Teams.most`): the configurations that take it all pass
    those; None when one fits within them, or when none takes it at all (`unschedulable`'s case)."""
    taking = [c for c in configs if c.gpu_type in most and needs.takes(c)]
    if not taking or any(c.gpus <= most[c.gpu_type] for c in taking):
        return None
    types = list(dict.fromkeys(c.gpu_type for c in taking))
    some = [f"{most[t]} {hardware_name(t)}" for t in types if most[t]]
    none = [hardware_name(t) for t in types if not most[t]]
    holds = " and ".join(
        [*([f"at most {_counts(some)} GPUs"] if some else []), *([f"no {_counts(none)} GPUs"] if none else [])]
    )
    given = f"{_counts([hardware_name(t) for t in types])} give{'s' * (len(types) == 1)} that"
    return (
        f"needs {needs.phrase()} ({given}); team {team} may hold {holds} (its quota and borrow limit in "
        f"the team file): it waits until the team file lets it hold more"
    )


def team_full(
    needs: Needs,
    configs: Iterable[Config],
    team: str,
    most: Mapping[str, int],
    holds: Mapping[str, int],
    capacity: Mapping[str, int],
) -> str | None:
    """Why a job of `team` that `beyond_team` passes waits now: on every type it may use the team
    file holds the team below the cluster (`most` under `capacity`), and the GPUs its jobs hold this
    round (`holds`) leave less than any configuration that takes it. None when one fits in what is
    left, or when a type it may use is limited by the cluster alone (there the cluster's fullness,
    `wait_reason`, says why it waits)."""
    taking = [c for c in configs if c.gpu_type in most and needs.takes(c)]
    types = list(dict.fromkeys(c.gpu_type for c in taking))
    if not taking or any(most[t] >= capacity[t] for t in types):
        return None
    if any(c.gpus <= most[c.gpu_type] - holds.get(c.gpu_type, 0) for c in taking):
        return None
    held = [f"{holds.get(t, 0)} of the {most[t]} {hardware_name(t)} GPUs" for t in types]
    return (
        f"needs {needs.phrase()}; team {team}'s jobs hold {' and '.join(held)} it may hold (its quota and "
        f"borrow limit in the team file): it waits until they free some, or the team file lets it hold more"
    )


def _machines(nodes: Iterable[Node]) -> str:
    """The machines of (possibly virtual) nodes, by name."""
    return _named(sorted({real_node(n.name) for n in nodes}))


def _counts(counts: list) -> str:
    words = [str(c) for c in counts]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def free_gpus(nodes: Iterable[Node], held: Mapping[str, Spots], profiling: Iterable[str] = ()) -> dict[str, int]:
    """Each node's GPUs that no placement in `held` (job -> its spots) takes, nor a profiling run (a
    node's name once per run, each taking one GPU). Never below 0: a job leaving a node and one
    taking it may both be reported there for a moment."""
    free = {n.name: n.gpus for n in nodes}
    for node, gpus in (*(spot for spots in held.values() for spot in spots), *((name, 1) for name in profiling)):
        if node in free:
            free[node] = max(free[node] - gpus, 0)
    return free


def _fits_now(config: Config, nodes: list[Node], free: Mapping[str, int], size: int) -> bool:
    if config.nodes == 1:
        return any(free[n.name] >= config.gpus for n in nodes)
    return sum(n.gpus == size and free[n.name] == size for n in nodes) >= config.nodes


def wait_reason(
    needs: Needs, nodes: Collection[Node], held: Mapping[str, Spots], ahead: int = 0, profiling: Collection[str] = ()
) -> str:
    """Why a job that `unschedulable` passes is not running: what of `nodes` is free around the jobs
    in `held` (job -> its placement on `nodes`) and the profiling runs (`profiling`: their nodes),
    against the smallest configuration of each of its types that takes it; `ahead`: the queued jobs
    submitted before it."""
    return free_reason(needs, nodes, held, profiling) + behind(ahead)


def behind(ahead: int) -> str:
    """A wait reason's end: the queued jobs submitted before it, if any."""
    return f"; {ahead} queued job{'s' * (ahead != 1)} submitted before it" if ahead else ""


def unplaced_reason(ahead: int) -> str:
    """Why a queued job waits where what is free is not known (no round has served the nodes yet)."""
    return "waiting for GPUs: the last round gave it none" + behind(ahead)


def free_reason(
    needs: Needs, nodes: Collection[Node], held: Mapping[str, Spots], profiling: Collection[str] = ()
) -> str:
    """`wait_reason` without the jobs ahead: the same for every job of the same needs in a round."""
    cluster = Cluster("live", tuple(nodes))
    free = free_gpus(nodes, held, profiling)
    types = _types(needs, nodes)
    typed = {t: [n for n in nodes if n.gpu_type == t] for t in types}
    free_of_types = sum(free[n.name] for t in types for n in typed[t])
    smallest = {}
    for config in cluster.configurations():
        if config.gpu_type in types and needs.takes(config) and config.gpu_type not in smallest:
            smallest[config.gpu_type] = config  # configurations come smallest first, type by type
    if any(_fits_now(c, typed[t], free, cluster.gpus_per_node(t)) for t, c in smallest.items()):
        return f"waiting for the next round: {free_of_types} GPUs of its types are free and fit it"
    if not free_of_types:
        jobs = sum(any(cluster.node_type.get(n) in types for n, _ in spots) for spots in held.values())
        runs = sum(cluster.node_type.get(n) in types for n in profiling)
        who = [
            f"{count} {what}{'s' * (count != 1)}" for count, what in ((jobs, "job"), (runs, "profiling run")) if count
        ]
        gpus = sum(cluster.capacity(t) for t in types)
        return (
            f"the cluster is full: {' and '.join(who)} hold{'s' * (jobs + runs == 1)} "
            f"its types' {gpus} GPU{'s' * (gpus != 1)}"
        )
    short = []
    for t, config in smallest.items():
        if config.nodes == 1:
            block = max(free[n.name] for n in typed[t])
            short.append(f"{config.gpus} {t} GPUs on one node, and the largest free block is {block}")
        else:
            size = cluster.gpus_per_node(t)
            whole = sum(n.gpus == size and free[n.name] == size for n in typed[t])
            short.append(
                f"{config.gpus} {t} GPUs on {config.nodes} whole nodes, and {whole} "
                f"{'is' if whole == 1 else 'are'} wholly free"
            )
    return "needs " + "; or ".join(short)
