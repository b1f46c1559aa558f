"""Sia's allocation ILP over plain numpy arrays: the pure core of the `sia` policy.

The model (Sia, SOSP '23, §3.3, as coded in the public artifact; DESIGN §4):

    A_ij = (r_ij * G_ij) ** p          value of configuration j for job i
    r_ij = restart_factor_i            for every j except the job's current one,
           1                           for j == current_i (keeping it costs no restart)

    p < 0:  minimise  sum_ij X_ij * A_ij + sum_i lam_i * (1 - sum_j X_ij)
    p > 0:  maximise  sum_ij X_ij * A_ij - sum_i lam_i * (1 - sum_j X_ij)

    lam_i = lam, or for a job marked `must_run` (not Sia's: the `goodput` policy's)
            MUST_RUN_FACTOR * (max_ij A_ij + lam), more than moving any one job can cost

    With a `shrink_floor` c > 0 (not Sia's: the `goodput` policy's), a running job's cell of lower
    goodput than its current one (a shrink) is priced G^p - max(G^p, c) * (1 - r^p) instead:
    Sia's (r G)^p is G^p - G^p * (1 - r^p), so its price of a move shrinks with G^p and a job of
    large normalised goodput is moved for next to nothing; with the floor, no shrink costs less
    than it would a job of normalised goodput c^(1/p).

    subject to   X binary;  sum_j X_ij <= 1 (at most one configuration a job);
                 sum_{i, j: type(j) = t} X_ij * gpus_j <= capacity_t for every GPU type t;
                 X_ij = 0 where configuration j is not valid for job i;
                 X_{i, current_i} = 1 for a job that is locked (mid checkpoint-restart).

With p = -0.5 and lam = 1.1 a job's own term favours running it (A <= 1 < 1.1 on its current
configuration and on any configuration when r = 1), but lam does not guarantee that every job runs
under contention: a job left out frees GPUs whose value to another job can exceed the 0.1 margin.

Of two waiting jobs whose entries are worth the same, the one that waited longer starts (`waited`;
of two that waited as long, the one listed first; not Sia's): the solver picks among equals
arbitrarily, and a burst of equal jobs on a full cluster then ran newest first. For the same
reason a running job keeps its configuration rather than give it to a waiting job whose entry there
is worth no more (not Sia's): the objective does not see the restart that stopping it costs, and
equal rigid jobs took turns, each round a checkpoint-restart.

Teams (not Sia's; `job_team`, `team_quota`, `team_borrow`, `job_weight`; docs/policy.md, "Teams"):
team k's jobs hold u_kt GPUs of type t. Reserved for it, r_kt: what its jobs would take alone on its
quota (its pinned jobs' GPUs, then each other job, the higher weight first, its best entry that fits
in what is left of the quota, a running job's on the type it runs on: `_reserve`). The rest, lend_t = capacity_t - sum_k r_kt, is lent. With
a borrow b_kt (continuous), the rows

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

Each job's whole term (value and leave-out cost) is multiplied by its weight w_i: its team's weight
(which shares what is lent) times PRIORITY_STEP ** (the rank of its priority among its team's:
policies/teams.py). The team rows enter only for the types where some allocation of the entries
could break them, and lazily (`solve`): a round where they do not bind solves the problem without
them. A row alone in its type, or one that may not borrow, needs no b (its bound joins its
right-hand side); a capacity row that a type's team rows imply is left out.

Numerics, and where this departs from the artifact:
- The artifact rounds A to 2 decimals and clips it at 3000. For p = -0.5, A lies in (0, 1] for
  un-discounted entries, so 2 decimals keep one or two significant digits: a step of 0.01 at
  A ~ 0.14 (G ~ 50) is a 15% goodput step. 48 and 52 GPUs of a linearly scaling job both give 0.14,
  56 and 60 both 0.13, so the solver cannot tell them apart (and may hand out GPUs that buy nothing),
  and restart trade-offs (r * G) are decided on the same coarse grid. Here A is clipped at `VALUE_CLIP` and
  rounded to `VALUE_SIGNIFICANT_DIGITS` significant digits: a relative resolution of 1e-6 to 1e-5
  whatever the scale of A (and for any p), so goodput differences of a few 1e-5 still count, while
  float noise from upstream is snapped so that equal inputs give exactly equal coefficients. The
  MIP gap (`MIP_REL_GAP`, `MIP_ABS_GAP`) is set to match; HiGHS's default 1e-4 would not be.
- A restart factor of 0 gives A = inf for p < 0 (the artifact then clips it to 3000). It is
  floored at `RESTART_FACTOR_FLOOR` = 1e-3 instead, so moving such a job costs (1e-3 G) ** p =
  31.6 / sqrt(G) at p = -0.5, more than keeping it (<= 1) or leaving it out (1.1) unless its
  goodput elsewhere is ~1,000x: the same decisions, with finite, solver-friendly coefficients.
- Invalid entries carry no variable at all (no big-M or 1e-4 "zero alloc gain" constants), so they
  are 0 by construction, even in a solution accepted within the MIP gap.

Exact reductions before the solver (each keeps the optimal objective value):
- locked jobs are constants: their GPUs leave the capacity, their variables disappear;
- entries whose term cannot improve on leaving the job unallocated (A >= lam for p < 0) are dropped;
- within one (job, GPU type), an entry that uses more GPUs than another and is not strictly better is
  dropped (swapping to the smaller one frees GPUs and loses nothing), which also breaks exact ties
  toward fewer GPUs;
- with teams, entries of more GPUs than their team could hold of the type are dropped;
- if every job's best remaining entry fits together (the teams' rows included), that is the
  optimum and no solver runs.

Speed (benchmarks/bench_sia_ilp.py has the figures):
- Up to `LARGE_MODEL_ENTRIES` surviving entries the MILP goes to the solver directly: one boolean
  vector over the entries and one sparse block (a one-configuration row per job with two or more
  entries, a capacity row per type), built fresh each call and handed to HiGHS (highspy) as the
  column-wise matrix cvxpy would compile: compiling it through cvxpy took ~3 ms, more than HiGHS
  took to solve most rounds (bench_sia_ilp p50 5.6 ms against 7.9 ms through cvxpy, 20-60 jobs x
  19 configurations). The other solvers go through cvxpy. A DPP problem cached per padded (J, C)
  shape was slower still: cvxpy cannot parametrise variable bounds, so validity becomes J*C extra
  constraint rows that HiGHS has to carry or presolve away.
- HiGHS runs on one thread (its parallel scheduler costs ~7 ms even on a trivial MILP), with
  presolve, symmetry detection and the costly primal heuristics off: on these small models those
  stages take longer than the branch and bound they are meant to shorten.
- Larger models go through capacity prices, reduced costs and a restricted MILP with an optimality
  proof (see the block comment before `_lagrangian`): at 1,000-3,000 jobs x 360 configurations the
  plain MILP spends 0.3-1.5 s in its root LP alone; the priced path answers the same optimum in
  ~0.1-0.15 s. Its MILPs stop within `LARGE_MIP_REL_GAP`; without teams they get `LARGE_MODEL_BUDGET_S`.
- Huge models (over `HUGE_MODEL_ENTRIES`, no teams; 10,000 jobs on sia-hetero-16384), and large
  ones past that budget, take a greedy allocation at sampled prices with a bound on its distance
  from the optimum (`IlpSolution.gap`; see the block comment before `_greedy_fill`).

On a time-out, a solver error or an infeasible/unsolved status the previous allocation (`current`)
stands, `fallback` is True, `status` says why, and the event is logged — never an empty cluster.
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

log = logging.getLogger(__name__)

# Settings, in one place.
DEFAULT_P = -0.5
DEFAULT_LAMBDA = 1.1
DEFAULT_SOLVER = "HIGHS"
DEFAULT_TIME_LIMIT_S = 5.0
RESTART_FACTOR_FLOOR = 1e-3
# Leaving out a `must_run` job costs this many times more than any one entry's value: it runs when
# moving one other job makes room for it, even one that the restart factor all but pins.
MUST_RUN_FACTOR = 2.0
VALUE_CLIP = 3000.0
VALUE_SIGNIFICANT_DIGITS = 6
MIP_REL_GAP = 1e-7
MIP_ABS_GAP = 1e-7
SUPPORTED_SOLVERS = ("HIGHS", "GLPK_MI", "CBC")
# Large models (more entries than this after the reductions) go through prices and a restricted MILP.
LARGE_MODEL_ENTRIES = 1500
ASCENT_CYCLES = 6  # coordinate-ascent sweeps over the GPU types' prices
ASCENT_STEPS = 24  # bisection steps a coordinate
LP_ROUNDS = 4  # column-generation rounds of the LP relaxation
RESTRICT_DELTA = 0.02  # restricted MILP: entries with reduced cost <= this x the median |cost|
# Huger models (more entries than this, no team rows) take a greedy allocation with its gap bound.
HUGE_MODEL_ENTRIES = 20000
GREEDY_PASSES = 32  # each job moves at most once a pass
PRICE_SAMPLE_JOBS = 400  # jobs whose LP relaxation prices a huge model
# The priced path's share of the time limit (no teams): past it a large model takes the huge path.
LARGE_MODEL_BUDGET_S = 0.4
# A large model takes the greedy answer at once when its bound proves it this close (relative to its
# cost, which counts the left-out costs) to the optimum: 1e-3 let the objective reach 0.94% above
# the exact ILP's at 2,048 GPUs, 1e-4 (docs/policy.md, "Policy runtime").
GREEDY_ACCEPT_GAP = 1e-4
# The large path's MILPs stop within this relative gap (of the cost, whose size is about the sum of
# the left-out costs): at 2,048 GPUs the proof to 1e-7 took HiGHS up to 1.9 s a round, to 1e-3 at
# most 0.5 s, the objective then at most 7e-4 above the optimum (docs/policy.md, "Policy runtime").
LARGE_MIP_REL_GAP = 1e-3

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


@dataclass(frozen=True, eq=False)
class IlpProblem:
    """One round's ILP. Arrays are validated and normalised (dtype, shape) on construction.

    goodput: (J, C) float, row-normalised goodput G_ij (>= 1 where valid; finite and > 0 required
        where valid; anything, NaN included, elsewhere).
    valid: (J, C) bool, configuration j allowed for job i.
    current: (J,) int, index of the job's current configuration, -1 if none.
    restart_factor: (J,) float in [0, 1], multiplies every column except `current`.
    locked: (J,) bool, job is mid-restart and must keep `current` (ignored when current == -1).
    config_type: (C,) int, GPU-type index in [0, T) of each configuration.
    config_gpus: (C,) int >= 1, GPUs used by each configuration.
    capacity: (T,) int >= 0, GPUs of each type.
    must_run: (J,) bool or None (none), jobs to allocate whenever moving one other job makes room:
        leaving one out costs more than any entry's value, not lam.
    shrink_floor: c >= 0, the least G^p a shrink's restart is priced at (0: Sia's price).
    waited: (J,) float or None, seconds each job not running has waited: of two waiting jobs whose
        entries are worth the same, the one that waited longer starts (the solver's choice between
        equals is arbitrary; a queue of equal jobs should be first come, first served).
    job_team, team_quota, team_borrow (all three or none): the teams' guarantees (module docstring,
        "Teams"). job_team: (J,) int, the team in [0, K) of each job; team_quota: (K, T) int >= 0,
        GPUs of each type guaranteed to each team; team_borrow: (K, T) float >= 0, how many more it
        may borrow (inf: any idle).
    job_weight: (J,) float > 0 or None (all 1): multiplies each job's whole term, value and
        leave-out cost alike (its team's weight times its priority's).
    """

    goodput: np.ndarray
    valid: np.ndarray
    current: np.ndarray
    restart_factor: np.ndarray
    locked: np.ndarray
    config_type: np.ndarray
    config_gpus: np.ndarray
    capacity: np.ndarray
    must_run: np.ndarray | None = None
    shrink_floor: float = 0.0
    waited: np.ndarray | None = None
    job_team: np.ndarray | None = None
    team_quota: np.ndarray | None = None
    team_borrow: np.ndarray | None = None
    job_weight: np.ndarray | None = None

    def __post_init__(self) -> None:
        goodput = np.asarray(self.goodput, dtype=float)
        if goodput.ndim != 2:
            raise ValueError(f"goodput must be a (jobs, configurations) matrix, got shape {goodput.shape}")
        J, C = goodput.shape
        valid = _bool_array("valid", self.valid, (J, C))
        current = _int_array("current", self.current, (J,))
        restart = np.asarray(self.restart_factor, dtype=float)
        if restart.shape != (J,):
            raise ValueError(f"restart_factor has shape {restart.shape}, expected ({J},) (one per job)")
        locked = _bool_array("locked", self.locked, (J,))
        must_run = np.zeros(J, dtype=bool) if self.must_run is None else _bool_array("must_run", self.must_run, (J,))
        config_type = _int_array("config_type", self.config_type, (C,))
        config_gpus = _int_array("config_gpus", self.config_gpus, (C,))
        capacity = _int_array("capacity", self.capacity, None)
        if capacity.ndim != 1:
            raise ValueError(f"capacity must be a vector (one entry a GPU type), got shape {capacity.shape}")
        T = capacity.shape[0]

        bad = valid & ~(np.isfinite(goodput) & (goodput > 0))
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise ValueError(
                f"goodput[{i}, {j}] = {float(goodput[i, j])!r} in a valid cell: valid goodput must be finite "
                f"and > 0 ({int(bad.sum())} such cells)"
            )
        if ((current < -1) | (current >= C)).any():
            i = int(np.flatnonzero((current < -1) | (current >= C))[0])
            raise ValueError(f"current[{i}] = {current[i]} is out of range: use -1 or a configuration in [0, {C})")
        if not (np.all(restart >= 0) and np.all(restart <= 1)):  # also catches NaN
            i = int(np.flatnonzero(~((restart >= 0) & (restart <= 1)))[0])
            raise ValueError(f"restart_factor[{i}] = {float(restart[i])!r} is not in [0, 1]")
        waited = None if self.waited is None else np.asarray(self.waited, dtype=float)
        if waited is not None and (waited.shape != (J,) or not np.isfinite(waited).all()):
            raise ValueError(f"waited must be ({J},) finite seconds, one per job, got {self.waited!r}")
        shrink_floor = float(self.shrink_floor)
        if not (np.isfinite(shrink_floor) and shrink_floor >= 0):
            raise ValueError(f"shrink_floor = {self.shrink_floor!r} must be finite and >= 0")
        if (capacity < 0).any():
            t = int(np.flatnonzero(capacity < 0)[0])
            raise ValueError(f"capacity[{t}] = {capacity[t]} is negative")
        if ((config_type < 0) | (config_type >= T)).any():
            j = int(np.flatnonzero((config_type < 0) | (config_type >= T))[0])
            raise ValueError(f"config_type[{j}] = {config_type[j]} is not a GPU type index in [0, {T})")
        if (config_gpus < 1).any():
            j = int(np.flatnonzero(config_gpus < 1)[0])
            raise ValueError(f"config_gpus[{j}] = {config_gpus[j]}: a configuration uses at least one GPU")

        job_team, team_quota, team_borrow = _team_arrays(self.job_team, self.team_quota, self.team_borrow, J, T)
        job_weight = None if self.job_weight is None else np.asarray(self.job_weight, dtype=float)
        if job_weight is not None and (
            job_weight.shape != (J,) or not (np.isfinite(job_weight) & (job_weight > 0)).all()
        ):
            raise ValueError(f"job_weight must be ({J},) finite weights > 0, one per job, got {self.job_weight!r}")

        for name, value in (
            ("job_team", job_team),
            ("team_quota", team_quota),
            ("team_borrow", team_borrow),
            ("job_weight", job_weight),
            ("goodput", goodput),
            ("valid", valid),
            ("current", current),
            ("restart_factor", restart),
            ("locked", locked),
            ("config_type", config_type),
            ("config_gpus", config_gpus),
            ("capacity", capacity),
            ("must_run", must_run),
            ("shrink_floor", shrink_floor),
            ("waited", waited),
        ):
            object.__setattr__(self, name, value)

    @property
    def jobs(self) -> int:
        return self.goodput.shape[0]

    @property
    def configs(self) -> int:
        return self.goodput.shape[1]

    @property
    def types(self) -> int:
        return self.capacity.shape[0]

    @property
    def pinned(self) -> np.ndarray:
        """(J,) bool: jobs that must keep their current configuration (locked and running)."""
        return self.locked & (self.current >= 0)

    @property
    def weight(self) -> np.ndarray:
        """(J,) each job's weight (1 without `job_weight`)."""
        return np.ones(self.jobs) if self.job_weight is None else self.job_weight


