"""The priced path for large models: prices, reduced costs, a restricted MILP and its optimality proof.

For prices mu >= 0 on the capacity rows, the Lagrangian bound

    L(mu) = sum_i min(0, min_j (c_ij + mu_t(j) g_j)) - mu . free

is <= the cost of every feasible allocation, and any allocation that gives job i entry j costs
at least L(mu) + rc_ij, with the reduced cost rc_ij = c_ij + mu_t(j) g_j - min(0, min_j' (...)) >= 0.
So once some allocation of cost U is known, entries with rc_ij > U - L(mu) are in no allocation
better than U and can be dropped. With mu near the LP optimum, U - L(mu) is tiny when many jobs
share the capacity (the LP relaxation of this multiple-choice knapsack then has at most a few
fractional jobs) and only a few percent of the entries remain. The steps: prices by coordinate
ascent on L (cheap, vectorised), polished by a few LP solves over the entries with small reduced
cost (column generation: stop once the restricted LP's value equals L, i.e. it is the full LP's
optimum); a MILP over the entries with rc <= delta gives U; if some dropped entry has
rc <= U - L, one more MILP over all entries with rc <= U - L, which is then provably optimal
(up to the solver's gap), like the direct MILP.

With teams, the prices y are those of every row after the one-configuration rows: mu (capacity),
nu (team rows u_kt - b_kt <= quota_kt - held_kt) and sigma (lending rows sum_k b_kt <= lend_t).
An entry of team k and type t then pays mu_t + nu_kt a GPU, and the borrows add
sum_kt borrow_kt * min(0, sigma_t - nu_kt) (each b_kt at the end of its box that costs least).
With nu = sigma = 0 (the price ascent's prices) this is L(mu) with the team rows dropped, still a
lower bound: dropping rows of a minimisation only lowers its optimum. The LP's duals price them.
"""

from __future__ import annotations

import logging

import numpy as np

from policies.sia_ilp.exact import SolverFailure, lp_prices, milp
from policies.sia_ilp.reduced import Reduced

log = logging.getLogger(__name__)

ASCENT_CYCLES = 6  # coordinate-ascent sweeps over the GPU types' prices
ASCENT_STEPS = 24  # bisection steps a coordinate
LP_ROUNDS = 4  # column-generation rounds of the LP relaxation
RESTRICT_DELTA = 0.02  # restricted MILP: entries with reduced cost <= this x the median |cost|
# The MILPs here stop within this relative gap (of the cost, whose size is about the sum of the
# left-out costs): at 2,048 GPUs the proof to 1e-7 took HiGHS up to 1.9 s a round, to 1e-3 at
# most 0.5 s, the objective then at most 7e-4 above the optimum (docs/policy.md, "Policy runtime").
LARGE_MIP_REL_GAP = 1e-3


def lagrangian(m: Reduced, y: np.ndarray) -> tuple[float, np.ndarray]:
    """L(y) and every entry's reduced cost, for prices y >= 0 of the rows `Reduced.prices` counts."""
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


def price_ascent(m: Reduced) -> np.ndarray:
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


def solve_large(m: Reduced, solver: str, deadline: float) -> np.ndarray:
    mu = price_ascent(m)
    bound, rc = lagrangian(m, mu)
    delta = RESTRICT_DELTA * float(np.median(-m.cost))
    sel = rc <= delta
    for _ in range(LP_ROUNDS):
        try:
            mu_lp, lp_value = lp_prices(m, np.flatnonzero(sel), deadline)
        except SolverFailure as failure:
            if failure.status.startswith("timeout"):
                raise
            log.info("sia ILP: LP prices unavailable (%s); using the ascent's", failure.status)
            break
        bound_lp, rc_lp = lagrangian(m, mu_lp)
        if bound_lp > bound:
            mu, bound, rc = mu_lp, bound_lp, rc_lp
        if bound_lp >= lp_value - 1e-9 * max(1.0, abs(lp_value)):
            break  # no dropped entry prices out: the restricted LP is the full LP's optimum
        sel |= rc_lp <= delta
    sel = rc <= delta
    chosen = milp(m, np.flatnonzero(sel), solver, deadline, LARGE_MIP_REL_GAP)
    upper = float(m.cost[chosen].sum())
    need = rc <= upper - bound + 1e-9 * max(1.0, abs(upper))
    if np.any(need & ~sel):
        log.debug(
            "sia ILP: restricted MILP not proven (gap %.3g); widening to %d entries",
            upper - bound,
            int(np.count_nonzero(need | sel)),
        )
        chosen = milp(m, np.flatnonzero(need | sel), solver, deadline, LARGE_MIP_REL_GAP)
    return chosen
