"""Pollux's scheduling policy (Qiao et al., OSDI '21) as its authors coded it, adapted as Sia's port did.

A candidate solution is a jobs x nodes matrix A of GPU counts (A_jn GPUs of node n for job j). A
genetic search (single objective; Pollux ran pymoo's NSGA-II with a second, unused objective)
evolves a population of such matrices and returns the fittest:

    fitness(A)  = ( 1/J * sum_j (c * SPEEDUP_j(A_j) + EPSILON) ** p ) ** (1/p)      (p != 0)
                = exp( 1/J * sum_j log max(c * SPEEDUP_j(A_j), EPSILON) )             (p == 0)
    SPEEDUP_j   = GOODPUT_j(A_j) / GOODPUT_j(fair share)
                  x REALLOC_j   when A_j differs from the job's current row (per node, as coded),
    REALLOC_j   = max(T_j - R_j * delta, 0) / (T_j + delta)    (age T, restarts R, delta = penalty),

with c = nodes / GPUs of the cluster (their "dominant share x nodes"; it sets the speedups' scale
against EPSILON = 1e-3, which keeps the mean finite for p < 0 when a job has no GPUs (speedup 0)).
p = -1 (their default) leans hard towards giving every job something; p = 1 is utilitarian.

GOODPUT_j(A_j) is the job's best goodput over batch sizes (`goodput_train.goodput.optimize_batch`) on
K = sum_n A_jn GPUs, on one node or several (only "several" matters to the throughput model).
It is looked up, never computed, during the search: per round, one vectorised `optimize_batch`
fills a table over (job, GPU type, K, one node / several), divided by the fair-share goodput, so
that the fitness of a whole population is one fancy-index.

Fair share: F = ceil(GPUs / jobs) GPUs (as Pollux's code), on whole nodes of the type being
evaluated (several nodes iff F exceeds that type's node size; Pollux's code evaluated it on one
node whatever F). The baseline is the job's best goodput with at most F GPUs, so that a share its
batch limits cannot use (K * min per-GPU batch > max batch) still gives a finite baseline.
A job without any throughput model is optimistic: SPEEDUP = K / F (their "no hints" rule).

Search, as coded by Pollux (population 100, 100 generations, seeded from the current allocation
and the previous round's population, matched by job id and node name):
- parents by binary tournament on fitness; single-point crossover over the jobs (priority order);
- mutation: a job's row reset to its current one (probability 0.1); a job picked with probability
  0.1 has each entry zeroed with probability 0.1; an entry is raised to a random count between its
  value and its node's size with a probability driven by the free nodes and the nodes the job
  already uses;
- repair, in order: at most one distributed (multi-node) job per node, earlier jobs keep it
  (`avoid_interference`); clip each job to its GPU limit (entries trimmed in a random node order);
  node capacity by a cumulative sum over jobs in priority order; (`collapse_in_search`: one GPU
  type a job, below); zero jobs below their minimum. Priority: least attained service, then earliest submission.
- survival: offspring and parents merged, duplicates dropped, the fittest `population` kept.

Heterogeneity-unaware (Sia's port). The search treats every node alike (mutation, crossover and
repair never look at GPU types). A row's goodput is evaluated on all its GPUs with the model of the
GPU type that holds most of them (ties: `type_order`, dgx-ext > quad > rtx > aws), relative to the
fair share on that same type, so the search does not know that one type is faster than another.
The chosen solution is then collapsed to one type a job, the GPUs on nodes of other types dropped
(left idle), as Sia's simulator did with Pollux's allocations. With `collapse_in_search=True` the
collapse is part of the repair instead, so the fitness scores exactly what is returned and no GPU
is dropped (a variant, not Sia's port). On a homogeneous cluster both are plain Pollux.

Jobs mid checkpoint-restart keep their placement: their rows are pinned to the current one, go
first in the priority order (so capacity and interference repairs leave them alone), and are never
zeroed. Rigid jobs (`fixed_gpus`) get exactly that many GPUs or none; strong-scaling jobs
(`fixed_batch`) are scored on throughput at their batch, as the estimator does.

Determinism: each call draws from a generator seeded with (seed, now in ms), so a decision is a
function of the seed, the state and the population kept from the previous call (`warm_start`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Sequence

import msgspec
import numpy as np

from policies.base import (
    Decision,
    Prediction,
    RoundState,
    decision_from_placements,
    refuse_hybrid,
    refuse_teams,
    restart_factor,
)
from policies.table import stack_jobs
from shared.cluster import Cluster
from shared.schema.base import Spots
from shared.schema.rounds import JobModels
from shared.settings import ROUND_S

# Settings, in one place.
DEFAULT_P = -1.0
DEFAULT_POPULATION = 100
DEFAULT_GENERATIONS = 100
DEFAULT_RESTART_PENALTY_S = 30.0
EPSILON = 1e-3  # added to every scaled speedup (Pollux's code)
RESET_PROB = 0.1  # mutation: a row back to the job's current allocation
ZERO_ROW_PROB = 0.1  # mutation: a row picked for zeroing ...
ZERO_ENTRY_PROB = 0.1  # ... and each of its entries zeroed with this probability
# Ties of the majority GPU type: the faster type wins (Sia's port: a100 > quad > rtx > t4).
TYPE_TIE_ORDER = ("dgx-ext", "dgx", "a100", "quad", "rtx", "aws", "t4")


# --- the round's problem ---------------------------------------------------------------------


@dataclass(frozen=True)
class PolluxProblem:
    """One round as arrays; jobs in priority order (pinned first), GPU types in tie order.

    speedup: (J, T, K+1, 2) scaled speedup c * GOODPUT / fair-share GOODPUT of job j on k GPUs of
        type t, on one node (0) or several (1); before the restart factor.
    """

    job_ids: tuple[str, ...]
    node_names: tuple[str, ...]
    types: tuple[str, ...]
    node_gpus: np.ndarray  # (N,)
    node_type: np.ndarray  # (N,) index into types
    base: np.ndarray  # (J, N) current allocation
    pinned: np.ndarray  # (J,) bool: keeps `base`
    min_gpus: np.ndarray  # (J,)
    max_gpus: np.ndarray  # (J,)
    restart_factor: np.ndarray  # (J,)
    speedup: np.ndarray  # (J, T, K+1, 2)

    @property
    def shape(self) -> tuple[int, int]:
        return self.base.shape


def type_rank(types: Sequence[str], order: Sequence[str] = TYPE_TIE_ORDER) -> list[str]:
    """The cluster's GPU types, most preferred first: those in `order` by it, the rest as given."""
    known = [t for t in order if t in types]
    return known + [t for t in types if t not in known]