@dataclass(frozen=True, eq=False)
class IlpSolution:
    choice: np.ndarray  # (J,) int configuration index per job, -1 = unallocated
    status: str  # "optimal", or why the previous allocation stands
    fallback: bool  # True when the previous allocation was kept
    solve_ms: float
    objective: float | None = None  # Sia's objective of `choice` (`objective`); None when kept or not finite
    # How far above the optimum the objective may be (minimisation form): 0 when solved exactly,
    # U - L(mu) for a huge model's greedy allocation (`_solve_huge`); None when kept.
    gap: float | None = None


def _bool_array(name: str, value, shape) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype != bool:
        raise ValueError(f"{name} must be a bool array, got dtype {arr.dtype}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape}")
    return arr


def _int_array(name: str, value, shape) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape}")
    return arr


def _team_arrays(job_team, team_quota, team_borrow, J: int, T: int):
    """The three team arrays checked and normalised, or three Nones."""
    given = [a is not None for a in (job_team, team_quota, team_borrow)]
    if not any(given):
        return None, None, None
    if not all(given):
        raise ValueError("job_team, team_quota and team_borrow come together: give all three or none")
    team_quota = _int_array("team_quota", team_quota, None)
    if team_quota.ndim != 2 or team_quota.shape[1] != T:
        raise ValueError(f"team_quota must be (teams, {T}) GPUs per team and type, got shape {team_quota.shape}")
    K = team_quota.shape[0]
    job_team = _int_array("job_team", job_team, (J,))
    if ((job_team < 0) | (job_team >= K)).any():
        i = int(np.flatnonzero((job_team < 0) | (job_team >= K))[0])
        raise ValueError(f"job_team[{i}] = {job_team[i]} is not a team index in [0, {K})")
    if (team_quota < 0).any():
        raise ValueError("team_quota holds a negative guarantee")
    team_borrow = np.asarray(team_borrow, dtype=float)
    if team_borrow.shape != (K, T) or not (team_borrow >= 0).all():  # NaN fails too
        raise ValueError(f"team_borrow must be ({K}, {T}) GPUs >= 0 (inf: any), got {team_borrow!r}")
    return job_team, team_quota, team_borrow


