"""The round's ILP after the exact reductions: one entry per (job, configuration) pair left.

The reductions before the solver (each keeps the optimal objective value):
- locked jobs are constants: their GPUs leave the capacity, their variables disappear;
- entries whose term cannot improve on leaving the job unallocated (A >= lam for p < 0) are dropped;
- within one (job, GPU type), an entry that uses more GPUs than another and is not strictly better is
  dropped (swapping to the smaller one frees GPUs and loses nothing), which also breaks exact ties
  toward fewer GPUs;
- with teams, entries of more GPUs than their team could hold of the type are dropped
  (`team_guarantees.team_rows`);
- if every job's best remaining entry fits together (the teams' rows included), that is the
  optimum and no solver runs (`policies.sia_ilp.solve`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.sia_ilp.problem import IlpProblem
from policies.sia_ilp.team_guarantees import TeamRows


@dataclass(frozen=True, eq=False)
class Reduced:
    """The ILP after the exact reductions: one entry per surviving (job, configuration) pair."""

    job: np.ndarray  # (n,) job of each entry
    config: np.ndarray  # (n,) configuration of each entry
    cost: np.ndarray  # (n,) cost in minimisation form, < 0
    gpus: np.ndarray  # (n,) float GPUs
    kind: np.ndarray  # (n,) GPU type
    free: np.ndarray  # (T,) float GPUs of each type left after the pinned jobs
    jobs: int
    teams: TeamRows | None = None
    row: np.ndarray | None = None  # (n,) the team row of each entry, -1 where none (with `teams`)

    @property
    def types(self) -> int:
        return self.free.shape[0]

    @property
    def prices(self) -> int:
        """Rows with a price in the Lagrangian: the capacity rows, then any team and lending rows."""
        return self.types + (0 if self.teams is None else self.teams.rows + self.teams.lend_types.size)


def candidates(problem: IlpProblem, cost: np.ndarray, free: np.ndarray) -> np.ndarray:
    """(J, C) bool: entries worth a variable (valid, not pinned, improving, not dominated)."""
    keep = problem.valid & np.isfinite(cost) & (cost < 0)
    keep[problem.pinned] = False
    gpus, types = problem.config_gpus, problem.config_type
    for t in range(problem.types):
        cols = np.flatnonzero(types == t)
        if cols.size == 0:
            continue
        fits = gpus[cols] <= free[t]
        keep[:, cols[~fits]] = False  # cannot fit even in an otherwise empty type
        cols = cols[np.argsort(gpus[cols], kind="stable")]
        sub = np.where(keep[:, cols], cost[:, cols], np.inf)
        # best cost among strictly-earlier (fewer or equal GPUs, earlier in order) entries of this type
        before = np.minimum.accumulate(
            np.concatenate([np.full((sub.shape[0], 1), np.inf), sub[:, :-1]], axis=1), axis=1
        )
        keep[:, cols] &= sub < before
    return keep