def goodput_lookup(jobs: Sequence[JobModels], types: Sequence[str], top: Sequence[int]) -> np.ndarray:
    """(J, T, K+1, 2) best goodput of job j on k GPUs of type t, on one node (0) or several (1),
    with K = max(top). Zero where k = 0, k > top[j], several nodes with k < 2, the job has no model
    of the type, or no batch size is feasible. One vectorised `optimize_batch` over the cells."""
    J, T, K = len(jobs), len(types), max(top, default=0)
    table = np.zeros((J, T, K + 1, 2))
    cells_j, cells_t, cells_k, cells_m = [], [], [], []
    for j, job in enumerate(jobs):
        ks = np.arange(1, top[j] + 1)
        if ks.size == 0:
            continue
        # One node for every k; several nodes for k >= 2.
        k_all = np.concatenate([ks, ks[ks >= 2]])
        m_all = np.concatenate([np.zeros(ks.size, int), np.ones(int((ks >= 2).sum()), int)])
        for t, gpu_type in enumerate(types):
            if gpu_type in job.params:
                cells_j.append(np.full(k_all.size, j))
                cells_t.append(np.full(k_all.size, t))
                cells_k.append(k_all)
                cells_m.append(m_all)
    if not cells_j:
        return table
    cj, ct, ck, cm = (np.concatenate(c) for c in (cells_j, cells_t, cells_k, cells_m))

    best = stack_jobs(jobs, types).best(cj, ct, cm + 1, ck)
    table[cj, ct, ck, cm] = best.goodput
    return table