def _check_params(p: float, lam: float) -> None:
    if not np.isfinite(p):
        raise ValueError(f"fairness exponent p must be finite, got {p!r}")
    if p == 0:
        raise ValueError(
            "fairness exponent p = 0 is undefined in Sia's objective (G ** 0 = 1 for every "
            "entry): use p < 0 (minimise, the paper's -0.5) or p > 0 (maximise)"
        )
    if not np.isfinite(lam):
        raise ValueError(f"lam must be finite, got {lam!r}")


def round_significant(a: np.ndarray, digits: int = VALUE_SIGNIFICANT_DIGITS) -> np.ndarray:
    """Round positive finite values to `digits` significant digits (zeros and non-finite pass through)."""
    a = np.asarray(a, dtype=float)
    out = a.copy()
    ok = np.isfinite(a) & (a > 0)
    if ok.any():
        x = a[ok]
        scale = 10.0 ** (digits - 1 - np.floor(np.log10(x)))
        out[ok] = np.round(x * scale) / scale
    return out


def value_matrix(problem: IlpProblem, p: float = DEFAULT_P) -> np.ndarray:
    """(J, C) values A_ij the solver uses: (r_ij G_ij) ** p (with a `shrink_floor`, a shrink's price
    floored), clipped and rounded; NaN where unusable.

    Usable cells are the valid ones plus a pinned job's current cell when its goodput is finite > 0.
    """
    _check_params(p, DEFAULT_LAMBDA)
    G = problem.goodput
    J, C = G.shape
    usable = problem.valid.copy()
    pinned = np.flatnonzero(problem.pinned)
    if pinned.size:
        cur = problem.current[pinned]
        g = G[pinned, cur]
        usable[pinned, cur] = np.isfinite(g) & (g > 0)
    r = np.repeat(np.maximum(problem.restart_factor, RESTART_FACTOR_FLOOR)[:, None], C, axis=1)
    running = np.flatnonzero(problem.current >= 0)
    r[running, problem.current[running]] = 1.0
    Gu = np.where(usable, G, 1.0)
    with np.errstate(all="ignore"):
        A = np.power(r * Gu, p)
        if problem.shrink_floor > 0 and running.size:
            base = np.power(Gu[running], p)
            floored = base - np.maximum(base, problem.shrink_floor) * (1.0 - np.power(r[running], p))
            shrink = Gu[running] < G[running, problem.current[running]][:, None]
            A[running] = np.where(shrink, floored, A[running])
    A = round_significant(np.minimum(A, VALUE_CLIP))
    return np.where(usable, A, np.nan)


