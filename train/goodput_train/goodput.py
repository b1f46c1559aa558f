"""Pollux's model of a data-parallel training job: throughput, statistical efficiency, goodput.

    GOODPUT(a, m, s) = THROUGHPUT(a, m, s) x EFFICIENCY(M),        M = K * m * (s + 1)

for an allocation a of K GPUs on `nodes` nodes, per-GPU (atomic) batch m and s gradient-accumulation
steps. Throughput (Pollux §3.2):

    T_grad(m)  = alpha_c + beta_c * m                      compute time of one micro-batch
    T_sync(a)  = 0                                         K = 1
               = alpha_r + beta_r * (K - 2)                K >= 2 on one node  (r: ring in a node)
               = alpha_n + beta_n * (K - 2)                K >= 2 across nodes (n: network)
    T_iter     = s * T_grad + (T_grad^gamma + T_sync^gamma)^(1/gamma)
    THROUGHPUT = M / T_iter

gamma in [1, 10] is how well back-propagation overlaps the all-reduce: 1 is no overlap (sum),
large is perfect overlap (max). Efficiency (Pollux §3.1), with the pre-conditioned gradient noise
scale PGNS = phi = M0 * grad_var / grad_sqr measured at the initial batch M0:

    EFFICIENCY(M) = (phi + M0) / (phi + M)        1 at M0, falls as M grows; 1 without statistics

Every function here is pure numpy and broadcasts over all of its arguments, parameters included:
the estimator evaluates thousands of (job, configuration, batch) cells at once.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import numpy as np
from scipy.optimize import minimize
from threadpoolctl import ThreadpoolController

log = logging.getLogger(__name__)

GAMMA_BOUNDS = (1.0, 10.0)
BATCH_CANDIDATES = 50  # geometric total-batch candidates searched per allocation
RETUNE_THRESHOLD = 0.05  # change (m, s) only for a predicted goodput gain above 5%

# L-BFGS-B on 7 parameters is all tiny BLAS calls: a multi-threaded BLAS spends ~10x the work
# starting and syncing threads, so fits run with one thread (inside the fit only).
_BLAS = ThreadpoolController()


class ThroughputParams(NamedTuple):
    """theta_sys. Fields may be floats or same-shaped arrays (one model per cell)."""

    alpha_c: float  # s, fixed cost of a micro-batch
    beta_c: float  # s per sample of a micro-batch
    alpha_r: float  # s, all-reduce fixed cost on one node
    beta_r: float  # s per extra GPU on one node
    alpha_n: float  # s, all-reduce fixed cost across nodes
    beta_n: float  # s per extra GPU across nodes
    gamma: float  # overlap of compute and all-reduce, in [1, 10]

    @classmethod
    def stack(cls, params: Iterable["ThroughputParams"]) -> "ThroughputParams":
        """Many models as one: each field becomes an array, for vectorised evaluation."""
        return cls(*np.asarray(list(params), dtype=float).T)


# --- throughput -------------------------------------------------------------------------------


def compute_time(params: ThroughputParams, m):
    return params.alpha_c + params.beta_c * np.asarray(m, dtype=float)


def sync_time(params: ThroughputParams, nodes, gpus):
    nodes, gpus = np.asarray(nodes), np.asarray(gpus)
    return _sync_time(params, nodes > 1, gpus > 1, np.maximum(gpus - 2, 0))


def _sync_time(params: ThroughputParams, across, multi, extra):
    """The all-reduce's time, given which allocations span nodes, which have several GPUs, and the
    GPUs beyond two."""
    t = np.where(across, params.alpha_n + params.beta_n * extra, params.alpha_r + params.beta_r * extra)
    return np.where(multi, t, 0.0)


def _overlap(t_grad, t_sync, gamma):
    """(t_grad^gamma + t_sync^gamma)^(1/gamma), written around the larger term so it cannot overflow."""
    hi = np.maximum(t_grad, t_sync)
    lo = np.minimum(t_grad, t_sync)
    ratio = np.divide(lo, hi, out=np.zeros(np.shape(hi)), where=hi > 0)  # hi has the broadcast shape
    return hi * (1.0 + ratio**gamma) ** (1.0 / gamma)


def iteration_time(params: ThroughputParams, nodes, gpus, m, s=0):
    """Seconds per optimizer step (s accumulation micro-batches plus the synchronising one)."""
    t_grad = compute_time(params, m)
    return np.asarray(s) * t_grad + _overlap(t_grad, sync_time(params, nodes, gpus), params.gamma)


def throughput(params: ThroughputParams, nodes, gpus, m, s=0):
    """Samples per second."""
    batch = np.asarray(gpus) * np.asarray(m) * (np.asarray(s) + 1)
    return batch / iteration_time(params, nodes, gpus, m, s)


# --- statistical efficiency -------------------------------------------------------------------


def pgns(grad_sqr: float | None, grad_var: float | None, init_batch: int) -> float:
    """phi = M0 * var / sqr; inf (efficiency 1 everywhere) when there are no usable statistics."""
    if grad_sqr is None or grad_var is None:
        return math.inf
    if not (math.isfinite(grad_sqr) and math.isfinite(grad_var)) or grad_sqr <= 0 or grad_var < 0:
        return math.inf
    return init_batch * grad_var / grad_sqr


def efficiency(phi, init_batch, batch):
    """(phi + M0) / (phi + M); 1 where phi is infinite (no statistics yet)."""
    phi, m0, batch = np.broadcast_arrays(
        np.asarray(phi, float), np.asarray(init_batch, float), np.asarray(batch, float)
    )
    finite = np.isfinite(phi)
    safe_phi = np.where(finite, phi, 0.0)
    return np.where(finite, (safe_phi + m0) / (safe_phi + batch), 1.0)


# --- the best batch for an allocation ---------------------------------------------------------


class BatchChoice(NamedTuple):
    """Arrays of the allocation's shape; goodput 0 (and m = s = 0) where no batch is feasible."""

    goodput: np.ndarray
    m: np.ndarray  # per-GPU batch
    s: np.ndarray  # accumulation steps