def build_problem(
    state: RoundState,
    restart_penalty_s: float | None = DEFAULT_RESTART_PENALTY_S,
    type_order: Sequence[str] = TYPE_TIE_ORDER,
) -> PolluxProblem:
    """The round's arrays: priority order, current rows, limits, restart factors, speedup table."""
    cluster = state.cluster
    nodes = cluster.nodes
    node_index = {n.name: i for i, n in enumerate(nodes)}
    types = tuple(type_rank(cluster.gpu_types, type_order))
    node_gpus = np.array([n.gpus for n in nodes], dtype=np.int64)
    node_type = np.array([types.index(n.gpu_type) for n in nodes], dtype=np.int64)
    total = int(node_gpus.sum())

    pinned_of = {job.job_id: job.mid_restart and bool(job.placement) for job in state.jobs}
    jobs = sorted(state.jobs, key=lambda job: (not pinned_of[job.job_id], job.attained_gpu_s, job.submit_s, job.job_id))
    J, N = len(jobs), len(nodes)
    base = np.zeros((J, N), dtype=np.int64)
    for j, job in enumerate(jobs):
        for name, gpus in job.placement:
            if name in node_index:
                base[j, node_index[name]] += gpus
    pinned = np.array([pinned_of[job.job_id] for job in jobs], dtype=bool)

    limit = np.array([job.models.fixed_gpus or min(job.models.gpu_limit, total) for job in jobs], dtype=np.int64)
    max_gpus = np.where(pinned, np.maximum(limit, base.sum(axis=1)), limit)
    min_gpus = np.array([job.models.fixed_gpus or job.models.min_gpus for job in jobs], dtype=np.int64)
    penalty = [job.restart_cost_s if restart_penalty_s is None else restart_penalty_s for job in jobs]
    factor = restart_factor([job.age_s for job in jobs], [job.restarts for job in jobs], penalty)

    # Fair share on whole nodes of each type; the table must reach it as well as each job's limit.
    fair = max(1, min(total, math.ceil(total / max(J, 1))))
    per_node = np.array([cluster.gpus_per_node(t) for t in types])
    top = [int(max(m, fair)) for m in max_gpus]
    goodput = goodput_lookup([job.models for job in jobs], types, top)
    ks = np.arange(fair + 1)
    several = (ks[None, :] > per_node[:, None]).astype(int)  # (T, F+1)
    at_most_fair = goodput[:, np.arange(len(types))[:, None], ks[None, :], several]  # (J, T, F+1)
    baseline = at_most_fair.max(axis=2)  # (J, T)
    with np.errstate(divide="ignore", invalid="ignore"):
        speedup = np.where(baseline[:, :, None, None] > 0, goodput / baseline[:, :, None, None], 0.0)
    # No model at all: optimistic, K / F on any type and span.
    hintless = np.array([not job.models.params for job in jobs], dtype=bool)
    if hintless.any():
        k_over_fair = np.arange(goodput.shape[2]) / fair
        speedup[hintless] = k_over_fair[None, None, :, None]
    speedup *= N / total

    return PolluxProblem(
        tuple(job.job_id for job in jobs),
        tuple(n.name for n in nodes),
        types,
        node_gpus,
        node_type,
        base,
        pinned,
        min_gpus,
        max_gpus,
        factor,
        speedup,
    )


# --- the search ---------------------------------------------------------------------------------