def objective(problem: IlpProblem, choice: np.ndarray, p: float = DEFAULT_P, lam: float = DEFAULT_LAMBDA) -> float:
    """Sia's objective of an allocation (minimised for p < 0, maximised for p > 0), with the ILP's values."""
    _check_params(p, lam)
    return _objective_of(problem, value_matrix(problem, p), np.asarray(choice), p, lam)


def _objective_of(problem: IlpProblem, A: np.ndarray, choice: np.ndarray, p: float, lam: float) -> float:
    """`objective` with the value matrix `A` at hand."""
    w = problem.weight
    on = np.flatnonzero(choice >= 0)
    total = float(np.sum(w[on] * A[on, choice[on]]))
    left_out = float(np.sum(np.where(choice < 0, w * _left_out_costs(problem, A, lam), 0.0)))
    return total + left_out if p < 0 else total - left_out


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
    """The optimum `choice` (or, with a `gap`, one within it), its waiting jobs started first come
    first served, with its objective."""
    choice = _first_come_first_served(problem, cost, _running_keep_theirs(problem, cost, choice))
    value = _objective_of(problem, values, choice, p, lam)
    return IlpSolution(
        choice,
        "optimal" if gap == 0 else "greedy",
        False,
        (time.perf_counter() - start) * 1e3,
        value if np.isfinite(value) else None,
        gap,
    )


def _left_out_costs(problem: IlpProblem, A: np.ndarray, lam: float) -> np.ndarray:
    """(J,) lam_i: what leaving each job out costs (before its weight); for a `must_run` job, once
    weighted, more than any weighted entry of the value matrix `A` of a job of no greater weight is
    worth (so a higher priority's growth may still outweigh it)."""
    if not problem.must_run.any():
        return np.full(problem.jobs, lam)
    w = problem.weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a row without a usable cell has no top: nan, taken as 0
        row_top = np.nan_to_num(np.nanmax(w[:, None] * A, axis=1) if A.size else np.zeros(problem.jobs))
    order = np.argsort(w, kind="stable")
    top_upto = np.maximum.accumulate(row_top[order])  # the top of the jobs of weight <= each's
    top = top_upto[np.searchsorted(w[order], w, side="right") - 1]
    return np.where(problem.must_run, MUST_RUN_FACTOR * (top + abs(lam) * w) / w, lam)


def _weighted_costs(problem: IlpProblem, A: np.ndarray, p: float, lam: float) -> np.ndarray:
    """(J, C) per-entry cost in minimisation form, each job's row times its weight."""
    cost = _cost_matrix(A, p, _left_out_costs(problem, A, lam))
    return cost if problem.job_weight is None else cost * problem.job_weight[:, None]


def _cost_matrix(A: np.ndarray, p: float, lam) -> np.ndarray:
    """Per-entry cost in minimisation form (`lam` a scalar or a (J,) lam_i); the constant sum_i lam_i
    (or its negative) is dropped."""
    lam = np.asarray(lam, dtype=float)
    lam = lam[:, None] if lam.ndim == 1 else lam
    return A - lam if p < 0 else -(A + lam)


def _candidates(problem: IlpProblem, cost: np.ndarray, free: np.ndarray) -> np.ndarray:
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