def optimize_batch(
    params: ThroughputParams,
    phi,
    init_batch,
    max_batch,
    min_local,
    max_local,
    nodes,
    gpus,
    candidates: int = BATCH_CANDIDATES,
) -> BatchChoice:
    """argmax over total batch M in [M0, max batch] of goodput, with the smallest s whose per-GPU
    batch m fits max_local. Every argument broadcasts; the result has the broadcast shape.

    Candidates are geometric in M. Per candidate, m = ceil(M / (K (s+1))), rounded down instead
    when that would pass the max batch; a candidate is feasible only when min_local <= m <=
    max_local and M0 <= K m (s+1) <= max batch, so the choice respects every bound exactly.
    """
    expand = lambda x: np.asarray(x, float)[..., None]  # noqa: E731  (a trailing candidate axis)
    m0, top, k = expand(init_batch), expand(max_batch), expand(gpus)
    lo, hi = expand(min_local), expand(max_local)
    frac = np.linspace(0.0, 1.0, candidates)
    batch = m0 * (np.maximum(top, m0) / m0) ** frac  # geometric in [M0, max]

    s = np.maximum(np.ceil(batch / (k * hi) - 1e-9) - 1, 0)
    per_step = k * (s + 1)
    m = np.ceil(batch / per_step - 1e-9)
    m = np.where(m * per_step > top, np.floor(batch / per_step + 1e-9), m)
    total = m * per_step
    feasible = (m >= np.maximum(lo, 1)) & (m <= hi) & (total >= m0) & (total <= top)

    p = ThroughputParams(*(expand(f) for f in params))
    t_iter = iteration_time(p, expand(nodes), k, np.maximum(m, 1), s)
    value = np.where(feasible, total / t_iter * efficiency(expand(phi), m0, total), 0.0)

    best = np.argmax(value, axis=-1)[..., None]
    pick = lambda x: np.take_along_axis(np.broadcast_to(x, value.shape), best, -1)[..., 0]  # noqa: E731
    good = pick(value)
    ok = good > 0
    return BatchChoice(good, np.where(ok, pick(m), 0).astype(int), np.where(ok, pick(s), 0).astype(int))


def split_batch(batch: int, gpus: int, max_local: int) -> tuple[int, int]:
    """(m, s) for a fixed total batch on `gpus` GPUs (a rigid job): the fewest accumulation steps s
    whose per-GPU micro-batch fits max_local, then the smallest m that covers the batch:
    s = ceil(batch / (gpus * max_local)) - 1,  m = ceil(batch / (gpus * (s + 1)))."""
    s = max(math.ceil(batch / (gpus * max_local)) - 1, 0)
    return max(math.ceil(batch / (gpus * (s + 1))), 1), s


@dataclass(frozen=True)
class BatchLimits:
    """What a job allows: total batch in [init, max], per-GPU micro-batch in [min_local, max_local]."""

    init_batch: int
    max_batch: int
    min_local: int
    max_local: int

    def __post_init__(self):
        if not (1 <= self.init_batch <= self.max_batch and 1 <= self.min_local <= self.max_local):
            raise ValueError(f"inconsistent batch limits {self}")


