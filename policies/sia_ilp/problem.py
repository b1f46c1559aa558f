"""One round of Sia's allocation ILP over plain numpy arrays: its problem, values and objective.

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

Each job's whole term (value and leave-out cost) is multiplied by its weight w_i: its team's weight
(which shares what is lent) times PRIORITY_STEP ** (the rank of its priority among its team's:
policies/teams.py). The teams' rows: policies/sia_ilp/team_guarantees.py.

Numerics, and where this departs from the artifact:
- The artifact rounds A to 2 decimals and clips it at 3000. For p = -0.5, A lies in (0, 1] for
  un-discounted entries, so 2 decimals keep one or two significant digits: a step of 0.01 at
  A ~ 0.14 (G ~ 50) is a 15% goodput step. 48 and 52 GPUs of a linearly scaling job both give 0.14,
  56 and 60 both 0.13, so the solver cannot tell them apart (and may hand out GPUs that buy nothing),
  and restart trade-offs (r * G) are decided on the same coarse grid. Here A is clipped at `VALUE_CLIP` and
  rounded to `VALUE_SIGNIFICANT_DIGITS` significant digits: a relative resolution of 1e-6 to 1e-5
  whatever the scale of A (and for any p), so goodput differences of a few 1e-5 still count, while
  float noise from upstream is snapped so that equal inputs give exactly equal coefficients. The
  MIP gap (`exact.MIP_REL_GAP`, `exact.MIP_ABS_GAP`) is set to match; HiGHS's default 1e-4 would not be.
- A restart factor of 0 gives A = inf for p < 0 (the artifact then clips it to 3000). It is
  floored at `RESTART_FACTOR_FLOOR` = 1e-3 instead, so moving such a job costs (1e-3 G) ** p =
  31.6 / sqrt(G) at p = -0.5, more than keeping it (<= 1) or leaving it out (1.1) unless its
  goodput elsewhere is ~1,000x: the same decisions, with finite, solver-friendly coefficients.
- Invalid entries carry no variable at all (no big-M or 1e-4 "zero alloc gain" constants), so they
  are 0 by construction, even in a solution accepted within the MIP gap.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

DEFAULT_P = -0.5
DEFAULT_LAMBDA = 1.1
RESTART_FACTOR_FLOOR = 1e-3
# Leaving out a `must_run` job costs this many times more than any one entry's value: it runs when
# moving one other job makes room for it, even one that the restart factor all but pins.
MUST_RUN_FACTOR = 2.0
VALUE_CLIP = 3000.0
VALUE_SIGNIFICANT_DIGITS = 6


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
    job_team, team_quota, team_borrow (all three or none): the teams' guarantees
        (team_guarantees.py). job_team: (J,) int, the team in [0, K) of each job; team_quota: (K, T) int >= 0,
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
    # U - L(mu) for a huge model's greedy allocation (`solve_huge`); None when kept.
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


def check_params(p: float, lam: float) -> None:
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
    check_params(p, DEFAULT_LAMBDA)
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
    check_params(p, lam)
    return objective_of(problem, value_matrix(problem, p), np.asarray(choice), p, lam)


def objective_of(problem: IlpProblem, A: np.ndarray, choice: np.ndarray, p: float, lam: float) -> float:
    """`objective` with the value matrix `A` at hand."""
    w = problem.weight
    on = np.flatnonzero(choice >= 0)
    total = float(np.sum(w[on] * A[on, choice[on]]))
    left_out = float(np.sum(np.where(choice < 0, w * _left_out_costs(problem, A, lam), 0.0)))
    return total + left_out if p < 0 else total - left_out


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


def weighted_costs(problem: IlpProblem, A: np.ndarray, p: float, lam: float) -> np.ndarray:
    """(J, C) per-entry cost in minimisation form, each job's row times its weight."""
    cost = _cost_matrix(A, p, _left_out_costs(problem, A, lam))
    return cost if problem.job_weight is None else cost * problem.job_weight[:, None]


def _cost_matrix(A: np.ndarray, p: float, lam) -> np.ndarray:
    """Per-entry cost in minimisation form (`lam` a scalar or a (J,) lam_i); the constant sum_i lam_i
    (or its negative) is dropped."""
    lam = np.asarray(lam, dtype=float)
    lam = lam[:, None] if lam.ndim == 1 else lam
    return A - lam if p < 0 else -(A + lam)