def _team_rows(problem: IlpProblem, keep: np.ndarray, choice: np.ndarray, cost: np.ndarray) -> _TeamRows | None:
    """The teams' rows for this solve (module docstring, "Teams"), or None when no allocation of the
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
    return _TeamRows(reserved, held, borrow, lend, unreserved, row_team, row_type, row_of)


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


@functools.cache
def _installed_milp_solvers() -> tuple[str, ...]:
    installed = set(cp.installed_solvers())
    return tuple(name for name in SUPPORTED_SOLVERS if name in installed)


def _resolve_solver(solver: str) -> str:
    name = str(solver).upper()
    installed = ", ".join(_installed_milp_solvers()) or "none"
    if name not in SUPPORTED_SOLVERS:
        raise ValueError(
            f"unknown MILP solver {solver!r}: supported {', '.join(SUPPORTED_SOLVERS)}; installed here: {installed}"
        )
    if name not in _installed_milp_solvers():
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
class _TeamRows:
    """The teams' guarantees for one solve (module docstring, "Teams"): per team k and type t, the
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

    def of_types(self, types: np.ndarray) -> _TeamRows | None:
        """These rows restricted to the types in the bool mask `types` (None: no row left)."""
        kept = types[self.row_type]
        if not kept.any():
            return None
        row_of = np.full(self.row_of.shape, -1, dtype=np.int64)
        row_of[self.row_team[kept], self.row_type[kept]] = np.arange(int(kept.sum()))
        return _TeamRows(
            self.reserved,
            self.held,
            self.borrow,
            self.lend,
            self.unreserved,
            self.row_team[kept],
            self.row_type[kept],
            row_of,
        )


@dataclass(frozen=True, eq=False)
class _Reduced:
    """The ILP after the exact reductions: one entry per surviving (job, configuration) pair."""

    job: np.ndarray  # (n,) job of each entry
    config: np.ndarray  # (n,) configuration of each entry
    cost: np.ndarray  # (n,) cost in minimisation form, < 0
    gpus: np.ndarray  # (n,) float GPUs
    kind: np.ndarray  # (n,) GPU type
    free: np.ndarray  # (T,) float GPUs of each type left after the pinned jobs
    jobs: int
    teams: _TeamRows | None = None
    row: np.ndarray | None = None  # (n,) the team row of each entry, -1 where none (with `teams`)

    @property
    def types(self) -> int:
        return self.free.shape[0]

    @property
    def prices(self) -> int:
        """Rows with a price in the Lagrangian: the capacity rows, then any team and lending rows."""
        return self.types + (0 if self.teams is None else self.teams.rows + self.teams.lend_types.size)


class _SolverFailure(Exception):
    """A solver call that gave no usable answer; `status` is what the IlpSolution reports."""

    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


@dataclass(frozen=True, eq=False)
class _Rows:
    """K v <= rhs over v = (the entries `idx`, then the teams' borrows b: none without teams): a
    one-configuration row for each job with two or more entries (a job with one entry is held by
    the variable's bound), one capacity row per GPU type, then any team rows and lending rows. The
    rows after the one-configuration rows are the ones that carry a price (`_Reduced.prices`)."""

    K: sp.csc_matrix  # column-wise, as HiGHS takes it
    rhs: np.ndarray
    job_rows: int


def _constraints(m: _Reduced, idx: np.ndarray) -> _Rows:
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


def _program(m: _Reduced, idx: np.ndarray, boolean: bool) -> _Program:
    """The MILP (`boolean`) or its LP relaxation over entries `idx`."""
    borrow = np.empty(0) if m.teams is None else m.teams.row_borrow[m.teams.b_rows]
    return _Program(
        _constraints(m, idx),
        np.concatenate([m.cost[idx], np.zeros(borrow.size)]),
        np.concatenate([np.ones(idx.size), borrow]),
        idx.size if boolean else 0,
    )


def _solve_program(program: _Program, solver: str, time_limit_s: float, rel_gap: float | None = None) -> _Answer:
    """Solve; raise _SolverFailure unless the solver proves its answer optimal. HiGHS is given the
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
                raise _SolverFailure(f"solver_error: HIGHS rejected its option {name}={value!r}")
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
    except _SolverFailure:
        raise
    except Exception as exc:
        raise _SolverFailure(f"solver_error: {type(exc).__name__}: {exc}") from exc
    if status in (
        hp.HighsModelStatus.kTimeLimit,
        hp.HighsModelStatus.kIterationLimit,
        hp.HighsModelStatus.kSolutionLimit,
        hp.HighsModelStatus.kObjectiveBound,
        hp.HighsModelStatus.kObjectiveTarget,
    ):
        raise _SolverFailure("timeout: HIGHS stopped at its time limit")
    if status in (
        hp.HighsModelStatus.kInfeasible,
        hp.HighsModelStatus.kUnboundedOrInfeasible,
        hp.HighsModelStatus.kUnbounded,
    ):
        raise _SolverFailure(f"infeasible: HIGHS reported {status.name}")
    if status != hp.HighsModelStatus.kOptimal:
        raise _SolverFailure(f"solver_error: HIGHS returned status {status.name}")
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
        raise _SolverFailure(f"solver_error: {type(exc).__name__}: {exc}") from exc
    status = problem.status
    if status == cp_status.USER_LIMIT:
        raise _SolverFailure(f"timeout: {solver} stopped at its time limit")
    if status in cp_status.INF_OR_UNB:
        raise _SolverFailure(f"infeasible: {solver} reported {status}")
    if status not in (cp_status.OPTIMAL, cp_status.OPTIMAL_INACCURATE):
        raise _SolverFailure(f"solver_error: {solver} returned status {status}")
    if status != cp_status.OPTIMAL:
        log.info("sia ILP: %s returned %s; the answer is checked before use", solver, status)
    if x.value is None:
        raise _SolverFailure(f"solver_error: {solver} reported optimal but returned no solution")
    duals = None if program.integers or constraint.dual_value is None else np.asarray(constraint.dual_value).reshape(-1)
    return _Answer(np.asarray(x.value).reshape(-1), float(problem.value), duals)


def _milp(m: _Reduced, idx: np.ndarray, solver: str, deadline: float, rel_gap: float | None = None) -> np.ndarray:
    """The MILP over entries `idx`; returns the chosen entries (indices into the reduced model)."""
    if idx.size == 0:
        return idx
    answer = _solve_program(_program(m, idx, boolean=True), solver, deadline - time.perf_counter(), rel_gap)
    chosen = idx[answer.x[: idx.size] > 0.5]
    if np.bincount(m.job[chosen], minlength=m.jobs).max(initial=0) > 1:
        raise _SolverFailure(f"solver_error: {solver} gave a job two configurations")
    return chosen


# --- Large models: prices, reduced costs, a restricted MILP and its optimality proof ------------
#
# For prices mu >= 0 on the capacity rows, the Lagrangian bound
#     L(mu) = sum_i min(0, min_j (c_ij + mu_t(j) g_j)) - mu . free
# is <= the cost of every feasible allocation, and any allocation that gives job i entry j costs
# at least L(mu) + rc_ij, with the reduced cost rc_ij = c_ij + mu_t(j) g_j - min(0, min_j' (...)) >= 0.
# So once some allocation of cost U is known, entries with rc_ij > U - L(mu) are in no allocation
# better than U and can be dropped. With mu near the LP optimum, U - L(mu) is tiny when many jobs
# share the capacity (the LP relaxation of this multiple-choice knapsack then has at most a few
# fractional jobs) and only a few percent of the entries remain. The steps: prices by coordinate
# ascent on L (cheap, vectorised), polished by a few LP solves over the entries with small reduced
# cost (column generation: stop once the restricted LP's value equals L, i.e. it is the full LP's
# optimum); a MILP over the entries with rc <= delta gives U; if some dropped entry has
# rc <= U - L, one more MILP over all entries with rc <= U - L, which is then provably optimal
# (up to the solver's gap), like the direct MILP.
#
# With teams, the prices y are those of every row after the one-configuration rows: mu (capacity),
# nu (team rows u_kt - b_kt <= quota_kt - held_kt) and sigma (lending rows sum_k b_kt <= lend_t).
# An entry of team k and type t then pays mu_t + nu_kt a GPU, and the borrows add
# sum_kt borrow_kt * min(0, sigma_t - nu_kt) (each b_kt at the end of its box that costs least).
# With nu = sigma = 0 (the price ascent's prices) this is L(mu) with the team rows dropped, still a
# lower bound: dropping rows of a minimisation only lowers its optimum. The LP's duals price them.


def _lagrangian(m: _Reduced, y: np.ndarray) -> tuple[float, np.ndarray]:
    """L(y) and every entry's reduced cost, for prices y >= 0 of the rows `_Reduced.prices` counts."""
    mu = y[: m.types]
    price = mu[m.kind]
    constant = -float(mu @ m.free)
    tr = m.teams
    if tr is not None:
        nu, sigma = y[m.types : m.types + tr.rows], y[m.types + tr.rows :]
        price = price + np.where(m.row >= 0, nu[np.maximum(m.row, 0)], 0.0)
        b = tr.b_rows
        sigma_of_b = sigma[np.searchsorted(tr.lend_types, tr.row_type[b])]
        constant += float(
            -nu @ tr.row_rhs
            - sigma @ tr.lend[tr.lend_types]
            + np.sum(tr.row_borrow[b] * np.minimum(0.0, sigma_of_b - nu[b]))
        )
    v = m.cost + price * m.gpus
    best = np.zeros(m.jobs)
    np.minimum.at(best, m.job, v)
    return float(best.sum() + constant), v - best[m.job]


