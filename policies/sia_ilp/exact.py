"""The exact path: the reduced ILP as one MILP (or its LP relaxation, for the priced paths' prices),
solved by HiGHS or, through cvxpy, by GLPK_MI or CBC.

- The model is one boolean vector over the entries and one sparse block (a one-configuration row
  per job with two or more entries, a capacity row per type, then any team and lending rows),
  built fresh each call. HiGHS (highspy) is handed it as the column-wise matrix cvxpy would
  compile: compiling it through cvxpy took ~3 ms, more than HiGHS took to solve most rounds
  (bench_sia_ilp p50 5.6 ms against 7.9 ms through cvxpy, 20-60 jobs x 19 configurations; a test
  checks that both give the same answers). The other solvers go through cvxpy. A DPP problem cached
  per padded (J, C) shape was slower still: cvxpy cannot parametrise variable bounds, so validity
  becomes J*C extra constraint rows that HiGHS has to carry or presolve away.
- HiGHS runs on one thread (its parallel scheduler costs ~7 ms even on a trivial MILP), with
  presolve, symmetry detection and the costly primal heuristics off: on these small models those
  stages take longer than the branch and bound they are meant to shorten.
- A solver call that proves no optimum (a time-out, an error, an infeasible or unsolved status)
  raises `SolverFailure`, whose status the round reports when the previous allocation stands.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass

import cvxpy as cp
import cvxpy.settings as cp_status
import numpy as np
import scipy.sparse as sp

from policies.sia_ilp.reduced import Reduced

log = logging.getLogger(__name__)

DEFAULT_SOLVER = "HIGHS"
SUPPORTED_SOLVERS = ("HIGHS", "GLPK_MI", "CBC")
MIP_REL_GAP = 1e-7
MIP_ABS_GAP = 1e-7
# One HiGHS thread: on these small MILPs the parallel scheduler's hand-offs cost more than they save
# (~7 ms vs < 1 ms for a trivial model). HiGHS sizes its scheduler once a process; see _highs.
HIGHS_THREADS: int | None = 1
HIGHS_OPTIONS = {
    "output_flag": False,  # no banner or log on stdout: a service's output is its own
    "presolve": "off",
    "mip_detect_symmetry": False,
    "mip_heuristic_run_feasibility_jump": False,
    "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False,
    "mip_heuristic_run_root_reduced_cost": False,
    "mip_rel_gap": MIP_REL_GAP,
    "mip_abs_gap": MIP_ABS_GAP,
}


class SolverFailure(Exception):
    """A solver call that gave no usable answer; `status` is what the IlpSolution reports."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


@functools.cache
def installed_milp_solvers() -> tuple[str, ...]:
    installed = set(cp.installed_solvers())
    return tuple(name for name in SUPPORTED_SOLVERS if name in installed)


def resolve_solver(solver: str) -> str:
    name = str(solver).upper()
    installed = ", ".join(installed_milp_solvers()) or "none"
    if name not in SUPPORTED_SOLVERS:
        raise ValueError(
            f"unknown MILP solver {solver!r}: supported {', '.join(SUPPORTED_SOLVERS)}; installed here: {installed}"
        )
    if name not in installed_milp_solvers():
        raise ValueError(f"MILP solver {name} is not installed; installed here: {installed}")
    return name


# HiGHS keeps one thread scheduler a process, sized by the first run that starts it; a later run that
# asks for another size fails. When something else started it first, drop our `threads` request.
_highs_threads_clash = False
# One solver object a thread for the MILPs, cleared between models: making one costs about a tenth
# of a small model's solve (its thread set-up), and a round solves one or more. Only for MILPs: a
# MILP's time limit counts from its own start, an LP's from the object's first run (its clock is
# never reset), so each LP gets a new object.
_milp_solvers = threading.local()