@dataclass(frozen=True)
class GoodputModel:
    """One job on one GPU type: fitted throughput and its current gradient statistics."""

    params: ThroughputParams
    grad_sqr: float | None
    grad_var: float | None
    init_batch: int

    @property
    def pgns(self) -> float:
        return pgns(self.grad_sqr, self.grad_var, self.init_batch)

    def throughput(self, nodes, gpus, m, s=0):
        return throughput(self.params, nodes, gpus, m, s)

    def efficiency(self, batch):
        return efficiency(self.pgns, self.init_batch, batch)

    def goodput(self, nodes, gpus, m, s=0):
        batch = np.asarray(gpus) * np.asarray(m) * (np.asarray(s) + 1)
        return self.throughput(nodes, gpus, m, s) * self.efficiency(batch)

    def best_batch(self, nodes, gpus, limits: BatchLimits) -> BatchChoice:
        return optimize_batch(
            self.params, self.pgns, limits.init_batch, limits.max_batch, limits.min_local, limits.max_local, nodes, gpus
        )

    def retune(
        self,
        nodes: int,
        gpus: int,
        limits: BatchLimits,
        current: tuple[int, int] | None = None,
        threshold: float = RETUNE_THRESHOLD,
    ) -> tuple[float, int, int]:
        """(goodput, m, s) to run with: the best choice, unless the current (m, s) is still valid
        for this allocation and the best is predicted less than `threshold` better (a batch-size
        change resets optimizer dynamics, so it must pay for itself)."""
        best = self.best_batch(nodes, gpus, limits)
        choice = (float(best.goodput), int(best.m), int(best.s))
        if current is None:
            return choice
        m, s = current
        total = gpus * m * (s + 1)
        if limits.min_local <= m <= limits.max_local and limits.init_batch <= total <= limits.max_batch:
            kept = float(self.goodput(nodes, gpus, m, s))
            if choice[0] <= (1.0 + threshold) * kept:
                return kept, m, s
        return choice


class Retune(NamedTuple):
    """One job's `GoodputModel.retune` question, to be answered with others' (`retune_all`)."""

    model: GoodputModel
    nodes: int
    gpus: int
    limits: BatchLimits
    current: tuple[int, int] | None

    def retune(self, threshold: float = RETUNE_THRESHOLD) -> tuple[float, int, int]:
        return self.model.retune(self.nodes, self.gpus, self.limits, self.current, threshold)


@functools.lru_cache(maxsize=1 << 14)
def _kept(model: GoodputModel, nodes: int, gpus: int, m: int, s: int) -> float:
    """A job's goodput at its current (m, s), kept: round after round a running job asks it of the
    same model until its estimate changes (a round of a few thousand running jobs fits)."""
    return float(model.goodput(nodes, gpus, m, s))


def retune_all(questions: Sequence[Retune], threshold: float = RETUNE_THRESHOLD) -> list[tuple[float, int, int]]:
    """Each question's `GoodputModel.retune`, the same answers, in one vectorised search for all: a
    simulated round re-tunes every running job (thousands), where a job's own call is mostly
    NumPy's per-call cost."""
    if not questions:
        return []
    models = [q.model for q in questions]
    params = ThroughputParams.stack(m.params for m in models)
    phi = np.array([m.pgns for m in models], dtype=float)
    limits = np.array(
        [(q.limits.init_batch, q.limits.max_batch, q.limits.min_local, q.limits.max_local) for q in questions],
        dtype=float,
    ).T
    nodes = np.array([q.nodes for q in questions])
    gpus = np.array([q.gpus for q in questions])
    best = optimize_batch(params, phi, *limits, nodes, gpus)
    current = np.array([q.current or (0, 0) for q in questions]).reshape(-1, 2)
    m, s = current[:, 0], current[:, 1]
    total = gpus * m * (s + 1)
    init, top, lo, hi = limits
    valid = (
        np.array([q.current is not None for q in questions]) & (lo <= m) & (m <= hi) & (init <= total) & (total <= top)
    )
    # What the current (m, s) gives: each job's own call, as `retune` takes it (NumPy's power of
    # one number and of an array can differ in the last bit, and a tie must go the same way).
    kept = np.array([_kept(q.model, q.nodes, q.gpus, *q.current) if ok else 0.0 for q, ok in zip(questions, valid)])
    keep = valid & (best.goodput <= (1.0 + threshold) * kept)
    return [
        (float(kept[i]), int(m[i]), int(s[i])) if keep[i] else (float(best.goodput[i]), int(best.m[i]), int(best.s[i]))
        for i in range(len(questions))
    ]