def _price_ascent(m: _Reduced) -> np.ndarray:
    """Capacity prices by cyclic coordinate ascent on L(mu), each coordinate by bisection (any team
    rows priced 0)."""
    configs, column = np.unique(m.config, return_inverse=True)
    dense = np.full((m.jobs, configs.size), np.inf)
    dense[m.job, column] = m.cost
    kind = np.zeros(configs.size, dtype=np.int64)
    kind[column] = m.kind
    gpus = np.zeros(configs.size)
    gpus[column] = m.gpus
    rows = np.arange(m.jobs)

    def usage(mu: np.ndarray) -> np.ndarray:
        v = dense + mu[kind] * gpus
        pick = np.argmin(v, axis=1)
        pick = pick[v[rows, pick] < 0]
        return np.bincount(kind[pick], weights=gpus[pick], minlength=m.types)

    top = float(np.max(-m.cost / m.gpus)) * (1 + 1e-9)  # at this price a type is worth nothing to anyone
    mu = np.zeros(m.types)
    for _ in range(ASCENT_CYCLES):
        before = mu.copy()
        for t in range(m.types):
            mu[t] = 0.0
            if usage(mu)[t] <= m.free[t]:
                continue  # capacity of t is slack even when free: its price is 0
            lo, hi = 0.0, top
            for _ in range(ASCENT_STEPS):
                mid = 0.5 * (lo + hi)
                mu[t] = mid
                if usage(mu)[t] > m.free[t]:
                    lo = mid
                else:
                    hi = mid
            mu[t] = hi
        if np.allclose(mu, before, rtol=1e-4, atol=1e-12):
            break
    return np.concatenate([mu, np.zeros(m.prices - m.types)])


def _lp_prices(m: _Reduced, idx: np.ndarray, deadline: float) -> tuple[np.ndarray, float]:
    """The duals of the priced rows and the value of the LP relaxation over entries `idx` (HiGHS)."""
    if idx.size == 0:
        return np.zeros(m.prices), 0.0
    answer = _solve_program(_program(m, idx, boolean=False), "HIGHS", deadline - time.perf_counter())
    if answer.duals is None:
        raise _SolverFailure("solver_error: HIGHS returned no duals for the LP relaxation")
    return np.maximum(answer.duals[-m.prices :], 0.0), answer.value


def _solve_large(m: _Reduced, solver: str, deadline: float) -> np.ndarray:
    mu = _price_ascent(m)
    bound, rc = _lagrangian(m, mu)
    delta = RESTRICT_DELTA * float(np.median(-m.cost))
    sel = rc <= delta
    for _ in range(LP_ROUNDS):
        try:
            mu_lp, lp_value = _lp_prices(m, np.flatnonzero(sel), deadline)
        except _SolverFailure as failure:
            if failure.status.startswith("timeout"):
                raise
            log.info("sia ILP: LP prices unavailable (%s); using the ascent's", failure.status)
            break
        bound_lp, rc_lp = _lagrangian(m, mu_lp)
        if bound_lp > bound:
            mu, bound, rc = mu_lp, bound_lp, rc_lp
        if bound_lp >= lp_value - 1e-9 * max(1.0, abs(lp_value)):
            break  # no dropped entry prices out: the restricted LP is the full LP's optimum
        sel |= rc_lp <= delta
    sel = rc <= delta
    chosen = _milp(m, np.flatnonzero(sel), solver, deadline, LARGE_MIP_REL_GAP)
    upper = float(m.cost[chosen].sum())
    need = rc <= upper - bound + 1e-9 * max(1.0, abs(upper))
    if np.any(need & ~sel):
        log.debug(
            "sia ILP: restricted MILP not proven (gap %.3g); widening to %d entries",
            upper - bound,
            int(np.count_nonzero(need | sel)),
        )
        chosen = _milp(m, np.flatnonzero(need | sel), solver, deadline, LARGE_MIP_REL_GAP)
    return chosen


