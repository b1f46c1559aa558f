"""Ties between allocations of equal objective, settled after the solve (not Sia's).

Of two waiting jobs whose entries are worth the same, the one that waited longer starts (`waited`;
of two that waited as long, the one listed first): the solver picks among equals arbitrarily, and a
burst of equal jobs on a full cluster then ran newest first. For the same reason a running job keeps
its configuration rather than give it to a waiting job whose entry there is worth no more: the
objective does not see the restart that stopping it costs, and equal rigid jobs took turns, each
round a checkpoint-restart. Each swap leaves the objective no worse and every type's (and team's)
use the same.
"""

from __future__ import annotations

import numpy as np

from policies.sia_ilp.problem import IlpProblem


def break_ties(problem: IlpProblem, cost: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """`choice` with its left-out running jobs given back their configuration, then its waiting jobs
    started first come, first served, wherever that costs no more (`cost`: the ILP's per-entry costs)."""
    return _first_come_first_served(problem, cost, _running_keep_theirs(problem, cost, choice))


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
