"""The `sia` policy: Sia's ILP over the round's normalised goodput matrix (DESIGN §4).

The matrix already holds Sia's scaling rules (new jobs at one GPU, at most twice the most a job
ever had, never below its minimum, rigid jobs at their GPU count, strong-scaling jobs at their
batch). This module adds what the ILP needs from the jobs' histories: the restart factor
r_i = max(T_i - N_i * S_i, 0) / (T_i + S_i) (1 while the job is younger than S_i, as Sia's code has
it: the factor steps from 1 to about 1/2 at T_i = S_i), applied to
every column but a running job's current one (a waiting job starts wherever it goes, so it pays
nothing extra), and the lock that keeps a job mid-restart where it is.

With teams (`RoundState.teams`), the ILP holds each team's guarantee and borrowing limits, and weighs
each job by its team's weight and its priority within the team (policies/teams.py).

Hybrid-parallel jobs (Sia §5.3) need nothing more here: the matrix holds only the configurations
whose nodes take whole model-parallel groups, valued at their replicas.
"""

from __future__ import annotations

import math

import numpy as np

from policies.base import Decision, Prediction, RoundState, restart_factor
from policies.sia_ilp import DEFAULT_TIME_LIMIT_S, solve
from policies.sia_ilp.exact import DEFAULT_SOLVER
from policies.sia_ilp.problem import DEFAULT_LAMBDA, DEFAULT_P, IlpProblem
from policies.table import BatchCache, GoodputTable, goodput_table, usable_columns
from policies.teams import borrowed_gpus, ilp_teams
from shared.settings import ROUND_S


class SiaPolicy:
    name = "sia"
    adaptive_batch = True
    honours_teams = True  # inside the ILP: policies/sia_ilp/team_guarantees.py

    def __init__(
        self,
        p: float = DEFAULT_P,
        lam: float = DEFAULT_LAMBDA,
        solver: str = DEFAULT_SOLVER,
        time_limit_s: float = DEFAULT_TIME_LIMIT_S,
        round_s: float = ROUND_S,
        max_wait_s: float = math.inf,
    ):
        if round_s <= 0:
            raise ValueError(f"round_s must be positive, got {round_s}")
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be positive seconds, got {max_wait_s}")
        self.p, self.lam, self.solver, self.time_limit_s, self.round_s = p, lam, solver, time_limit_s, float(round_s)
        # The operator's bound on a wait (not Sia's): a job that waited longer must run, and the ILP
        # makes room for it by leaving out a running one (a rigid job holding the cluster, say).
        self.max_wait_s = float(max_wait_s)
        # The last round's best batches, by job model and configuration (policies/table.py).
        self.batch_cache = BatchCache()

    def problem(self, state: RoundState) -> IlpProblem:
        table, jobs = ilp_table(state, self.batch_cache), state.jobs
        types = list(state.cluster.gpu_types)
        index = {c: j for j, c in enumerate(table.configs)}
        current = np.array([index.get(v.current, -1) if v.current is not None else -1 for v in jobs], dtype=int)
        running_valid = np.array([c >= 0 and bool(table.valid[i, c]) for i, c in enumerate(current)], dtype=bool)
        waited = np.array(
            [
                0.0
                if v.current is not None
                else state.now_s - (v.submit_s if v.idle_since_s is None else v.idle_since_s)
                for v in jobs
            ]
        )
        return IlpProblem(
            goodput=table.normalized,
            valid=table.valid,
            current=current,
            # A waiting job must (re)start wherever it goes: only running jobs pay for a move.
            restart_factor=np.where(
                [v.current is not None for v in jobs],
                restart_factor(
                    [v.age_s for v in jobs],
                    [v.restarts for v in jobs],
                    [v.restart_cost_s for v in jobs],
                    free_while_young=True,
                ),
                1.0,
            ),
            locked=np.array([v.mid_restart for v in jobs], dtype=bool) & running_valid & ~borrowing(state),
            config_type=np.array([types.index(c.gpu_type) for c in table.configs], dtype=int),
            config_gpus=np.array([c.gpus for c in table.configs], dtype=int),
            capacity=np.array([state.cluster.capacity(t) for t in types], dtype=int),
            waited=waited,
            must_run=waited > self.max_wait_s if math.isfinite(self.max_wait_s) else None,
            **ilp_teams(state),
        )

    def allocate(self, state: RoundState) -> Decision:
        if not state.jobs:
            return Decision({})
        problem = self.problem(state)
        solution = solve(problem, self.p, self.lam, self.solver, self.time_limit_s)
        configs = ilp_table(state).configs
        allocations = {v.job_id: configs[c] for v, c in zip(state.jobs, solution.choice) if c >= 0}
        events = (f"sia: previous allocation kept ({solution.status})",) if solution.fallback else ()
        return Decision(
            allocations,
            events=events,
            predictions=self.predictions(state, problem, solution.choice),
            objective=solution.objective,
        )

    @staticmethod
    def predictions(state: RoundState, problem: IlpProblem, choice: np.ndarray) -> dict[str, Prediction]:
        """What the matrix said of each job's chosen cell (for traces): its goodput and batch; the
        restart factor of every job, allocated or not."""
        table = ilp_table(state)
        if not table.configs:
            return {}
        rows = np.arange(len(state.jobs))
        cells = np.maximum(choice, 0)
        chosen = ((choice >= 0) & table.valid[rows, cells]).tolist()
        goodput, normalized = table.goodput[rows, cells].tolist(), table.normalized[rows, cells].tolist()
        m, s = table.m[rows, cells].tolist(), table.s[rows, cells].tolist()
        factors = np.asarray(problem.restart_factor, dtype=float).tolist()
        cells, out = cells.tolist(), {}
        for i, view in enumerate(state.jobs):
            if not chosen[i]:
                out[view.job_id] = Prediction(restart_factor=factors[i])
                continue
            config = table.configs[cells[i]]
            replicas = config.gpus // view.models.group(config.gpu_type)
            out[view.job_id] = Prediction(
                goodput=goodput[i],
                normalized_goodput=normalized[i],
                batch=replicas * m[i] * (s[i] + 1),
                per_gpu_batch=m[i],
                accumulation_steps=s[i],
                restart_factor=factors[i],
            )
        return out


