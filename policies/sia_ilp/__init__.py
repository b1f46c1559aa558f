"""Sia's allocation ILP over plain numpy arrays: the pure core of the `sia` and `goodput` policies.

`solve` is the entry point: one round's `problem.IlpProblem` in, its `problem.IlpSolution` out.
The model, its values and objective: problem.py; the exact reductions before any solver:
reduced.py; the teams' rows: team_guarantees.py; ties settled after the solve: ties.py.

Which path solves a round, by the entries left after the reductions (chosen here, in
`_solve_reduced` and `_large_or_huge`, and nowhere else):

    every job's best entry fits          none: those entries are the optimum, no solver runs
    <= LARGE_MODEL_ENTRIES (1,500),      exact (exact.py): one MILP over every entry, proven to
      or HiGHS not installed               MIP_REL_GAP; HiGHS given it directly, other solvers
                                           through cvxpy
    > LARGE_MODEL_ENTRIES, team rows     priced (large.py): capacity prices, reduced costs and a
                                           restricted MILP with an optimality proof, within
                                           LARGE_MIP_REL_GAP, for the whole time limit
    > LARGE_MODEL_ENTRIES, no team rows  the greedy answer (huge.py) when its bound proves it within
                                           GREEDY_ACCEPT_GAP of the optimum; else the priced path
                                           within LARGE_MODEL_BUDGET_S; past that, the greedy answer
    > HUGE_MODEL_ENTRIES (20,000),       greedy (huge.py): an allocation at sampled prices, with a
      no team rows                         bound on its distance from the optimum (`IlpSolution.gap`)

Why: on small models (20-60 jobs x 19 configurations) the MILP solves in a few milliseconds. At
1,000-3,000 jobs x 360 configurations the plain MILP spends 0.3-1.5 s in its root LP alone; the
priced path answers the same optimum in ~0.1-0.15 s. Past 20,000 entries (10,000 jobs on
sia-hetero-16384) the LP relaxation alone takes HiGHS 13 s. The priced path gets a budget without
team rows because a round at 2,048 GPUs had HiGHS's restricted MILP run past the 5 s time limit;
with team rows no greedy answer stands in for it (the greedy allocation does not hold the rows).
benchmarks/bench_sia_ilp.py and benchmarks/bench_policy.py have the figures.

On a time-out, a solver error or an infeasible/unsolved status the previous allocation (`current`)
stands, `fallback` is True, `status` says why, and the event is logged — never an empty cluster.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from policies.sia_ilp.exact import DEFAULT_SOLVER, SolverFailure, installed_milp_solvers, milp, resolve_solver
from policies.sia_ilp.huge import solve_huge
from policies.sia_ilp.large import solve_large
from policies.sia_ilp.problem import (
    DEFAULT_LAMBDA,
    DEFAULT_P,
    IlpProblem,
    IlpSolution,
    check_params,
    objective_of,
    value_matrix,
    weighted_costs,
)
from policies.sia_ilp.reduced import Reduced, candidates
from policies.sia_ilp.team_guarantees import TeamRows, team_rows
from policies.sia_ilp.ties import break_ties

log = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 5.0
# Large models (more entries than this after the reductions) go through prices and a restricted MILP.
LARGE_MODEL_ENTRIES = 1500
# Huger models (more entries than this, no team rows) take a greedy allocation with its gap bound.
HUGE_MODEL_ENTRIES = 20000
# The priced path's share of the time limit (no team rows): past it a large model takes the greedy answer.
LARGE_MODEL_BUDGET_S = 0.4
# A large model takes the greedy answer at once when its bound proves it this close (relative to its
# cost, which counts the left-out costs) to the optimum: 1e-3 let the objective reach 0.94% above
# the exact ILP's at 2,048 GPUs, 1e-4 (docs/policy.md, "Policy runtime").
GREEDY_ACCEPT_GAP = 1e-4


def solve(
    problem: IlpProblem,
    p: float = DEFAULT_P,
    lam: float = DEFAULT_LAMBDA,
    solver: str = DEFAULT_SOLVER,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> IlpSolution:
    """Solve one round's ILP; on time-out or solver failure keep `problem.current` (fallback=True).

    `time_limit_s` bounds the work after the exact reductions: the solver calls (each gets what is
    left) and, for large models, the price computation between them. The reductions before take
    ~1 ms at 60 jobs and ~25 ms at 3,000 jobs x 360 configurations. Raises ValueError for p == 0, a
    non-finite p or lam, a non-positive time limit, or an unknown or uninstalled solver.
    """
    start = time.perf_counter()
    check_params(p, lam)
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s!r}")
    solver = resolve_solver(solver)
    J, T = problem.jobs, problem.types

    choice = np.full(J, -1, dtype=np.int64)
    pinned = np.flatnonzero(problem.pinned)
    choice[pinned] = problem.current[pinned]
    free = problem.capacity.copy()
    np.subtract.at(free, problem.config_type[choice[pinned]], problem.config_gpus[choice[pinned]])
    if (free < 0).any():
        t = int(np.flatnonzero(free < 0)[0])
        return _fallback(
            problem,
            f"infeasible: locked jobs need {problem.capacity[t] - free[t]} GPUs of "
            f"type {t}, capacity {problem.capacity[t]}",
            start,
        )

    values = value_matrix(problem, p)
    cost = weighted_costs(problem, values, p, lam)
    keep = candidates(problem, cost, free)
    teams = None if problem.job_team is None else team_rows(problem, keep, choice, cost)

    # Exact shortcut: if every job's best entry fits together, that is the optimum (no solver).
    best = np.where(keep, cost, np.inf)
    pick = np.argmin(best, axis=1) if problem.configs else np.zeros(J, dtype=np.int64)
    has = keep.any(axis=1)
    use = np.bincount(problem.config_type[pick[has]], weights=problem.config_gpus[pick[has]], minlength=T)
    binding = np.zeros(T, dtype=bool)  # the types whose team rows enter the solver
    if teams is not None:
        binding = teams.broken(problem.job_team[has], problem.config_type[pick[has]], problem.config_gpus[pick[has]])
    if np.all(use <= free) and not binding.any():
        choice[has] = pick[has]
        return _solved(problem, values, cost, choice, p, lam, start)

    try:
        m, chosen, gap = _solve_reduced(problem, cost, keep, free, teams, binding, solver, time_limit_s)
    except SolverFailure as failure:
        return _fallback(problem, failure.status, start, exc_info=failure.__cause__ is not None)

    choice[m.job[chosen]] = m.config[chosen]
    on = choice >= 0
    used = np.bincount(problem.config_type[choice[on]], weights=problem.config_gpus[choice[on]], minlength=T)
    if np.any(used > problem.capacity):
        return _fallback(problem, f"solver_error: {solver}'s allocation exceeds capacity", start)
    moved = on & ~problem.pinned
    if teams is not None and not teams.holds(
        problem.job_team[moved], problem.config_type[choice[moved]], problem.config_gpus[choice[moved]]
    ):
        return _fallback(problem, f"solver_error: {solver}'s allocation breaks a team's guarantee", start)
    return _solved(problem, values, cost, choice, p, lam, start, gap)


def _solve_reduced(
    problem: IlpProblem,
    cost: np.ndarray,
    keep: np.ndarray,
    free: np.ndarray,
    teams: TeamRows | None,
    binding: np.ndarray,
    solver: str,
    time_limit_s: float,
) -> tuple[Reduced, np.ndarray, float]:
    """The reduced model over the entries in `keep`, the entries its path (module docstring) chooses
    and their gap bound; raises SolverFailure.

    The team rows enter lazily: those of the types in `binding` (where the jobs' best entries break
    them), then those of any type the answer breaks, until it keeps them all. An answer without some
    rows that keeps them is the optimum with them too (a relaxation's optimum that is feasible)."""
    J = problem.jobs
    job, config = np.nonzero(keep)
    kind = problem.config_type[config]
    gap = 0.0
    deadline = time.perf_counter() + time_limit_s
    while True:
        rows = None if teams is None else teams.of_types(binding)
        m = Reduced(
            job,
            config,
            cost[job, config],
            problem.config_gpus[config].astype(float),
            kind,
            free.astype(float),
            J,
            rows,
            None if rows is None else rows.row_of[problem.job_team[job], kind],
        )
        if job.size > HUGE_MODEL_ENTRIES and rows is None:
            chosen, gap = solve_huge(m, deadline)
        elif job.size > LARGE_MODEL_ENTRIES and "HIGHS" in installed_milp_solvers() and rows is None:
            chosen, gap = _large_or_huge(m, solver, deadline)
        elif job.size > LARGE_MODEL_ENTRIES and "HIGHS" in installed_milp_solvers():
            chosen = solve_large(m, solver, deadline)
        else:
            chosen = milp(m, np.arange(job.size), solver, deadline)
        if teams is None:
            return m, chosen, gap
        broken = teams.broken(problem.job_team[m.job[chosen]], m.kind[chosen], problem.config_gpus[m.config[chosen]])
        if not (broken & ~binding).any():
            return m, chosen, gap  # none broken, or only where the rows already are: `solve` refuses it
        binding = binding | broken


def _large_or_huge(m: Reduced, solver: str, deadline: float) -> tuple[np.ndarray, float]:
    """The huge path's answer when its bound already proves it within `GREEDY_ACCEPT_GAP` of the
    optimum; else the priced path within `LARGE_MODEL_BUDGET_S`,
    and past that the huge path's answer (a round at 2,048 GPUs had HiGHS's restricted MILP run
    past the 5 s time limit, and the previous allocation stood)."""
    greedy, gap = solve_huge(m, deadline)
    if time.perf_counter() >= deadline:
        raise SolverFailure("timeout: the time limit passed while pricing")
    if gap <= GREEDY_ACCEPT_GAP * abs(float(m.cost[greedy].sum())):
        return greedy, gap
    try:
        return solve_large(m, solver, min(deadline, time.perf_counter() + LARGE_MODEL_BUDGET_S)), 0.0
    except SolverFailure as failure:
        if not failure.status.startswith("timeout") or time.perf_counter() >= deadline:
            raise
        log.info("sia ILP: the priced path took over %.1f s; the greedy answer instead", LARGE_MODEL_BUDGET_S)
        return greedy, gap


def _solved(
    problem: IlpProblem,
    values: np.ndarray,
    cost: np.ndarray,
    choice: np.ndarray,
    p: float,
    lam: float,
    start: float,
    gap: float = 0.0,
) -> IlpSolution:
    """The optimum `choice` (or, with a `gap`, one within it), its ties settled (ties.py), with its
    objective."""
    choice = break_ties(problem, cost, choice)
    value = objective_of(problem, values, choice, p, lam)
    return IlpSolution(
        choice,
        "optimal" if gap == 0 else "greedy",
        False,
        (time.perf_counter() - start) * 1e3,
        value if np.isfinite(value) else None,
        gap,
    )


def _fallback(problem: IlpProblem, status: str, start: float, exc_info: bool = False) -> IlpSolution:
    log.warning("sia ILP: keeping the previous allocation of %d jobs (%s)", problem.jobs, status, exc_info=exc_info)
    return IlpSolution(problem.current.copy(), status, True, (time.perf_counter() - start) * 1e3)
