"""The teams' guarantees as rows of the round's ILP (not Sia's; `IlpProblem.job_team`, `team_quota`,
`team_borrow`, `job_weight`; docs/policy.md, "Teams").

Team k's jobs hold u_kt GPUs of type t. Reserved for it, r_kt: what its jobs would take alone on its
quota (its pinned jobs' GPUs, then each other job, the higher weight first, its best entry that fits
in what is left of the quota, a running job's on the type it runs on: `_reserve`). The rest,
lend_t = capacity_t - sum_k r_kt, is lent. With a borrow b_kt (continuous), the rows

                 u_kt - b_kt <= r_kt,   0 <= b_kt <= quota_kt - r_kt + borrow_kt,
                 sum_k b_kt <= lend_t   for every team k and type t.

    The guarantee: team k finds r_kt GPUs of t that no other team can hold, whatever the solver
    does: sum_{j != k} u_jt <= sum_{j != k} (r_jt + b_jt) <= sum_{j != k} r_jt + lend_t
    = capacity_t - r_kt. And no team holds more than quota_kt + borrow_kt (its borrowing limit).
    What no team's jobs want is lent; when an owner's job wants its GPUs back, r_kt grows and lend_t
    shrinks in that very round, and the solver shrinks or stops borrowers, the cheapest moves first
    (the restart factors price every move). Reserving per type the most any job could take there
    would hold a job's GPUs on every type it can run on, while it runs on one. A pinned job's GPUs
    beyond its team's reservation stay lent until its restart ends (lend_t and its b's bound are at
    least what they hold), so the problem stays feasible.

The team rows enter only for the types where some allocation of the entries could break them, and
lazily (`policies.sia_ilp.solve`): a round where they do not bind solves the problem without them.
A row alone in its type, or one that may not borrow, needs no b (its bound joins its right-hand
side); a capacity row that a type's team rows imply is left out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from policies.sia_ilp.problem import IlpProblem


@dataclass(frozen=True, eq=False)
class TeamRows:
    """The teams' guarantees for one solve (module docstring): per team k and type t, the
    GPUs its jobs hold, less a borrow b_kt in [0, borrow_kt], stay within its reservation r_kt; the
    borrows of a type stay within what it lends. Rows are kept only for the (team, type) pairs of the
    types where some could bind; on the others any allocation of the entries satisfies them."""

    reserved: np.ndarray  # (K, T) r_kt: GPUs reserved for each team (float)
    held: np.ndarray  # (K, T) GPUs the pinned jobs hold
    borrow: np.ndarray  # (K, T) float, most a team may hold beyond its reservation (finite)
    lend: np.ndarray  # (T,) float, GPUs of a type lent in all
    unreserved: np.ndarray  # (T,) capacity_t - sum_k r_kt (lend_t, unless pinned jobs hold more)
    row_team: np.ndarray  # (R,) team of each kept row
    row_type: np.ndarray  # (R,) type of each kept row
    row_of: np.ndarray  # (K, T) kept row of a (team, type), -1 where none

    @property
    def rows(self) -> int:
        return self.row_team.size

    @functools.cached_property
    def row_borrow(self) -> np.ndarray:
        return self.borrow[self.row_team, self.row_type]

    @functools.cached_property
    def b_rows(self) -> np.ndarray:
        """The rows with a borrow variable: those that may borrow, of a type with two or more such.
        A row alone in its type folds its borrow into its right-hand side (b <= borrow <= lend), as
        does one that may not borrow."""
        may = self.row_borrow > 0
        sharing = np.bincount(self.row_type[may], minlength=self.lend.size)[self.row_type] > 1
        return np.flatnonzero(may & sharing)

    @functools.cached_property
    def lend_types(self) -> np.ndarray:
        """(S,) the types with a lending row: those of the borrow variables."""
        return np.unique(self.row_type[self.b_rows])

    @functools.cached_property
    def row_rhs(self) -> np.ndarray:
        """(R,) each team row's right-hand side over the movable jobs' GPUs."""
        rhs = (self.reserved - self.held)[self.row_team, self.row_type] + self.row_borrow
        rhs[self.b_rows] -= self.row_borrow[self.b_rows]
        return rhs

    @functools.cached_property
    def implied_capacity(self) -> np.ndarray:
        """(T,) bool: the types whose capacity row the team rows imply (left out of the solver's rows:
        every team holds at most its reservation, its borrow and the lent GPUs add up to at most what
        was left unreserved)."""
        T = self.lend.size
        folded = np.setdiff1d(np.arange(self.rows), self.b_rows)
        beyond = np.bincount(self.row_type[folded], weights=self.row_borrow[folded], minlength=T).astype(float)
        beyond[self.lend_types] += self.lend[self.lend_types]
        with_rows = np.bincount(self.row_type, minlength=T) > 0
        return with_rows & (beyond <= self.unreserved)

    def broken(self, team: np.ndarray, kind: np.ndarray, gpus: np.ndarray) -> np.ndarray:
        """(T,) bool: the types on which an allocation (each allocated job's team, GPU type and
        GPUs, the pinned jobs left out: they are in `held`) breaks a guarantee."""
        use = self.held.copy()
        np.add.at(use, (team, kind), gpus)
        beyond = use - self.reserved
        return np.any(beyond > self.borrow, axis=0) | (np.maximum(beyond, 0).sum(axis=0) > self.lend)

    def holds(self, team: np.ndarray, kind: np.ndarray, gpus: np.ndarray) -> bool:
        return not self.broken(team, kind, gpus).any()

    def of_types(self, types: np.ndarray) -> TeamRows | None:
        """These rows restricted to the types in the bool mask `types` (None: no row left)."""
        kept = types[self.row_type]
        if not kept.any():
            return None
        row_of = np.full(self.row_of.shape, -1, dtype=np.int64)
        row_of[self.row_team[kept], self.row_type[kept]] = np.arange(int(kept.sum()))
        return TeamRows(
            self.reserved,
            self.held,
            self.borrow,
            self.lend,
            self.unreserved,
            self.row_team[kept],
            self.row_type[kept],
            row_of,
        )


def team_rows(problem: IlpProblem, keep: np.ndarray, choice: np.ndarray, cost: np.ndarray) -> TeamRows | None:
    """The teams' rows for this solve (module docstring), or None when no allocation of the
    entries in `keep` could break them. Drops from `keep` the entries larger than their team could
    ever hold of the type (exact: no feasible allocation has them). `choice` holds the pinned jobs."""
    quota, team, types, gpus = problem.team_quota, problem.job_team, problem.config_type, problem.config_gpus
    K, T = quota.shape
    pinned = np.flatnonzero(problem.pinned)
    held = np.zeros((K, T))
    np.add.at(held, (team[pinned], types[choice[pinned]]), gpus[choice[pinned]])
    reserved = _reserve(problem, keep, cost, np.minimum(held, quota))
    # A pinned job's GPUs beyond its team's reservation stay where they are this round: lent,
    # whatever else wants them, so the problem stays feasible.
    pinned_beyond = np.maximum(held - reserved, 0.0)
    unreserved = problem.capacity - reserved.sum(axis=0)
    lend = np.maximum(unreserved, pinned_beyond.sum(axis=0))
    borrow = np.minimum(np.maximum(quota - reserved + problem.team_borrow, pinned_beyond), lend[None, :])
    keep &= gpus[None, :] <= (reserved - held + borrow)[team][:, types]
    per_job = np.stack(
        [np.max(np.where(keep[:, types == t], gpus[types == t], 0), axis=1, initial=0) for t in range(T)], axis=1
    )
    most = held.copy()  # the most each team's jobs could hold of each type
    np.add.at(most, team, per_job)
    need = most - reserved
    binding = np.any(need > borrow, axis=0) | (np.maximum(need, 0.0).sum(axis=0) > lend)
    rows = (need > 0) & binding[None, :]
    if not rows.any():
        return None
    row_team, row_type = np.nonzero(rows)
    row_of = np.full((K, T), -1, dtype=np.int64)
    row_of[row_team, row_type] = np.arange(row_team.size)
    return TeamRows(reserved, held, borrow, lend, unreserved, row_team, row_type, row_of)


def _reserve(problem: IlpProblem, keep: np.ndarray, cost: np.ndarray, reserved: np.ndarray) -> np.ndarray:
    """(K, T) GPUs of each type reserved for each team: what its jobs would take alone on its quota.
    From `reserved` (what its pinned jobs hold, up to its quota), each of its other jobs in turn (the
    higher weight first, then the running ones, then the longest waiting) takes its best entry that
    fits in what is left of the team's quota, a running job on the type it runs on (reserving it
    another type too would hold GPUs back from lending that the team's own answer leaves idle);
    a job with none takes nothing."""
    quota, team, types, gpus = problem.team_quota, problem.job_team, problem.config_type, problem.config_gpus
    left = quota - reserved
    open_teams = int(np.count_nonzero(left.any(axis=1)))
    if open_teams == 0:
        return reserved
    waited = problem.waited if problem.waited is not None else np.zeros(problem.jobs)
    movable = np.flatnonzero(keep.any(axis=1) & (quota.sum(axis=1) > 0)[team])
    order = movable[np.lexsort((-waited[movable], problem.current[movable] < 0, -problem.weight[movable]))]
    for i in order:
        room = left[team[i]]
        if not room.any():
            continue
        cells = np.flatnonzero(keep[i])
        cells = cells[gpus[cells] <= room[types[cells]]]
        if problem.current[i] >= 0:
            cells = cells[types[cells] == types[problem.current[i]]]
        if cells.size:
            j = cells[np.argmin(cost[i, cells])]
            room[types[j]] -= gpus[j]
            if not room.any():
                open_teams -= 1
                if open_teams == 0:
                    break  # every quota is reserved: the other jobs take nothing
    return quota - left