def ilp_table(state: RoundState, cache: BatchCache | None = None) -> GoodputTable:
    """The goodput matrix the ILP reads: `state.table` when it was already evaluated, else the same
    matrix over the configurations some job may take or runs on (`usable_columns`), in the cluster's
    order. The columns it leaves out are invalid for every job and no job's current one, so they
    carry no entry of the ILP: the same problem, the same answer. On sia-hetero-16384 it keeps
    about 1 column in 20 (2,824 configurations, most of them n-node allocations larger than any job
    may grow to). Evaluated once a round state."""
    if "table" in state.__dict__:
        return state.table
    cached = state.__dict__.get("_ilp_table")
    if cached is None:
        models = [view.models for view in state.jobs]
        configs = state.cluster.configurations()
        running = {view.current for view in state.jobs if view.current is not None}
        columns = set(usable_columns(models, configs).tolist())
        columns.update(j for j, config in enumerate(configs) if config in running)
        cached = goodput_table(models, [configs[j] for j in sorted(columns)], cache)
        state.__dict__["_ilp_table"] = cached
    return cached


def borrowing(state: RoundState) -> np.ndarray:
    """(J,) bool: the jobs that hold GPUs of a type beyond their team's guarantee while a waiting job
    of another team that holds a guarantee of that type could run there. Such a job is not pinned
    while it restarts: the owner's guarantee comes back in the round it is wanted, and a borrower
    stopped mid-restart loses only the start it has not finished."""
    flags = np.zeros(len(state.jobs), dtype=bool)
    if state.teams is None:
        return flags
    held = {v.job_id: v.current for v in state.jobs if v.current is not None}
    lent = borrowed_gpus(state.teams, state.jobs, held)
    if not lent:
        return flags
    table = ilp_table(state)
    types = [c.gpu_type for c in table.configs]
    wanted = {
        (v.team, types[j])
        for i, v in enumerate(state.jobs)
        if v.current is None
        for j in np.flatnonzero(table.valid[i])
        if state.teams.quota(v.team, types[j]) > 0
    }
    for i, v in enumerate(state.jobs):
        if v.job_id in lent:
            flags[i] = any(t == v.current.gpu_type and team != v.team for team, t in wanted)
    return flags
