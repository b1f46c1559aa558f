"""The greedy path for huge models: sampled prices, a regret assignment and a greedy fill.

Past `policies.sia_ilp.HUGE_MODEL_ENTRIES` entries (thousands of jobs: sia-hetero-16384 with 10,000
jobs has 100,000+), the LP relaxation alone takes HiGHS 13 s, and the coordinate ascent stalls far
from its optimum (a non-smooth dual: on the first round at 16,384 GPUs its bound was 1.6% of the
cost below the LP's). There:
1. Prices: the LP relaxation's duals on `PRICE_SAMPLE_JOBS` jobs drawn at random (a fixed seed),
   each type's capacity scaled by the share of jobs drawn: with thousands of jobs sharing three
   capacities the clearing price of a GPU type is a property of the population, which a few
   hundred jobs already show (on that round the sample's duals equal the full LP's to 4 digits).
2. An allocation at those prices: the jobs in order of regret (how much more their second-best
   reduced cost is than their best; leaving out counts as 0), each its entry of least reduced
   cost that fits in what is left; then a greedy fill (`_greedy_fill`) of what is idle. Also the
   greedy fill from an empty cluster; the cheaper of the two is the answer.
3. Its cost U is within U - L(mu) of the optimum (L, the Lagrangian bound of large.py, is below
   every allocation's cost): `IlpSolution.gap` reports it.
"""

from __future__ import annotations

import logging

import numpy as np

from policies.sia_ilp.exact import SolverFailure, lp_prices
from policies.sia_ilp.large import lagrangian, price_ascent
from policies.sia_ilp.reduced import Reduced

log = logging.getLogger(__name__)

GREEDY_PASSES = 32  # each job moves at most once a pass
PRICE_SAMPLE_JOBS = 400  # jobs whose LP relaxation prices a huge model


def _greedy_fill(m: Reduced, pick: np.ndarray | None = None) -> np.ndarray:
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


def _sampled_prices(m: Reduced, deadline: float) -> np.ndarray:
    """Capacity prices: the LP relaxation's duals on a random sample of the jobs, each capacity
    scaled by the sample's share (the coordinate ascent's when the LP gives none)."""
    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(m.jobs, min(PRICE_SAMPLE_JOBS, m.jobs), replace=False))
    renumber = np.full(m.jobs, -1, dtype=np.int64)
    renumber[sample] = np.arange(sample.size)
    keep = renumber[m.job] >= 0
    small = Reduced(
        renumber[m.job[keep]],
        m.config[keep],
        m.cost[keep],
        m.gpus[keep],
        m.kind[keep],
        m.free * sample.size / m.jobs,
        sample.size,
    )
    try:
        return lp_prices(small, np.arange(small.job.size), deadline)[0][: m.types]
    except SolverFailure as failure:
        log.info("sia ILP: sampled LP prices unavailable (%s); using the ascent's", failure.status)
        return price_ascent(m)[: m.types]


def _regret_assignment(m: Reduced, mu: np.ndarray) -> np.ndarray:
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


def solve_huge(m: Reduced, deadline: float) -> tuple[np.ndarray, float]:
    """The cheaper of the priced and the plain greedy allocations, and its gap bound U - L(mu) >= 0."""
    mu = _sampled_prices(m, deadline)
    bound, _ = lagrangian(m, np.concatenate([mu, np.zeros(m.prices - m.types)]))
    answers = [_greedy_fill(m, _regret_assignment(m, mu)), _greedy_fill(m)]
    costs = [float(np.sum(m.cost[pick[pick >= 0]])) for pick in answers]
    pick = answers[int(np.argmin(costs))]
    return pick[pick >= 0], max(min(costs) - bound, 0.0)