@functools.cache
def _quiet_highs() -> None:
    """HiGHS prints a banner on stdout when the first solver object of a process is made, whatever
    its options; make that first one with stdout pointed away, once."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _solver_options(solver: str, time_limit_s: float) -> dict:
    if solver == "HIGHS":
        _quiet_highs()
        options = dict(HIGHS_OPTIONS, time_limit=time_limit_s)
        if HIGHS_THREADS is not None and not _highs_threads_clash:
            options["threads"] = HIGHS_THREADS
        return options
    if solver == "GLPK_MI":
        return {"tm_lim": max(1, int(round(time_limit_s * 1000)))}  # milliseconds (cvxopt.glpk options)
    if solver == "CBC":
        return {"maximumSeconds": time_limit_s}
    return {}


@dataclass(frozen=True, eq=False)
class _Rows:
    """K v <= rhs over v = (the entries `idx`, then the teams' borrows b: none without teams): a
    one-configuration row for each job with two or more entries (a job with one entry is held by
    the variable's bound), one capacity row per GPU type, then any team rows and lending rows. The
    rows after the one-configuration rows are the ones that carry a price (`Reduced.prices`)."""

    K: sp.csc_matrix  # column-wise, as HiGHS takes it
    rhs: np.ndarray
    job_rows: int


def _constraints(m: Reduced, idx: np.ndarray) -> _Rows:
    job = m.job[idx]
    per_job = np.bincount(job, minlength=m.jobs)
    multi = per_job[job] > 1
    job_row = np.cumsum(per_job > 1) - 1
    n_job_rows = int(np.count_nonzero(per_job > 1))
    tr = m.teams
    kind, gpus = m.kind[idx], m.gpus[idx]
    # K column by column, as HiGHS takes it: each column's rows in increasing order, -1 where none.
    # An entry's: its job's one-configuration row, its type's capacity row, its team row.
    rows = np.full((idx.size, 3), -1, dtype=np.int64)
    rows[multi, 0] = job_row[job[multi]]
    counted = slice(None) if tr is None else ~tr.implied_capacity[kind]
    rows[counted, 1] = n_job_rows + kind[counted]
    values = np.stack([np.ones(idx.size), gpus, gpus], axis=1)
    rhs = [np.ones(n_job_rows), m.free]
    if tr is not None:
        first = n_job_rows + m.types  # team rows, then lending rows
        on = m.row[idx] >= 0
        rows[on, 2] = first + m.row[idx][on]
        # A borrow b_r's: -1 in its team row, +1 in its type's lending row.
        b, R = tr.b_rows, tr.rows
        lending = first + R + np.searchsorted(tr.lend_types, tr.row_type[b])
        rows = np.concatenate([rows, np.stack([first + b, lending, np.full(b.size, -1)], axis=1)])
        values = np.concatenate([values, np.stack([-np.ones(b.size), np.ones(b.size), np.zeros(b.size)], axis=1)])
        rhs += [tr.row_rhs, tr.lend[tr.lend_types]]
    present = rows >= 0
    starts = np.concatenate([[0], np.cumsum(np.count_nonzero(present, axis=1))])
    K = sp.csc_matrix((values[present], rows[present], starts), shape=(m.prices + n_job_rows, rows.shape[0]))
    return _Rows(K, np.concatenate(rhs).astype(float), n_job_rows)


@dataclass(frozen=True, eq=False)
class _Program:
    """min cost . v  subject to  K v <= rhs,  0 <= v <= upper,  v[:integers] integral: the MILP
    (`integers` = the entries) or its LP relaxation (0) over entries idx, any teams' borrows after
    the entries in v."""

    rows: _Rows
    cost: np.ndarray
    upper: np.ndarray
    integers: int


@dataclass(frozen=True, eq=False)
class _Answer:
    x: np.ndarray  # the variables' values
    value: float  # the objective's
    duals: np.ndarray | None  # the rows' prices (>= 0), an LP's only


def _program(m: Reduced, idx: np.ndarray, boolean: bool) -> _Program:
    """The MILP (`boolean`) or its LP relaxation over entries `idx`."""
    borrow = np.empty(0) if m.teams is None else m.teams.row_borrow[m.teams.b_rows]
    return _Program(
        _constraints(m, idx),
        np.concatenate([m.cost[idx], np.zeros(borrow.size)]),
        np.concatenate([np.ones(idx.size), borrow]),
        idx.size if boolean else 0,
    )


def _solve_program(program: _Program, solver: str, time_limit_s: float, rel_gap: float | None = None) -> _Answer:
    """Solve; raise SolverFailure unless the solver proves its answer optimal. HiGHS is given the
    model directly: compiling it through cvxpy took longer than HiGHS took to solve it (a test checks
    that both give the same answers). The other solvers go through cvxpy."""
    options = _solver_options(solver, max(time_limit_s, 1e-9))
    if rel_gap is not None and solver == "HIGHS":
        options["mip_rel_gap"] = rel_gap
    if solver == "HIGHS":
        return _highs(program, options)
    return _through_cvxpy(program, solver, options)


def _highs(program: _Program, options: dict) -> _Answer:
    """The model as cvxpy would hand it to HiGHS (K column-wise, rows (-inf, rhs]), solved by highspy."""
    import highspy as hp

    global _highs_threads_clash
    K = program.rows.K
    model = hp.HighsModel()
    lp = model.lp_
    lp.num_row_, lp.num_col_ = K.shape
    lp.col_cost_ = program.cost
    lp.col_lower_ = np.zeros(program.cost.size)
    lp.col_upper_ = program.upper
    lp.row_lower_ = np.full(K.shape[0], -hp.kHighsInf)
    lp.row_upper_ = program.rows.rhs
    lp.a_matrix_.format_ = hp.MatrixFormat.kColwise
    lp.a_matrix_.start_ = K.indptr
    lp.a_matrix_.index_ = K.indices
    lp.a_matrix_.value_ = K.data
    if program.integers:
        continuous = program.cost.size - program.integers
        lp.integrality_ = [hp.HighsVarType.kInteger] * program.integers + [hp.HighsVarType.kContinuous] * continuous

    def run(options: dict) -> hp.Highs:
        if program.integers:
            h = getattr(_milp_solvers, "solver", None)
            if h is None:
                h = _milp_solvers.solver = hp.Highs()
            h.clearModel()
            h.resetOptions()
        else:
            h = hp.Highs()
        h.setOptionValue("log_to_console", False)
        for name, value in options.items():
            if h.setOptionValue(name, value) == hp.HighsStatus.kError:
                raise SolverFailure(f"solver_error: HIGHS rejected its option {name}={value!r}")
        h.passModel(model)
        h.run()
        return h

    try:
        h = run(options)
        if h.getModelStatus() == hp.HighsModelStatus.kNotset and "threads" in options:
            # Most likely HiGHS's scheduler was started with another thread count: retry without.
            h = run({k: v for k, v in options.items() if k != "threads"})
            _highs_threads_clash = True
            log.info("sia ILP: HiGHS's thread scheduler was already started; running with its thread count")
        status = h.getModelStatus()
    except SolverFailure:
        raise
    except Exception as exc:
        raise SolverFailure(f"solver_error: {type(exc).__name__}: {exc}") from exc
    if status in (
        hp.HighsModelStatus.kTimeLimit,
        hp.HighsModelStatus.kIterationLimit,
        hp.HighsModelStatus.kSolutionLimit,
        hp.HighsModelStatus.kObjectiveBound,
        hp.HighsModelStatus.kObjectiveTarget,
    ):
        raise SolverFailure("timeout: HIGHS stopped at its time limit")
    if status in (
        hp.HighsModelStatus.kInfeasible,
        hp.HighsModelStatus.kUnboundedOrInfeasible,
        hp.HighsModelStatus.kUnbounded,
    ):
        raise SolverFailure(f"infeasible: HIGHS reported {status.name}")
    if status != hp.HighsModelStatus.kOptimal:
        raise SolverFailure(f"solver_error: HIGHS returned status {status.name}")
    solution = h.getSolution()
    duals = None if program.integers else -np.asarray(solution.row_dual, dtype=float)
    return _Answer(np.asarray(solution.col_value, dtype=float), float(h.getInfo().objective_function_value), duals)


def _through_cvxpy(program: _Program, solver: str, options: dict) -> _Answer:
    n = program.cost.size
    x = cp.Variable(
        n, integer=(np.arange(program.integers),) if program.integers else False, bounds=[np.zeros(n), program.upper]
    )
    constraint = program.rows.K @ x <= program.rows.rhs
    problem = cp.Problem(cp.Minimize(program.cost @ x), [constraint])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cvxpy warns on inaccurate/limited statuses; we report them
            problem.solve(solver=solver, **options)
    except Exception as exc:
        raise SolverFailure(f"solver_error: {type(exc).__name__}: {exc}") from exc
    status = problem.status
    if status == cp_status.USER_LIMIT:
        raise SolverFailure(f"timeout: {solver} stopped at its time limit")
    if status in cp_status.INF_OR_UNB:
        raise SolverFailure(f"infeasible: {solver} reported {status}")
    if status not in (cp_status.OPTIMAL, cp_status.OPTIMAL_INACCURATE):
        raise SolverFailure(f"solver_error: {solver} returned status {status}")
    if status != cp_status.OPTIMAL:
        log.info("sia ILP: %s returned %s; the answer is checked before use", solver, status)
    if x.value is None:
        raise SolverFailure(f"solver_error: {solver} reported optimal but returned no solution")
    duals = None if program.integers or constraint.dual_value is None else np.asarray(constraint.dual_value).reshape(-1)
    return _Answer(np.asarray(x.value).reshape(-1), float(problem.value), duals)


def milp(m: Reduced, idx: np.ndarray, solver: str, deadline: float, rel_gap: float | None = None) -> np.ndarray:
    """The MILP over entries `idx`; returns the chosen entries (indices into the reduced model)."""
    if idx.size == 0:
        return idx
    answer = _solve_program(_program(m, idx, boolean=True), solver, deadline - time.perf_counter(), rel_gap)
    chosen = idx[answer.x[: idx.size] > 0.5]
    if np.bincount(m.job[chosen], minlength=m.jobs).max(initial=0) > 1:
        raise SolverFailure(f"solver_error: {solver} gave a job two configurations")
    return chosen


def lp_prices(m: Reduced, idx: np.ndarray, deadline: float) -> tuple[np.ndarray, float]:
    """The duals of the priced rows and the value of the LP relaxation over entries `idx` (HiGHS)."""
    if idx.size == 0:
        return np.zeros(m.prices), 0.0
    answer = _solve_program(_program(m, idx, boolean=False), "HIGHS", deadline - time.perf_counter())
    if answer.duals is None:
        raise SolverFailure("solver_error: HIGHS returned no duals for the LP relaxation")
    return np.maximum(answer.duals[-m.prices :], 0.0), answer.value