# --- Huge models: sampled prices, a regret assignment and a greedy fill ------------------------
#
# Past `HUGE_MODEL_ENTRIES` entries (thousands of jobs: sia-hetero-16384 with 10,000 jobs has
# 100,000+), the LP relaxation alone takes HiGHS 13 s, and the coordinate ascent stalls far from
# its optimum (a non-smooth dual: on the first round at 16,384 GPUs its bound was 1.6% of the cost
# below the LP's). There:
# 1. Prices: the LP relaxation's duals on `PRICE_SAMPLE_JOBS` jobs drawn at random (a fixed seed),
#    each type's capacity scaled by the share of jobs drawn: with thousands of jobs sharing three
#    capacities the clearing price of a GPU type is a property of the population, which a few
#    hundred jobs already show (on that round the sample's duals equal the full LP's to 4 digits).
# 2. An allocation at those prices: the jobs in order of regret (how much more their second-best
#    reduced cost is than their best; leaving out counts as 0), each its entry of least reduced
#    cost that fits in what is left; then a greedy fill (`_greedy_fill`) of what is idle. Also the
#    greedy fill from an empty cluster; the cheaper of the two is the answer.
# 3. Its cost U is within U - L(mu) of the optimum (L, the Lagrangian bound above, is below every
#    allocation's cost): `IlpSolution.gap` reports it.


def _greedy_fill(m: _Reduced, pick: np.ndarray | None = None) -> np.ndarray:
    """Entries (indices into the reduced model) of a feasible allocation: from `pick` (each job's
    entry, -1 none; default every job left out), passes in which each job may take one better entry
    that fits in what is idle, the most gain per GPU it adds first (from nothing, a job's smallest
    entry gains its whole left-out cost, so every job that fits starts before any grows)."""
    job, cost, gpus, kind = m.job, m.cost, m.gpus, m.kind
    pick = np.full(m.jobs, -1, dtype=np.int64) if pick is None else pick.copy()
    on = pick >= 0
    slack = m.free - np.bincount(kind[pick[on]], weights=gpus[pick[on]], minlength=m.types)
    for _ in range(GREEDY_PASSES):
        on = pick >= 0
        cur = np.maximum(pick, 0)
        cur_cost = np.where(on, cost[cur], 0.0)
        cur_kind = np.where(on, kind[cur], -1)
        cur_gpus = np.where(on, gpus[cur], 0.0)
        extra = gpus - np.where(cur_kind[job] == kind, cur_gpus[job], 0.0)
        gain = cur_cost[job] - cost
        ok = (gain > 1e-12) & (extra <= slack[kind] + 1e-9)
        if not ok.any():
            break
        ratio = np.where(ok, gain / np.maximum(extra, 1e-9), -np.inf)
        top = np.full(m.jobs, -np.inf)
        np.maximum.at(top, job, ratio)
        at = np.flatnonzero(ok & (ratio == top[job]))
        first = np.full(m.jobs, -1, dtype=np.int64)
        first[job[at[::-1]]] = at[::-1]  # one entry a job: the first of its best ratio
        moves = first[first >= 0]
        moves = moves[np.argsort(-ratio[moves], kind="stable")]
        changed = False
        for e, i, t, g, x in zip(
            moves.tolist(), job[moves].tolist(), kind[moves].tolist(), gpus[moves].tolist(), extra[moves].tolist()
        ):
            if x > slack[t] + 1e-9:
                continue
            if pick[i] >= 0:
                slack[kind[pick[i]]] += gpus[pick[i]]
            pick[i] = e
            slack[t] -= g
            changed = True
        if not changed:
            break
    return pick


def _sampled_prices(m: _Reduced, deadline: float) -> np.ndarray:
    """Capacity prices: the LP relaxation's duals on a random sample of the jobs, each capacity
    scaled by the sample's share (the coordinate ascent's when the LP gives none)."""
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(m.jobs, min(PRICE_SAMPLE_JOBS, m.jobs), replace=False))
    renumber = np.full(m.jobs, -1, dtype=np.int64)
    renumber[sample] = np.arange(sample.size)
    keep = renumber[m.job] >= 0
    small = _Reduced(
        renumber[m.job[keep]],
        m.config[keep],
        m.cost[keep],
        m.gpus[keep],
        m.kind[keep],
        m.free * sample.size / m.jobs,
        sample.size,
    )
    try:
        return _lp_prices(small, np.arange(small.job.size), deadline)[0][: m.types]
    except _SolverFailure as failure:
        log.info("sia ILP: sampled LP prices unavailable (%s); using the ascent's", failure.status)
        return _price_ascent(m)[: m.types]


def _regret_assignment(m: _Reduced, mu: np.ndarray) -> np.ndarray:
    """(J,) each job's entry (-1 none) at prices mu: the jobs by regret, each its least reduced cost
    that fits in what is left."""
    v = m.cost + mu[m.kind] * m.gpus
    order = np.lexsort((v, m.job))
    start = np.searchsorted(m.job[order], np.arange(m.jobs))
    end = np.append(start[1:], order.size)
    sorted_v = v[order]
    has = end > start
    best = np.where(has, sorted_v[np.minimum(start, order.size - 1)], 0.0)
    second = np.where(end - start > 1, sorted_v[np.minimum(start + 1, order.size - 1)], 0.0)
    regret = np.where(has, np.minimum(second, 0.0) - best, -np.inf)
    slack = m.free.astype(float).copy()
    pick = np.full(m.jobs, -1, dtype=np.int64)
    values, kinds, gpus, entries = sorted_v.tolist(), m.kind[order].tolist(), m.gpus[order].tolist(), order.tolist()
    starts, ends = start.tolist(), end.tolist()
    for i in np.argsort(-regret, kind="stable").tolist():
        for e in range(starts[i], ends[i]):
            if values[e] >= 0:
                break  # leaving the job out costs less than anything left
            if gpus[e] <= slack[kinds[e]]:
                pick[i] = entries[e]
                slack[kinds[e]] -= gpus[e]
                break
    return pick


