"""What a round's allocations mean for the teams: the GPUs each job holds beyond its team's guarantee,
and the reclaims a round made.

A team's GPUs of a type beyond its quota are borrowed. Which of its jobs hold them is a convention,
the same for every policy: they are attributed to the team's jobs on that type, lowest priority first,
then the most recently submitted first (the jobs a team would give up first hold the loan). A job the
file names no team for (DEFAULT_TEAM's) has a quota of 0 everywhere: all it holds is borrowed.

The policies that honour teams (`sia`, `goodput`) hold them inside their ILP
(policies/sia_ilp/team_guarantees.py); `ilp_teams` gives the ILP its team arrays. Within a team, a job's priority weighs its term
in the ILP by PRIORITY_STEP ** (its priority's rank among the team's), so the higher priority jobs
get the team's guarantee first, and equal priorities share by goodput.

A reclaim is a round in which a team that borrowed GPUs of a type before it (by its jobs' current
allocations) borrows fewer after it, while some team that used fewer GPUs of the type than its quota
before uses more now: that team took its guarantee back, and each of the borrowing team's jobs that
holds fewer GPUs of the type after the round, or none, was shrunk or stopped for it. Which of a
team's jobs give way is the policy's choice (the cheapest moves), not the attribution's: of two alike
borrowers the solver may stop the older one. `ledger` is pure; the round loops call it after any
policy's decision.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Mapping

import numpy as np

from policies.base import RoundState
from shared.schema.base import Config
from shared.schema.rounds import Reclaim
from shared.schema.teams import Teams

# A job's weight grows this much a rank of priority within its team. Leaving a job out gains at most
# lam - min A = 1.1 and at least lam - 1 = 0.1 at p = -0.5 (sia_ilp), so at 16 no growth of a
# lower-priority job outweighs starting or keeping a higher one (tests/test_team_policy.py).
PRIORITY_STEP = 16.0


def team_use(jobs_by_id: Mapping[str, object], allocations: Mapping[str, Config]) -> dict[tuple[str, str], int]:
    """(team, GPU type) -> GPUs its jobs hold under `allocations` (jobs_by_id: id -> JobView)."""
    use: dict[tuple[str, str], int] = defaultdict(int)
    for job_id, config in allocations.items():
        use[jobs_by_id[job_id].team, config.gpu_type] += config.gpus
    return dict(use)


def borrowed_gpus(teams: Teams, jobs: Iterable, allocations: Mapping[str, Config]) -> dict[str, int]:
    """Job -> GPUs it holds beyond its team's quota under `allocations` (jobs holding none left out),
    each team's excess of a type attributed to its jobs on that type lowest priority first, then the
    most recently submitted first."""
    by_group: dict[tuple[str, str], list] = defaultdict(list)
    for job in jobs:
        config = allocations.get(job.job_id)
        if config is not None:
            by_group[job.team, config.gpu_type].append(job)
    borrowed: dict[str, int] = {}
    for (team, gpu_type), members in by_group.items():
        excess = sum(allocations[j.job_id].gpus for j in members) - teams.quota(team, gpu_type)
        for job in sorted(members, key=lambda j: (j.priority, -j.submit_s, j.job_id)):
            if excess <= 0:
                break
            held = min(excess, allocations[job.job_id].gpus)
            borrowed[job.job_id] = held
            excess -= held
    return borrowed


def ledger(
    state: RoundState, allocations: Mapping[str, Config], round_number: int
) -> tuple[dict[str, int], dict[str, Reclaim]]:
    """(GPUs each job borrows after this round's `allocations`, the reclaims this round made), for a
    round with `state.teams`; ({}, {}) without teams."""
    teams = state.teams
    if teams is None:
        return {}, {}
    before = {j.job_id: j.current for j in state.jobs if j.current is not None}
    borrowed_after = borrowed_gpus(teams, state.jobs, allocations)
    jobs_by_id = {j.job_id: j for j in state.jobs}
    use_before, use_after = team_use(jobs_by_id, before), team_use(jobs_by_id, allocations)
    order = {name: i for i, name in enumerate(teams.teams)}

    def reclaimer(gpu_type: str) -> str | None:
        """The team that gained most GPUs of `gpu_type` from below its quota (ties: file order)."""
        gains = [
            (use_after.get((team, gpu_type), 0) - use_before.get((team, gpu_type), 0), -order[team], team)
            for team in teams.teams
            if use_before.get((team, gpu_type), 0) < teams.quota(team, gpu_type)
        ]
        best = max(gains, default=None)
        return best[2] if best is not None and best[0] > 0 else None

    def beyond(use: Mapping[tuple[str, str], int], team: str, gpu_type: str) -> int:
        return max(use.get((team, gpu_type), 0) - teams.quota(team, gpu_type), 0)

    reclaims: dict[str, Reclaim] = {}
    for job_id, held in before.items():
        team, gpu_type = jobs_by_id[job_id].team, held.gpu_type
        after = allocations.get(job_id)
        gpus_after = after.gpus if after is not None and after.gpu_type == gpu_type else 0
        if gpus_after >= held.gpus or beyond(use_after, team, gpu_type) >= beyond(use_before, team, gpu_type):
            continue  # not shrunk, or its team borrows no less of the type than before
        by_team = reclaimer(gpu_type)
        if by_team is not None:
            reclaims[job_id] = Reclaim(round_number, state.now_s, by_team, gpu_type, held.gpus, gpus_after)
    return borrowed_after, reclaims


def priority_weights(jobs: Iterable) -> np.ndarray:
    """(J,) PRIORITY_STEP ** (the rank of each job's priority among the distinct priorities of its
    team's jobs, 0 for the lowest): 1 for every job of a team whose jobs share one priority."""
    jobs = list(jobs)
    levels: dict[str, set[int]] = defaultdict(set)
    for job in jobs:
        levels[job.team].add(job.priority)
    rank = {team: {p: r for r, p in enumerate(sorted(ps))} for team, ps in levels.items()}
    return np.array([PRIORITY_STEP ** rank[j.team][j.priority] for j in jobs], dtype=float)


def ilp_teams(state: RoundState) -> dict[str, np.ndarray | None]:
    """The team arrays of the round's ILP (`sia_ilp.problem.IlpProblem`): job_team, team_quota and team_borrow
    (None without teams: the teams in file order, then the jobs of teams it does not name, as one
    team with no quota and no borrowing limit), and job_weight (None while every weight is 1)."""
    jobs, teams = state.jobs, state.teams
    weight = priority_weights(jobs)
    arrays: dict[str, np.ndarray | None] = dict(job_team=None, team_quota=None, team_borrow=None)
    if teams is not None:
        types = state.cluster.gpu_types
        names = list(teams.teams)
        index = {name: k for k, name in enumerate(names)}
        unnamed = len(names)  # DEFAULT_TEAM's jobs, and those of any team the file does not name
        job_team = np.array([index.get(j.team, unnamed) for j in jobs], dtype=np.int64)
        quota = [[teams.quota(n, t) for t in types] for n in names] + [[0] * len(types)]
        borrow = [[_limit(teams.borrow_limit(n, t)) for t in types] for n in names] + [[math.inf] * len(types)]
        arrays = dict(
            job_team=job_team, team_quota=np.array(quota, dtype=np.int64), team_borrow=np.array(borrow, dtype=float)
        )
        weight = weight * np.array([teams.weight(j.team) for j in jobs])
    return dict(arrays, job_weight=None if np.all(weight == 1.0) else weight)


def _limit(limit: int | None) -> float:
    return math.inf if limit is None else float(limit)