# --- fitting ----------------------------------------------------------------------------------


class Observation(NamedTuple):
    """One measured configuration. t_grad (one micro-batch's compute time) is optional: NaN if unknown."""

    nodes: int
    gpus: int
    m: int
    s: int
    t_iter: float
    t_grad: float = math.nan


class FitError(ValueError):
    """The observations cannot produce a model (none usable)."""


def _observation_array(observations) -> np.ndarray:
    rows = [tuple(o) + (math.nan,) * (6 - len(o)) for o in observations]
    data = np.asarray(rows, dtype=float).reshape(-1, 6)
    return data


class _SquaredLogError:
    """Mean squared log error of iteration (and compute) times over one fit's observations, and its
    analytic gradient, as a function of theta (a fit evaluates it ~40 times: what does not depend
    on theta is computed once, and the residuals and their Jacobian are written into arrays kept
    from call to call)."""

    def __init__(self, data: np.ndarray, fixed_mask: np.ndarray, fixed_values: np.ndarray):
        nodes, gpus, self.m, self.s, t_iter, t_grad_obs = data.T
        self.fixed_mask, self.fixed_values = fixed_mask, fixed_values
        self.across, self.multi, self.extra = nodes > 1, gpus > 1, np.maximum(gpus - 2, 0)
        self.one_node = (nodes <= 1).astype(float)
        self.across_nodes = 1 - self.one_node
        self.log_t_iter = np.log(t_iter)
        self.has_grad = np.isfinite(t_grad_obs)
        self.log_t_grad = np.log(t_grad_obs[self.has_grad])
        self.m_grad = self.m[self.has_grad]
        # Residuals: one per iteration time, then one per measured compute time; the Jacobian's rows
        # likewise (a compute-time row depends on alpha_c and beta_c only: the rest stays 0).
        rows = len(data) + self.log_t_grad.size
        self.r = np.empty(rows)
        self.jac = np.zeros((rows, 7))

    def __call__(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        p = ThroughputParams(*np.where(self.fixed_mask, self.fixed_values, theta).tolist())  # plain floats
        m, s, extra, multi, g = self.m, self.s, self.extra, self.multi, p.gamma
        t_grad = compute_time(p, m)
        t_sync = _sync_time(p, self.across, multi, extra)
        overlap = _overlap(t_grad, t_sync, g)
        pred = s * t_grad + overlap
        n, r, jac = pred.size, self.r, self.jac
        np.subtract(np.log(pred), self.log_t_iter, out=r[:n])

        # d overlap: with u = t_grad/P, v = t_sync/P (u^g + v^g = 1):
        #   dP/dt_grad = u^(g-1), dP/dt_sync = v^(g-1), dP/dg = P/g * (u^g ln u + v^g ln v).
        u = t_grad / overlap
        v = t_sync / overlap
        d_tgrad = s + u ** (g - 1)
        dv = np.where(multi, v ** (g - 1), 0.0)
        dv_one_node = dv * self.one_node
        dv_across_nodes = dv * self.across_nodes
        per_iteration = jac[:n]
        per_iteration[:, 0] = d_tgrad
        per_iteration[:, 1] = d_tgrad * m
        per_iteration[:, 2] = dv_one_node
        per_iteration[:, 3] = dv_one_node * extra
        per_iteration[:, 4] = dv_across_nodes
        per_iteration[:, 5] = dv_across_nodes * extra
        per_iteration[:, 6] = overlap / g * (_power_log(u, g) + _power_log(v, g))
        per_iteration /= pred[:, None]
        if self.log_t_grad.size:
            t_measured = t_grad[self.has_grad]
            np.subtract(np.log(t_measured), self.log_t_grad, out=r[n:])
            jac[n:, 0] = 1.0 / t_measured
            jac[n:, 1] = self.m_grad / t_measured
        loss = float(np.add.reduce(r * r) / r.size)  # np.mean(r**2), without its overhead
        grad = 2.0 * (r @ jac) / r.size
        return loss, np.where(self.fixed_mask, 0.0, grad)


def _power_log(x: np.ndarray, g: float) -> np.ndarray:
    """x^g ln x, with 0 where x <= 0 (its limit at 0)."""
    positive = x > 0
    if positive.all():
        return x**g * np.log(x)
    return np.where(positive, x**g * np.log(np.where(positive, x, 1.0)), 0.0)


def rmsle(params: ThroughputParams, observations) -> float:
    """Root mean squared log error of predicted versus observed iteration time."""
    data = _observation_array(observations)
    nodes, gpus, m, s, t_iter, _ = data.T
    return float(np.sqrt(np.mean((np.log(iteration_time(params, nodes, gpus, m, s)) - np.log(t_iter)) ** 2)))


def fit_throughput(observations) -> ThroughputParams:
    """Fit theta_sys to observed iteration times: RMSLE by L-BFGS-B, analytic gradient, all
    alpha, beta >= 0 and gamma in [1, 10].

    Pollux's optimistic priors fix what the data cannot tell: alpha_r = beta_r = 0 until a job
    ran on several GPUs of one node, alpha_n = beta_n = 0 until it ran across nodes, beta_r =
    beta_n = 0 until it ran on more than two GPUs, gamma = 1 until any sync was observed, and
    alpha_c = half the compute time when a single batch size was seen. Untried scale-ups hence
    look perfect, which is what makes the scheduler explore them.

    Rows with a non-finite or non-positive time are measurement glitches and are dropped (logged);
    rows with an impossible configuration (gpus < nodes, m < 1, s < 0) raise ValueError, and so
    does a set with no usable row: never a silent NaN model.
    """
    data = _observation_array(observations)
    if data.size == 0:
        raise FitError("no observations to fit a throughput model from")
    nodes, gpus, m, s, t_iter, t_grad = data.T
    bad_config = ~np.isfinite(data[:, :4]).all(axis=1) | (nodes < 1) | (gpus < nodes) | (m < 1) | (s < 0)
    if bad_config.any():
        row = int(np.flatnonzero(bad_config)[0])
        raise ValueError(
            f"observation {row} has an impossible configuration: "
            f"nodes={nodes[row]}, gpus={gpus[row]}, m={m[row]}, s={s[row]}"
        )
    usable = np.isfinite(t_iter) & (t_iter > 0)
    if not usable.all():
        log.warning(
            "dropping %d of %d observations with a non-finite or non-positive iteration time",
            int((~usable).sum()),
            len(data),
        )
    data = data[usable]
    if len(data) == 0:
        raise FitError("no observation has a finite, positive iteration time")
    data[~(np.isfinite(data[:, 5]) & (data[:, 5] > 0)), 5] = math.nan  # unusable compute times: unknown
    nodes, gpus, m, s, t_iter, t_grad = data.T

    # Per-micro-batch compute time: measured, or bounded by the iteration time spread over micro-batches.
    compute = np.where(np.isfinite(t_grad), t_grad, t_iter / (s + 1))
    single = gpus == 1
    base = compute[single] if single.any() else compute
    scale = float(np.median(base))
    m_scale = float(np.median(m))

    fixed = np.zeros(7, dtype=bool)
    values = np.zeros(7)
    one_node_multi = (nodes == 1) & (gpus > 1)
    if not one_node_multi.any():
        fixed[[2, 3]] = True
    if not (nodes > 1).any():
        fixed[[4, 5]] = True
    if not (gpus > 2).any():
        fixed[[3, 5]] = True
    if not (gpus > 1).any():
        fixed[6], values[6] = True, 1.0
    if np.unique(m).size == 1:
        fixed[0], values[0] = True, float(np.mean(compute)) / 2

    theta0 = np.array([scale / 2, scale / (2 * m_scale), scale / 4, scale / 40, scale / 2, scale / 20, 2.0])
    theta0[fixed] = values[fixed]
    # Optimise in units of theta0 so that every coordinate is O(1) for L-BFGS-B.
    unit = np.where(theta0 > 0, theta0, 1.0)
    lower = np.array([1e-8 * scale, 0, 0, 0, 0, 0, GAMMA_BOUNDS[0]])
    upper = np.array([np.inf] * 6 + [GAMMA_BOUNDS[1]])
    bounds = [(v / u, v / u) if f else (lo / u, hi / u) for v, f, lo, hi, u in zip(values, fixed, lower, upper, unit)]

    error = _SquaredLogError(data, fixed, values)

    def objective(x):
        loss, grad = error(x * unit)
        return loss, grad * unit

    with _BLAS.limit(limits=1, user_api="blas"):
        result = minimize(
            objective,
            theta0 / unit,
            jac=True,
            method="L-BFGS-B",
            bounds=bounds,
            options={"ftol": 1e-13, "gtol": 1e-10, "maxiter": 500},
        )
    theta = np.where(fixed, values, result.x * unit)
    if not np.isfinite(theta).all():
        raise FitError(f"throughput fit diverged ({result.message}); observations: {len(data)}")
    return ThroughputParams(*(float(v) for v in theta))