def _solve_huge(m: _Reduced, deadline: float) -> tuple[np.ndarray, float]:
    """The cheaper of the priced and the plain greedy allocations, and its gap bound U - L(mu) >= 0."""
    mu = _sampled_prices(m, deadline)
    bound, _ = _lagrangian(m, np.concatenate([mu, np.zeros(m.prices - m.types)]))
    answers = [_greedy_fill(m, _regret_assignment(m, mu)), _greedy_fill(m)]
    costs = [float(np.sum(m.cost[pick[pick >= 0]])) for pick in answers]
    pick = answers[int(np.argmin(costs))]
    return pick[pick >= 0], max(min(costs) - bound, 0.0)


def _large_or_huge(m: _Reduced, solver: str, deadline: float) -> tuple[np.ndarray, float]:
    """The huge path's answer when its bound already proves it within `GREEDY_ACCEPT_GAP` of the
    optimum; else the priced path within `LARGE_MODEL_BUDGET_S`,
    and past that the huge path's answer (a round at 2,048 GPUs had HiGHS's restricted MILP run
    past the 5 s time limit, and the previous allocation stood)."""
    greedy, gap = _solve_huge(m, deadline)
    if time.perf_counter() >= deadline:
        raise _SolverFailure("timeout: the time limit passed while pricing")
    if gap <= GREEDY_ACCEPT_GAP * abs(float(m.cost[greedy].sum())):
        return greedy, gap
    try:
        return _solve_large(m, solver, min(deadline, time.perf_counter() + LARGE_MODEL_BUDGET_S)), 0.0
    except _SolverFailure as failure:
        if not failure.status.startswith("timeout") or time.perf_counter() >= deadline:
            raise
        log.info("sia ILP: the priced path took over %.1f s; the greedy answer instead", LARGE_MODEL_BUDGET_S)
        return greedy, gap


def _running_keep_theirs(problem: IlpProblem, cost: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """`choice` with each running job that was left out given back its current configuration by a
    waiting job that starts in it, wherever that costs no more (the objective is no worse, each
    type's use the same)."""
    left_out = np.flatnonzero((problem.current >= 0) & (choice < 0))
    if left_out.size == 0:
        return choice
    choice = choice.copy()
    starting = np.flatnonzero((problem.current < 0) & (choice >= 0))
    for k in left_out[problem.valid[left_out, problem.current[left_out]]]:
        own = problem.current[k]
        takers = starting[choice[starting] == own]
        if problem.job_team is not None:  # a swap within a team leaves every team's use as it was
            takers = takers[problem.job_team[takers] == problem.job_team[k]]
        equal = takers[cost[k, own] <= cost[takers, own]]
        if equal.size:  # of several, the one that waited least gives way
            j = equal[np.argmax(_queue_place(problem)[equal])]
            choice[k], choice[j] = own, -1
            starting = starting[starting != j]
    return choice


def _first_come_first_served(problem: IlpProblem, cost: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """`choice` with each waiting job that was left out given the cell of a job that waited less
    and starts now, wherever that costs no more (so the objective is no worse): among equals, the
    longest-waiting jobs start."""
    if problem.waited is None:
        return choice
    choice = choice.copy()
    waiting = problem.current < 0
    starting = np.flatnonzero(waiting & (choice >= 0))
    place = _queue_place(problem)
    # Oldest first: a job given a cell here waited longer than every one still to come, so it is
    # never taken back, and only the jobs that gave theirs up leave `starting`.
    for k in sorted(np.flatnonzero(waiting & (choice < 0)), key=lambda i: place[i]):
        younger = starting[place[starting] > place[k]]
        if problem.job_team is not None:  # a swap within a team leaves every team's use as it was
            younger = younger[problem.job_team[younger] == problem.job_team[k]]
        cells = choice[younger]
        equal = younger[problem.valid[k, cells] & (cost[k, cells] <= cost[younger, cells])]
        if equal.size:
            j = equal[np.argmax(place[equal])]
            choice[k], choice[j] = choice[j], -1
            starting = starting[starting != j]
    return choice


def _queue_place(problem: IlpProblem) -> np.ndarray:
    """(J,) each job's place in the queue, 0 first: the longest-waiting first, and of jobs that
    waited as long (submitted together), the one listed first."""
    waited = problem.waited if problem.waited is not None else np.zeros(problem.jobs)
    place = np.empty(problem.jobs, dtype=int)
    place[np.lexsort((np.arange(problem.jobs), -waited))] = np.arange(problem.jobs)
    return place


def _fallback(problem: IlpProblem, status: str, start: float, exc_info: bool = False) -> IlpSolution:
    log.warning("sia ILP: keeping the previous allocation of %d jobs (%s)", problem.jobs, status, exc_info=exc_info)
    return IlpSolution(problem.current.copy(), status, True, (time.perf_counter() - start) * 1e3)


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
    _check_params(p, lam)
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s!r}")
    solver = _resolve_solver(solver)
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
    cost = _weighted_costs(problem, values, p, lam)
    keep = _candidates(problem, cost, free)
    teams = None if problem.job_team is None else _team_rows(problem, keep, choice, cost)

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

    job, config = np.nonzero(keep)
    kind = problem.config_type[config]
    gap = 0.0
    deadline = time.perf_counter() + time_limit_s
    # The team rows enter lazily: those of the types where the jobs' best entries break them, then
    # those of any type the answer breaks, until it keeps them all. An answer without some rows that
    # keeps them is the optimum with them too (a relaxation's optimum that is feasible).
    while True:
        rows = None if teams is None else teams.of_types(binding)
        m = _Reduced(
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
        try:
            if job.size > HUGE_MODEL_ENTRIES and rows is None:
                chosen, gap = _solve_huge(m, deadline)
            elif job.size > LARGE_MODEL_ENTRIES and "HIGHS" in _installed_milp_solvers() and rows is None:
                chosen, gap = _large_or_huge(m, solver, deadline)
            elif job.size > LARGE_MODEL_ENTRIES and "HIGHS" in _installed_milp_solvers():
                chosen = _solve_large(m, solver, deadline)
            else:
                chosen = _milp(m, np.arange(job.size), solver, deadline)
        except _SolverFailure as failure:
            return _fallback(problem, failure.status, start, exc_info=failure.__cause__ is not None)
        if teams is None:
            break
        broken = teams.broken(problem.job_team[m.job[chosen]], m.kind[chosen], problem.config_gpus[m.config[chosen]])
        if not (broken & ~binding).any():
            break  # none broken, or only where the rows already are: the check below refuses it
        binding |= broken

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