class Search:
    """Vectorised genetic operators over a population of (P, J, N) matrices of one problem."""

    def __init__(
        self,
        problem: PolluxProblem,
        rng: np.random.Generator,
        p: float,
        avoid_interference: bool = True,
        collapse_in_search: bool = False,
    ):
        self.problem = problem
        self.rng = rng
        self.p = p
        self.avoid_interference = avoid_interference
        self.collapse_in_search = collapse_in_search
        J, N = problem.shape
        T = len(problem.types)
        self.onehot = (problem.node_type[:, None] == np.arange(T)[None, :]).astype(np.int16)  # (N, T)
        # Entries are GPUs of one node: int8 unless a node has more than 127 GPUs.
        self.dtype = np.int8 if problem.node_gpus.max(initial=0) <= np.iinfo(np.int8).max else np.int16
        self.base = problem.base.astype(self.dtype)
        self.node_gpus = problem.node_gpus.astype(self.dtype)
        self.k_max = problem.speedup.shape[2] - 1
        self.flat_speedup = problem.speedup.reshape(-1)
        self.row_offset = (np.arange(J) * T)[None, :]  # (1, J)

    # Majority type of each row: most GPUs, ties to the preferred type (types are in tie order).
    def majority(self, states: np.ndarray) -> np.ndarray:
        if self.onehot.shape[1] == 1:
            return np.zeros(states.shape[:2], dtype=np.int64)
        return np.argmax(states @ self.onehot, axis=2)

    def collapse(self, states: np.ndarray) -> np.ndarray:
        """Rows restricted to the nodes of their majority type."""
        if self.onehot.shape[1] == 1:
            return states
        keep = self.problem.node_type[None, None, :] == self.majority(states)[:, :, None]
        return np.where(keep, states, 0)

    def repair(self, states: np.ndarray) -> np.ndarray:
        pr = self.problem
        pinned = pr.pinned
        states = states.copy()
        states[:, pinned] = self.base[pinned]
        # (1) At most one distributed job per node; earlier jobs keep the node, pinned rows are kept.
        if self.avoid_interference:
            distributed = np.count_nonzero(states, axis=2) > 1
            on_node = (states > 0) & distributed[:, :, None]
            clash = (np.cumsum(on_node, axis=1, dtype=np.int32) > 1) & on_node & ~pinned[None, :, None]
            states[clash] = 0
        # (2) At most the job's GPU limit, entries trimmed in a random node order.
        over = states.sum(axis=2) > pr.max_gpus[None, :]
        if over.any():
            rows = states[over]  # (R, N)
            order = np.argsort(self.rng.random(rows.shape), axis=1)
            shuffled = np.take_along_axis(rows, order, axis=1)
            limit = np.broadcast_to(pr.max_gpus[None, :], over.shape)[over][:, None]
            clipped = _steps(np.minimum(np.cumsum(shuffled, axis=1, dtype=np.int32), limit), axis=1)
            back = np.empty_like(clipped)
            np.put_along_axis(back, order, clipped, axis=1)
            states[over] = back
        # (3) Node capacity, by a cumulative sum over jobs in priority order.
        filled = np.minimum(np.cumsum(states, axis=1, dtype=np.int32), self.node_gpus[None, None, :])
        states = _steps(filled, axis=1).astype(self.dtype)
        # (4) One GPU type a job.
        if self.collapse_in_search:
            states = self.collapse(states)
        # (5) Jobs below their minimum get nothing.
        below = states.sum(axis=2) < pr.min_gpus[None, :]
        states[below & ~pinned[None, :]] = 0
        return states

    def speedups(self, states: np.ndarray, restarts: bool = True) -> np.ndarray:
        """(P, J) scaled speedups, the restart factor applied to changed rows (unless `restarts` is False)."""
        k = np.minimum(states.sum(axis=2), self.k_max)
        several = (np.count_nonzero(states, axis=2) > 1).astype(np.int64)
        t = self.majority(states)
        index = ((self.row_offset + t) * (self.k_max + 1) + k) * 2 + several
        value = self.flat_speedup[index]
        if not restarts:
            return value
        changed = np.any(states != self.base[None], axis=2)
        return np.where(changed, value * self.problem.restart_factor[None, :], value)

    def fitness(self, states: np.ndarray) -> np.ndarray:
        return power_mean(self.speedups(states), self.p)

    def crossover(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Single point over jobs: two children per pair of parents."""
        J = a.shape[1]
        point = self.rng.integers(J, size=(a.shape[0], 1, 1))
        first = np.arange(J)[None, :, None] < point
        return np.concatenate([np.where(first, a, b), np.where(first, b, a)])

    def mutate(self, states: np.ndarray) -> np.ndarray:
        rng = self.rng
        P, J, N = states.shape
        # (1) Back to the current allocation.
        reset = rng.random((P, J), dtype=np.float32) < RESET_PROB
        states = np.where(reset[:, :, None], self.base[None], states)
        # (2) Zero some entries of some rows.
        picked = rng.random((P, J), dtype=np.float32) < ZERO_ROW_PROB
        if picked.any():
            rows = states[picked]
            states[picked] = np.where(rng.random(rows.shape, dtype=np.float32) < ZERO_ENTRY_PROB, 0, rows)
        # (3) Raise entries of nodes with a free GPU, as coded: each job with probability 1/J (prob1),
        # or one of the jobs already on the node (prob2); to a count up to the node's size.
        has_free = self.node_gpus[None, :] > states.sum(axis=1)  # (P, N)
        used = (states > 0) & has_free[:, None, :]
        share = np.float32(1 - 1 / J) / np.maximum(used.sum(axis=1), 1).astype(np.float32)  # (P, N)
        # prob1 + prob2 - prob1 * prob2 with prob1 = 1/J on free nodes, prob2 = 1/(jobs on it) if used.
        prob = np.where(used, np.float32(1 / J) + share[:, None, :], has_free[:, None, :] * np.float32(1 / J))
        raise_ = rng.random(states.shape, dtype=np.float32) < prob
        low = states[raise_]
        high = np.broadcast_to(self.node_gpus[None, None, :], states.shape)[raise_]
        states[raise_] = rng.integers(low, high.astype(np.int64) + 1)
        return states

    def run(self, initial: np.ndarray, population: int, generations: int) -> tuple[np.ndarray, np.ndarray]:
        """The final population, fittest first, and its fitness."""
        states = self.repair(initial)
        states, fit = self.survive(states, self.fitness(states), population)
        pairs = max(1, population // 2)
        for _ in range(generations):
            # Binary tournaments pick 2 parents for each pair.
            duel = self.rng.integers(len(states), size=(2 * pairs, 2))
            winner = np.where(fit[duel[:, 0]] >= fit[duel[:, 1]], duel[:, 0], duel[:, 1])
            children = self.crossover(states[winner[:pairs]], states[winner[pairs:]])
            children = self.repair(self.mutate(children))
            merged = np.concatenate([states, children])
            states, fit = self.survive(merged, np.concatenate([fit, self.fitness(children)]), population)
        return states, fit

    @staticmethod
    def survive(states: np.ndarray, fit: np.ndarray, population: int) -> tuple[np.ndarray, np.ndarray]:
        """Distinct solutions, fittest first (ties: earlier first), at most `population`."""
        flat = np.ascontiguousarray(states.reshape(len(states), -1))
        rows = flat.view(np.dtype((np.void, flat.shape[1] * flat.itemsize))).ravel()
        _, first = np.unique(rows, return_index=True)
        first.sort()
        order = first[np.argsort(-fit[first], kind="stable")][:population]
        return states[order], fit[order]


def _steps(cumulative: np.ndarray, axis: int) -> np.ndarray:
    """The inverse of a cumulative sum along `axis` (np.diff with a 0 prepended, without its copies)."""
    out = cumulative.copy()
    head = [slice(None)] * cumulative.ndim
    tail = list(head)
    head[axis], tail[axis] = slice(1, None), slice(None, -1)
    np.subtract(cumulative[tuple(head)], cumulative[tuple(tail)], out=out[tuple(head)])
    return out


def power_mean(values: np.ndarray, p: float) -> np.ndarray:
    """Pollux's power mean over the last axis, EPSILON added to every term (floored at it for p = 0)."""
    if p == 0:
        return np.exp(np.mean(np.log(np.maximum(values, EPSILON)), axis=-1))
    return np.mean((values + EPSILON) ** p, axis=-1) ** (1.0 / p)


# --- the policy -------------------------------------------------------------------------------------


class _Population(msgspec.Struct, array_like=True):
    jobs: tuple[str, ...]
    nodes: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    states: bytes


class PolluxPolicy:
    """Pollux's population search over per-node allocations, heterogeneity-unaware (see module doc)."""

    name = "pollux"
    adaptive_batch = True
    honours_teams = False  # refuses a round with teams (policies.base.refuse_teams)

    def __init__(
        self,
        p: float = DEFAULT_P,
        population: int = DEFAULT_POPULATION,
        generations: int = DEFAULT_GENERATIONS,
        restart_penalty_s: float | None = DEFAULT_RESTART_PENALTY_S,
        seed: int = 0,
        avoid_interference: bool = True,
        collapse_in_search: bool = False,
        warm_start: bool = True,
        type_order: Sequence[str] = TYPE_TIE_ORDER,
        round_s: float = ROUND_S,
    ):
        """restart_penalty_s: delta of the re-allocation factor (None: each job's own restart_cost_s)."""
        if population < 1 or generations < 0 or round_s <= 0:
            raise ValueError(
                f"population must be >= 1, generations >= 0 and round_s > 0, got {population}, {generations}, {round_s}"
            )
        self.round_s = float(round_s)
        self.p = float(p)
        self.population = int(population)
        self.generations = int(generations)
        self.restart_penalty_s = restart_penalty_s
        self.seed = int(seed)
        self.avoid_interference = avoid_interference
        self.collapse_in_search = collapse_in_search
        self.warm_start = warm_start
        self.type_order = tuple(type_order)
        self._previous: tuple[tuple[str, ...], tuple[str, ...], np.ndarray] | None = None

    def allocate(self, state: RoundState) -> Decision:
        refuse_hybrid(self.name, state.jobs)
        refuse_teams(self.name, state)
        if not state.jobs:
            self._previous = None
            return Decision({}, {})
        problem = build_problem(state, self.restart_penalty_s, self.type_order)
        rng = np.random.default_rng([self.seed, max(0, int(round(state.now_s * 1000)))])
        search = Search(problem, rng, self.p, self.avoid_interference, self.collapse_in_search)
        initial = np.concatenate([search.base[None], self._adapt_previous(problem, search.dtype)])
        states, fit = search.run(initial, self.population, self.generations)
        if self.warm_start:
            self._previous = (problem.job_ids, problem.node_names, states)
        best = search.collapse(states[:1])
        # What the collapse left below a job's minimum, and GPUs a job is predicted to make no progress
        # on (no model of the type, no feasible batch), stay free.
        speedup = search.speedups(best, restarts=False)
        useless = (best.sum(axis=2) < problem.min_gpus) | (speedup <= 0)
        best[useless & ~problem.pinned] = 0
        decision = self._decision(state.cluster, problem, best[0])
        # For traces: each job's predicted speedup over its fair share (without the search's scale c =
        # nodes / GPUs), and its re-allocation factor.
        kept = (~useless[0] | problem.pinned).tolist()
        scale = float(problem.node_gpus.sum()) / max(len(problem.node_names), 1)
        factors, speedups = problem.restart_factor.tolist(), (speedup[0] * scale).tolist()
        return replace(
            decision,
            predictions={
                job: Prediction(
                    speedup=speedups[j] if kept[j] and job in decision.allocations else None, restart_factor=factors[j]
                )
                for j, job in enumerate(problem.job_ids)
            },
        )

    def snapshot(self) -> bytes:
        """The last round's population (mostly zeros: compressed), for a standby to resume from."""
        if self._previous is None:
            return b""
        jobs, nodes, states = self._previous
        return msgspec.msgpack.encode(
            _Population(jobs, nodes, states.dtype.str, states.shape, zlib.compress(states.tobytes(), 1))
        )

    def restore(self, state: bytes) -> None:
        saved = msgspec.msgpack.decode(state, type=_Population)
        states = np.frombuffer(zlib.decompress(saved.states), dtype=np.dtype(saved.dtype)).reshape(saved.shape)
        self._previous = (saved.jobs, saved.nodes, states.copy())

    def _adapt_previous(self, problem: PolluxProblem, dtype: np.dtype) -> np.ndarray:
        """The previous round's population on this round's jobs and nodes (new jobs: empty rows)."""
        J, N = problem.shape
        if self._previous is None:
            return np.zeros((0, J, N), dtype=dtype)
        jobs, nodes, states = self._previous
        job_at = {key: i for i, key in enumerate(jobs)}
        node_at = {key: i for i, key in enumerate(nodes)}
        dst_j = [j for j, key in enumerate(problem.job_ids) if key in job_at]
        src_j = [job_at[problem.job_ids[j]] for j in dst_j]
        dst_n = [n for n, key in enumerate(problem.node_names) if key in node_at]
        src_n = [node_at[problem.node_names[n]] for n in dst_n]
        adapted = np.zeros((len(states), J, N), dtype=dtype)
        adapted[:, np.array(dst_j, dtype=np.int64)[:, None], np.array(dst_n, dtype=np.int64)[None, :]] = states[
            :, np.array(src_j, dtype=np.int64)[:, None], np.array(src_n, dtype=np.int64)[None, :]
        ]
        return adapted

    @staticmethod
    def _decision(cluster: Cluster, problem: PolluxProblem, row_matrix: np.ndarray) -> Decision:
        placements: dict[str, Spots] = {}
        for j, job_id in enumerate(problem.job_ids):
            used = np.flatnonzero(row_matrix[j])
            if used.size:
                placements[job_id] = tuple(sorted((problem.node_names[n], int(row_matrix[j, n])) for n in used))
        return decision_from_placements(cluster, placements)
