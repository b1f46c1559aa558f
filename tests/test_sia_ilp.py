"""Sia's ILP core (policies/sia_ilp/): known optima, brute force, constraints, fallbacks.

The brute force here is independent of the module: it enumerates every assignment of small
instances and scores it with its own, unrounded, copy of Sia's objective; the ILP's answer must
reach the same optimal value (not necessarily the same argmax: ties are possible).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import subprocess
import sys
from pathlib import Path

import cvxpy as cp
import highspy
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import sia_ilp
from policies.sia_ilp import exact, solve
from policies.sia_ilp.problem import VALUE_CLIP, IlpProblem, IlpSolution, objective, value_matrix

LAM = 1.1


def problem(
    goodput, config_type, config_gpus, capacity, valid=None, current=None, restart=None, locked=None
) -> IlpProblem:
    goodput = np.asarray(goodput, dtype=float)
    J = goodput.shape[0]
    return IlpProblem(
        goodput=goodput,
        valid=np.isfinite(goodput) if valid is None else np.asarray(valid, dtype=bool),
        current=np.full(J, -1) if current is None else np.asarray(current),
        restart_factor=np.ones(J) if restart is None else np.asarray(restart, dtype=float),
        locked=np.zeros(J, dtype=bool) if locked is None else np.asarray(locked, dtype=bool),
        config_type=np.asarray(config_type),
        config_gpus=np.asarray(config_gpus),
        capacity=np.asarray(capacity),
    )


# --- an independent reference -------------------------------------------------------------------


def reference_objective(pr: IlpProblem, choice, p: float, lam: float = LAM) -> float:
    """Sia's objective, written out plainly (no rounding)."""
    total = 0.0
    for i, j in enumerate(choice):
        if j < 0:
            total += lam if p < 0 else -lam
            continue
        r = 1.0 if j == pr.current[i] else max(pr.restart_factor[i], 1e-3)
        total += (r * pr.goodput[i, j]) ** p
    return total


def feasible(pr: IlpProblem, choice) -> bool:
    used = np.zeros(len(pr.capacity))
    for i, j in enumerate(choice):
        pinned = pr.locked[i] and pr.current[i] >= 0
        if pinned and j != pr.current[i]:
            return False
        if j >= 0:
            if not (pr.valid[i, j] or pinned):
                return False
            used[pr.config_type[j]] += pr.config_gpus[j]
    return bool(np.all(used <= pr.capacity))


def brute_force(pr: IlpProblem, p: float, lam: float = LAM) -> float | None:
    options = []
    for i in range(pr.goodput.shape[0]):
        if pr.locked[i] and pr.current[i] >= 0:
            options.append([int(pr.current[i])])
        else:
            options.append([-1] + [int(j) for j in np.flatnonzero(pr.valid[i])])
    best = None
    for choice in itertools.product(*options):
        if not feasible(pr, choice):
            continue
        value = reference_objective(pr, choice, p, lam)
        if best is None or (value < best if p < 0 else value > best):
            best = value
    return best


def random_small(rng: np.random.Generator, jobs: int = 4) -> IlpProblem:
    """`jobs` jobs x 5 configurations over 2 GPU types (1, 2, 4 GPUs of type 0; 1, 2 of type 1)."""
    config_type = np.array([0, 0, 0, 1, 1])
    config_gpus = np.array([1, 2, 4, 1, 2])
    capacity = rng.integers(0, 7, size=2)
    speed = rng.lognormal(0, 0.5, size=(jobs, 2))[:, config_type]
    knee = rng.uniform(1, 8, size=(jobs, 1))
    raw = speed * config_gpus / (1 + (config_gpus - 1) / knee)
    valid = rng.random((jobs, 5)) < 0.75
    valid[~valid.any(axis=1), 0] = True
    goodput = np.where(valid, raw, np.nan)
    goodput = goodput / np.nanmin(goodput, axis=1, keepdims=True)
    current = np.array([rng.choice(np.flatnonzero(row)) if rng.random() < 0.6 else -1 for row in valid])
    restart = np.where(rng.random(jobs) < 0.2, 0.0, rng.uniform(0.2, 1.0, size=jobs))
    locked = (rng.random(jobs) < 0.2) & (current >= 0)
    return problem(goodput, config_type, config_gpus, capacity, valid, current, restart, locked)


def assert_consistent(pr: IlpProblem, sol: IlpSolution) -> None:
    """Valid entries only (or a pinned job's current one), one a job, capacity per type, locks kept."""
    choice = sol.choice
    assert choice.shape == (pr.jobs,)
    assert np.all((choice >= -1) & (choice < pr.configs))
    assert feasible(pr, choice), (choice, pr)


# --- hand-made instances --------------------------------------------------------------------------


def test_each_job_to_the_type_it_gains_most_on():
    # One GPU of each of two types; job 0 is 4x faster on type 0, job 1 only 1.5x.
    pr = problem([[4.0, 1.0], [1.5, 1.0]], config_type=[0, 1], config_gpus=[1, 1], capacity=[1, 1])
    for p in (-0.5, -1.0, 0.5, 1.0):
        sol = solve(pr, p=p)
        assert sol.status == "optimal" and not sol.fallback
        assert sol.choice.tolist() == [0, 1]
    assert objective(pr, [0, 1]) == pytest.approx(0.5 + 1.0)
    assert objective(pr, [1, 0]) == pytest.approx(1.0 + 1.5**-0.5, abs=1e-6)


def test_the_flexible_job_yields_the_fast_type():
    # Job 0 is equally good on both types, job 1 needs type 0: the optimum is not "first come".
    pr = problem([[2.0, 1.9], [3.0, 1.0]], config_type=[0, 1], config_gpus=[1, 1], capacity=[1, 1])
    sol = solve(pr)
    assert sol.choice.tolist() == [1, 0]
    assert reference_objective(pr, sol.choice, -0.5) == pytest.approx(brute_force(pr, -0.5), abs=1e-6)


def test_scaling_job_takes_the_gpus_when_it_gains_more_than_lambda_margin():
    # 4 GPUs, configurations of 1, 2, 4 GPUs. Job 0 scales linearly, job 1 hardly at all. At p = -0.5
    # giving job 0 all four (0.5) and leaving job 1 out (1.1) costs 1.6, less than 2 + 2 (1.66):
    # lambda = 1.1 makes an allocation better than none for each job alone, not under contention.
    pr = problem([[1.0, 2.0, 4.0], [1.0, 1.1, 1.2]], config_type=[0, 0, 0], config_gpus=[1, 2, 4], capacity=[4])
    sol = solve(pr)
    assert sol.choice.tolist() == [2, -1]
    assert objective(pr, sol.choice) == pytest.approx(1.6)
    assert brute_force(pr, -0.5) == pytest.approx(1.6)
    # Maximising (p = 1) shares instead? 4 + (-1.1) = 2.9 vs 2 + 1.1 = 3.1: yes.
    assert solve(pr, p=1.0).choice.tolist() == [1, 1]


def test_values_are_restart_discounted_rounded_and_clipped():
    pr = problem(
        [[4.0, 3.0, 1.0]], config_type=[0, 0, 0], config_gpus=[1, 2, 4], capacity=[8], current=[1], restart=[0.25]
    )
    A = value_matrix(pr, -0.5)
    assert A[0, 0] == pytest.approx(1.0)  # (0.25 * 4) ** -0.5
    assert A[0, 1] == 0.57735  # current: no discount; 3 ** -0.5 to 6 significant digits
    assert A[0, 2] == 2.0  # (0.25 * 1) ** -0.5
    big = problem([[1e6]], config_type=[0], config_gpus=[1], capacity=[1])
    assert value_matrix(big, 1.0)[0, 0] == VALUE_CLIP
    # Two decimals (the artifact's rounding) cannot tell 48 from 52 GPUs of a linear job; we can.
    lin = problem([[48.0, 52.0]], config_type=[0, 0], config_gpus=[48, 52], capacity=[64])
    a48, a52 = value_matrix(lin, -0.5)[0]
    assert np.round(a48, 2) == np.round(a52, 2) == 0.14 and a48 > a52


def test_equal_value_prefers_fewer_gpus():
    # Job 0 gains nothing from 4 GPUs over 2; job 1 is a rigid 2-GPU job. With 4 GPUs both fit only
    # if job 0 takes 2, which the tie-break toward fewer GPUs of the same type guarantees.
    pr = problem([[1.0, 2.0, 2.0], [np.nan, 1.0, np.nan]], config_type=[0, 0, 0], config_gpus=[1, 2, 4], capacity=[4])
    assert solve(pr).choice.tolist() == [1, 1]


# --- restart factor and locks ----------------------------------------------------------------


@pytest.mark.parametrize(
    "gain, restart, moves",
    [
        (1.05, 0.9, False),  # (0.9 * 1.05) ** -0.5 = 1.029 > 1: not worth a restart
        (2.0, 0.9, True),  # (0.9 * 2) ** -0.5 = 0.745 < 1
        (1.05, 1.0, True),  # no restart cost: any gain moves it
        (100.0, 0.0, False),
    ],  # r = 0 (floored at 1e-3): (0.1) ** -0.5 = 3.2, never worth it
)
def test_restart_factor_decides_whether_a_job_moves(gain, restart, moves):
    # Job 0 runs on 1 GPU of type 0 (config 0); config 1 is 2 GPUs of type 0, both free. Jobs 1 and 2
    # compete for the one GPU of type 1 (config 2), so the solver runs on the whole problem.
    pr = problem(
        [[1.0, gain, np.nan], [np.nan, np.nan, 1.0], [np.nan, np.nan, 1.5]],
        config_type=[0, 0, 1],
        config_gpus=[1, 2, 1],
        capacity=[2, 1],
        current=[0, -1, -1],
        restart=[restart, 1.0, 1.0],
    )
    sol = solve(pr)
    assert sol.status == "optimal"
    assert sol.choice[0] == (1 if moves else 0)
    assert sol.choice[1:].tolist() == [-1, 2]
    assert reference_objective(pr, sol.choice, -0.5) == pytest.approx(brute_force(pr, -0.5), abs=1e-6)


def test_locked_job_keeps_its_configuration():
    # Job 0 is mid-restart on the slow type; moving it to the fast type would be far better.
    pr = problem(
        [[100.0, 1.0], [1.0, 1.0]],
        config_type=[0, 1],
        config_gpus=[1, 1],
        capacity=[1, 1],
        current=[1, -1],
        locked=[True, False],
    )
    sol = solve(pr)
    assert sol.choice.tolist() == [1, 0]
    unlocked = solve(
        problem([[100.0, 1.0], [1.0, 1.0]], config_type=[0, 1], config_gpus=[1, 1], capacity=[1, 1], current=[1, -1])
    )
    assert unlocked.choice[0] == 0


def test_locked_job_keeps_a_configuration_no_longer_valid():
    pr = problem(
        [[np.nan, 1.0], [1.0, np.nan]],
        config_type=[0, 0],
        config_gpus=[1, 2],
        capacity=[2],
        valid=[[False, True], [True, False]],
        current=[0, -1],
        locked=[True, False],
    )
    sol = solve(pr)
    assert sol.choice.tolist() == [0, 0] and not sol.fallback
    assert_consistent(pr, sol)


def test_locked_jobs_over_capacity_keep_the_previous_allocation(caplog):
    pr = problem([[1.0], [1.0]], config_type=[0], config_gpus=[1], capacity=[1], current=[0, 0], locked=[True, True])
    with caplog.at_level(logging.WARNING, logger="policies.sia_ilp"):
        sol = solve(pr)
    assert sol.fallback and sol.status.startswith("infeasible")
    assert sol.choice.tolist() == [0, 0]
    assert "previous allocation" in caplog.text


def test_must_run_jobs_all_run_even_if_a_pinned_job_has_to_make_room():
    # Job 0 holds all 4 GPUs and has restarted so often that its restart factor is 0 (floored): under
    # Sia's lam, shrinking it for job 1 costs far more than job 1 gains, so job 1 waits. With both
    # must-run, job 0 shrinks to 3 (not left out, which would cost only lam with job 1 alone marked).
    goodput = [[1.0, 2.0, 3.0, 4.0], [1.0, 1.1, 1.2, 1.3]]
    shape = dict(config_type=[0, 0, 0, 0], config_gpus=[1, 2, 3, 4], capacity=[4], current=[3, -1], restart=[0.0, 1.0])
    waits = solve(problem(goodput, **shape))
    assert waits.choice.tolist() == [3, -1]
    pr = dataclasses.replace(problem(goodput, **shape), must_run=np.array([True, True]))
    starts = solve(pr)
    assert starts.choice.tolist() == [2, 0] and starts.status == "optimal"
    assert_consistent(pr, starts)
    assert objective(pr, [3, -1]) > objective(pr, starts.choice) == pytest.approx(reference_objective(pr, [2, 0], -0.5))
    both = solve(pr, p=0.5)  # maximisation: both run too
    assert (both.choice >= 0).all() and both.status == "optimal"
    # A must-run job that cannot fit anywhere is still left out, and the rest is solved as before.
    full = dataclasses.replace(
        problem([[1.0, 2.0], [np.nan, np.nan]], config_type=[0, 0], config_gpus=[1, 2], capacity=[2]),
        must_run=np.array([True, True]),
    )
    assert solve(full).choice.tolist() == [1, -1]
    with pytest.raises(ValueError, match="must_run"):
        dataclasses.replace(problem(goodput, **shape), must_run=np.array([0, 1]))


def test_a_shrink_floor_keeps_a_large_job_from_being_shrunk_for_a_small_gain():
    # 12 GPUs: job 0 runs on 8 (normalised goodput 8.5; 8.0 on 4), job 1 on 4 (3.6; 7.7 on 8), both
    # with restart factor 0.7. Sia prices job 0's shrink to 4 at (0.7 * 8) ** -0.5 - 8.5 ** -0.5 =
    # 0.080, less than job 1 gains on 8 (0.096): it swaps them. Floored at c = 0.5, the shrink
    # costs 8 ** -0.5 + 0.5 * (0.7 ** -0.5 - 1) - 8.5 ** -0.5 = 0.108, and both stay.
    goodput = [[1.0, 2.0, 8.0, 8.5], [1.0, 1.9, 3.6, 7.7]]
    shape = dict(config_type=[0, 0, 0, 0], config_gpus=[1, 2, 4, 8], capacity=[12], current=[3, 2], restart=[0.7, 0.7])
    sia = problem(goodput, **shape)
    assert solve(sia).choice.tolist() == [2, 3]
    floored = dataclasses.replace(sia, shrink_floor=0.5)
    kept = solve(floored)
    assert kept.choice.tolist() == [3, 2] and kept.status == "optimal"
    assert_consistent(floored, kept)
    swap = 8.0**-0.5 + 0.5 * (0.7**-0.5 - 1) + (0.7 * 7.7) ** -0.5
    assert objective(floored, [2, 3]) == pytest.approx(swap, rel=1e-5)
    assert objective(floored, [3, 2]) == pytest.approx(8.5**-0.5 + 3.6**-0.5, rel=1e-5)
    # Only shrinks are floored: a move to more goodput, a waiting job's cells and a job whose
    # goodput is below c ** (1 / p) = 4 everywhere are priced as Sia prices them.
    small = problem([[1.0, 2.0, 3.0, 3.5], [1.0, 1.9, 3.6, 7.7]], **shape)
    grow = problem(
        goodput, config_type=[0, 0, 0, 0], config_gpus=[1, 2, 4, 8], capacity=[12], current=[2, -1], restart=[0.7, 1.0]
    )
    for pr in (small, grow):
        floor = value_matrix(dataclasses.replace(pr, shrink_floor=0.5))
        assert np.array_equal(floor[1], value_matrix(pr)[1]) and floor[0, 3] == value_matrix(pr)[0, 3]
    assert np.array_equal(value_matrix(dataclasses.replace(small, shrink_floor=0.5)), value_matrix(small))
    with pytest.raises(ValueError, match="shrink_floor"):
        dataclasses.replace(sia, shrink_floor=-1.0)


def test_of_equal_waiting_jobs_the_longest_waiting_start_and_a_better_one_still_goes_first():
    # Six equal jobs want one GPU each; two GPUs. Whichever two the solver picks, with `waited` the
    # two that waited longest start: first come, first served, at the same objective.
    equal = problem(np.ones((6, 1)), config_type=[0], config_gpus=[1], capacity=[2])
    waited = np.array([5.0, 60.0, 1.0, 30.0, 120.0, 0.5])
    for p in (-0.5, 0.5):
        pr = dataclasses.replace(equal, waited=waited)
        sol = solve(pr, p=p)
        assert sorted(np.flatnonzero(sol.choice >= 0).tolist()) == [1, 4], sol
        assert objective(pr, sol.choice, p) == pytest.approx(objective(pr, solve(equal, p=p).choice, p))
        assert_consistent(pr, sol)
    # Submitted together (waited alike), the first listed start.
    together = dataclasses.replace(equal, waited=np.full(6, 60.0))
    assert sorted(np.flatnonzero(solve(together).choice >= 0).tolist()) == [0, 1]
    # A job worth more on the GPU still starts before an older one: the order only breaks ties.
    better = problem([[1.0], [1.0], [2.0]], config_type=[0], config_gpus=[1], capacity=[1])
    assert solve(dataclasses.replace(better, waited=np.array([600.0, 300.0, 1.0]))).choice.tolist() == [-1, -1, 0]
    with pytest.raises(ValueError, match="waited"):
        dataclasses.replace(equal, waited=np.ones(5))


def test_a_running_job_keeps_its_configuration_from_a_waiting_job_worth_no_more():
    # Six equal jobs want the one configuration, room for two, whichever two run now: they keep it
    # (each stop would cost a checkpoint-restart the objective does not see), however long the
    # others waited. A waiting job worth more still takes a running job's place.
    for running in ([0, 1], [2, 5], [3, 4]):
        current = np.full(6, -1)
        current[running] = 0
        for p in (-0.5, 0.5):
            pr = problem(np.ones((6, 1)), config_type=[0], config_gpus=[1], capacity=[2], current=current)
            pr = dataclasses.replace(pr, waited=np.where(current < 0, 600.0, 0.0))
            sol = solve(pr, p=p)
            assert sorted(np.flatnonzero(sol.choice >= 0).tolist()) == running, (running, p, sol)
            assert_consistent(pr, sol)
    better = problem([[1.0], [2.0]], config_type=[0], config_gpus=[1], capacity=[1], current=[0, -1])
    assert solve(better).choice.tolist() == [-1, 0]


# --- p < 0 allocates every job when capacity allows ---------------------------------------------


def test_every_job_runs_when_the_cluster_fits_everyones_best():
    rng = np.random.default_rng(7)
    for _ in range(20):
        pr = random_small(rng, jobs=6)
        # capacity for every job's largest valid configuration at once; no locks; r = 1 for jobs
        # without a configuration (Sia: r = 1 while a job is younger than its restart cost)
        need = np.zeros(2, dtype=int)
        for row in pr.valid:
            for t in (0, 1):
                need[t] += pr.config_gpus[row & (pr.config_type == t)].max(initial=0)
        restart = np.where(pr.current < 0, 1.0, pr.restart_factor)
        pr = problem(pr.goodput, pr.config_type, pr.config_gpus, need, pr.valid, pr.current, restart)
        sol = solve(pr, p=-0.5)
        assert np.all(sol.choice >= 0), sol


def test_every_job_runs_when_each_can_use_one_gpu_and_there_are_enough():
    rng = np.random.default_rng(3)
    config_type = np.array([0, 0, 1, 1, 2])
    config_gpus = np.array([1, 2, 1, 4, 1])
    for _ in range(20):
        J = int(rng.integers(5, 30))
        goodput = np.where(config_gpus == 1, rng.lognormal(0, 0.5, size=(J, 5)), np.nan)
        goodput = goodput / np.nanmin(goodput, axis=1, keepdims=True)
        capacity = rng.multinomial(J, [1 / 3] * 3) + rng.integers(0, 3, size=3)
        pr = problem(goodput, config_type, config_gpus, capacity)
        sol = solve(pr, p=-0.5)
        assert np.all(sol.choice >= 0) and sol.status == "optimal"
        assert_consistent(pr, sol)


# --- brute force ----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [-0.5, -1.0, 0.5, 1.0])
@pytest.mark.parametrize("path", ["direct", "prices"])
def test_optimal_value_matches_brute_force(p, path, monkeypatch):
    if path == "prices":  # force the large-model path (prices, restricted MILP, proof) on small ones
        monkeypatch.setattr(sia_ilp, "LARGE_MODEL_ENTRIES", 0)
        monkeypatch.setattr(sia_ilp, "GREEDY_ACCEPT_GAP", 0.0)  # the priced path, not a greedy answer
    rng = np.random.default_rng(int(abs(p) * 10) + (100 if path == "prices" else 0))
    checked = 0
    for _ in range(40):
        pr = random_small(rng)
        best = brute_force(pr, p)
        sol = solve(pr, p=p)
        if best is None:  # locked jobs alone overflow a type
            assert sol.fallback and sol.status.startswith("infeasible")
            continue
        assert sol.status == "optimal" and not sol.fallback
        assert_consistent(pr, sol)
        assert reference_objective(pr, sol.choice, p) == pytest.approx(best, abs=1e-4), (pr, sol)
        checked += 1
    assert checked >= 30


def test_price_path_matches_direct_milp_on_larger_instances(monkeypatch):
    rng = np.random.default_rng(11)
    config_type = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])
    config_gpus = np.array([1, 2, 4, 8, 12, 1, 2, 4, 8, 1, 2, 4, 8, 16])
    capacity = np.array([24, 16, 24])
    for _ in range(8):
        J = int(rng.integers(30, 80))
        speed = rng.lognormal(0, 0.5, size=(J, 3))[:, config_type]
        knee = rng.uniform(2, 32, size=(J, 1))
        raw = speed * config_gpus / (1 + (config_gpus - 1) / knee)
        valid = config_gpus <= 2 ** rng.integers(0, 5, size=(J, 1))
        goodput = np.where(valid, raw, np.nan)
        goodput = goodput / np.nanmin(goodput, axis=1, keepdims=True)
        current = np.array([rng.choice(np.flatnonzero(row)) if rng.random() < 0.3 else -1 for row in valid])
        pr = problem(goodput, config_type, config_gpus, capacity, valid, current, rng.uniform(0.5, 1, J))
        direct = solve(pr)
        monkeypatch.setattr(sia_ilp, "LARGE_MODEL_ENTRIES", 0)
        monkeypatch.setattr(sia_ilp, "GREEDY_ACCEPT_GAP", 0.0)  # the priced path, not a greedy answer
        priced = solve(pr)
        monkeypatch.setattr(sia_ilp, "LARGE_MODEL_ENTRIES", 10**9)
        assert direct.status == priced.status == "optimal"
        assert_consistent(pr, priced)
        assert objective(pr, priced.choice) == pytest.approx(objective(pr, direct.choice), abs=1e-5)


@pytest.mark.parametrize("path", ["direct", "prices"])
def test_highs_given_the_model_directly_answers_as_through_cvxpy(path, monkeypatch):
    # HiGHS is handed the model without cvxpy (compiling it cost more than solving it); every model
    # the solve builds, MILPs and LP relaxations, with and without teams, gets the same answer both ways.
    from test_team_policy import team_problem

    if path == "prices":
        monkeypatch.setattr(sia_ilp, "LARGE_MODEL_ENTRIES", 0)
        monkeypatch.setattr(sia_ilp, "GREEDY_ACCEPT_GAP", 0.0)
    built, borrows = [], []
    program = exact._program

    def recorded(m, idx, boolean):
        built.append(program(m, idx, boolean))
        borrows.append(0 if m.teams is None else m.teams.b_rows.size)
        return built[-1]

    monkeypatch.setattr(exact, "_program", recorded)
    rng = np.random.default_rng(3)
    config_type = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])
    config_gpus = np.array([1, 2, 4, 8, 12, 1, 2, 4, 8, 1, 2, 4, 8, 16])
    for k in range(6):
        solve(contended(rng))
        solve(team_problem(rng, 40 + 5 * k, config_type, config_gpus, [24, 16, 24], teams=3))
    assert {p.integers > 0 for p in built} == ({True, False} if path == "prices" else {True})
    assert max(borrows) > 0 and min(borrows) == 0
    options = exact._solver_options("HIGHS", 10.0)
    for p in built:
        direct, through = exact._highs(p, options), exact._through_cvxpy(p, "HIGHS", options)
        # the same vertex: cvxpy only clips an LP's values into their bounds (HiGHS's can pass one by 1e-16)
        assert np.allclose(direct.x, through.x, rtol=0, atol=1e-12)
        assert np.array_equal(direct.x[: p.integers] > 0.5, through.x[: p.integers] > 0.5)
        assert direct.value == pytest.approx(through.value, rel=1e-14)
        assert (direct.duals is None) == (through.duals is None) == (p.integers > 0)
        if direct.duals is not None:
            assert np.array_equal(direct.duals, through.duals)


def test_an_lp_after_many_milps_on_one_thread_still_has_its_whole_time_limit(monkeypatch):
    # The MILPs of a thread share one HiGHS object, whose clock runs on from run to run; an LP's time
    # limit counts on that clock, so an LP sharing it would stop at once once the MILPs had used its
    # limit. Solve MILPs until they have, then LP relaxations with that limit halved.
    built = []
    program = exact._program

    def recorded(m, idx, boolean):
        built.append(program(m, idx, boolean))
        return built[-1]

    monkeypatch.setattr(exact, "_program", recorded)
    rng = np.random.default_rng(5)
    solve(contended(rng))
    options = exact._solver_options("HIGHS", 10.0)
    milp = built[-1]
    while exact._milp_solvers.solver.getRunTime() < 0.2:
        exact._highs(milp, options)
    limit = exact._milp_solvers.solver.getRunTime() / 2
    relaxed = exact._Program(milp.rows, milp.cost, milp.upper, 0)
    for _ in range(3):
        answer = exact._highs(relaxed, exact._solver_options("HIGHS", limit))
        assert answer.duals is not None
    assert exact._highs(milp, exact._solver_options("HIGHS", limit)).duals is None


# --- properties on random instances -----------------------------------------------------------


@st.composite
def instances(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    J = draw(st.integers(0, 12))
    C = draw(st.integers(1, 8))
    T = draw(st.integers(1, 3))
    rng = np.random.default_rng(seed)
    config_type = rng.integers(0, T, size=C)
    config_gpus = 2 ** rng.integers(0, 4, size=C)
    capacity = rng.integers(0, 17, size=T)
    valid = rng.random((J, C)) < draw(st.floats(0.1, 1.0))
    goodput = np.where(valid, 1 + rng.random((J, C)) * config_gpus, np.nan)
    current = np.array([rng.integers(-1, C) for _ in range(J)], dtype=np.int64)
    restart = rng.random(J)
    locked = rng.random(J) < 0.15
    return problem(
        goodput.reshape(J, C), config_type, config_gpus, capacity, valid.reshape(J, C), current, restart, locked
    )


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pr=instances(), p=st.sampled_from([-0.5, -2.0, 0.5, 1.0]))
def test_constraints_hold_on_random_instances(pr, p):
    sol = solve(pr, p=p)
    if sol.fallback:
        # the only reason here: locked jobs alone exceed a type's capacity
        assert sol.status.startswith("infeasible")
        assert np.array_equal(sol.choice, pr.current)
        return
    assert sol.status == "optimal"
    assert_consistent(pr, sol)


# --- fallbacks --------------------------------------------------------------------------------


def contended(rng=None) -> IlpProblem:
    rng = np.random.default_rng(5) if rng is None else rng
    J = 40
    config_type = np.array([0, 0, 0, 0, 1, 1, 1])
    config_gpus = np.array([1, 2, 4, 8, 1, 2, 4])
    raw = rng.lognormal(0, 0.5, size=(J, 2))[:, config_type] * np.sqrt(config_gpus)
    current = np.full(J, -1)
    current[:8] = 0
    return problem(
        raw / raw.min(axis=1, keepdims=True),
        config_type,
        config_gpus,
        [8, 8],
        current=current,
        restart=rng.uniform(0.5, 1, J),
    )


@pytest.mark.parametrize("large", [False, True])
def test_timeout_keeps_previous_allocation(large, monkeypatch, caplog):
    if large:
        monkeypatch.setattr(sia_ilp, "LARGE_MODEL_ENTRIES", 0)
        monkeypatch.setattr(sia_ilp, "GREEDY_ACCEPT_GAP", 0.0)  # the priced path, not a greedy answer
    pr = contended()
    assert not solve(pr).fallback
    with caplog.at_level(logging.WARNING, logger="policies.sia_ilp"):
        sol = solve(pr, time_limit_s=1e-9)
    assert sol.fallback and sol.status.startswith("timeout"), sol.status
    assert np.array_equal(sol.choice, pr.current) and (sol.choice >= 0).sum() == 8
    assert "timeout" in caplog.text


@pytest.mark.e2e
def test_highs_scheduler_started_elsewhere_with_other_threads_still_solves():
    # HiGHS sizes one thread scheduler a process; if another user started it with a different
    # count, our one-thread request fails and must be dropped, not turned into a fallback.
    script = """
import numpy as np, highspy
h = highspy.Highs(); h.setOptionValue("output_flag", False); h.setOptionValue("threads", 2)
lp = highspy.HighsLp(); lp.num_col_ = 1; lp.col_cost_ = np.array([1.0])
lp.col_lower_ = np.array([0.0]); lp.col_upper_ = np.array([1.0]); lp.integrality_ = [highspy.HighsVarType.kInteger]
h.passModel(lp); h.run()
import test_sia_ilp as t
for _ in range(2):
    sol = t.solve(t.contended())
    print(sol.status, sol.fallback)
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["optimal False", "optimal False"], out.stdout


@pytest.mark.parametrize("error", [RuntimeError("boom"), ValueError("segfault-ish")])
def test_solver_error_keeps_previous_allocation(error, monkeypatch, caplog):
    def broken(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(highspy.Highs, "run", broken)
    pr = contended()
    with caplog.at_level(logging.WARNING, logger="policies.sia_ilp"):
        sol = solve(pr)
    assert sol.fallback and sol.status.startswith("solver_error"), sol.status
    assert np.array_equal(sol.choice, pr.current)
    assert "previous allocation" in caplog.text


@pytest.mark.parametrize(
    ("status", "reported"),
    [("kInfeasible", "infeasible"), ("kTimeLimit", "timeout"), ("kSolveError", "solver_error")],
)
def test_unsolved_status_keeps_previous_allocation(status, reported, monkeypatch):
    monkeypatch.setattr(highspy.Highs, "getModelStatus", lambda self: getattr(highspy.HighsModelStatus, status))
    pr = contended()
    sol = solve(pr)
    assert sol.fallback and sol.status.startswith(reported), sol.status
    assert np.array_equal(sol.choice, pr.current)


def test_unknown_or_missing_solver_is_a_clear_error():
    pr = contended()
    with pytest.raises(ValueError, match="unknown MILP solver 'NOPE'.*installed here: .*HIGHS"):
        solve(pr, solver="NOPE")
    for name in ("GLPK_MI", "CBC"):
        if name in cp.installed_solvers():
            assert solve(pr, solver=name).status == "optimal"
        else:
            with pytest.raises(ValueError, match=f"{name} is not installed; installed here: .*HIGHS"):
                solve(pr, solver=name)
    assert solve(pr, solver="highs").status == "optimal"


# --- input validation -------------------------------------------------------------------------


def test_p_zero_and_bad_parameters_are_rejected():
    pr = contended()
    with pytest.raises(ValueError, match="p = 0"):
        solve(pr, p=0.0)
    with pytest.raises(ValueError, match="finite"):
        solve(pr, p=float("nan"))
    with pytest.raises(ValueError, match="time_limit_s"):
        solve(pr, time_limit_s=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(valid=np.ones((2, 3), dtype=bool)), "valid has shape"),
        (dict(current=np.array([0, 0, 0])), "current has shape"),
        (dict(config_gpus=np.array([1, 2, 4])), "config_gpus has shape"),
        (dict(goodput=np.array([[1.0, np.nan], [1.0, 2.0]])), r"goodput\[0, 1\] = nan in a valid cell"),
        (dict(goodput=np.array([[1.0, 0.0], [1.0, 2.0]])), "finite and > 0"),
        (dict(capacity=np.array([2, -1])), "capacity.* is negative"),
        (dict(current=np.array([0, 2])), r"current\[1\] = 2 is out of range"),
        (dict(current=np.array([-2, 0])), r"current\[0\] = -2 is out of range"),
        (dict(restart_factor=np.array([0.5, 1.5])), r"restart_factor\[1\]"),
        (dict(restart_factor=np.array([np.nan, 1.0])), r"restart_factor\[0\]"),
        (dict(config_type=np.array([0, 2])), "not a GPU type index"),
        (dict(config_gpus=np.array([1, 0])), "at least one GPU"),
        (dict(valid=np.ones((2, 2))), "bool array"),
        (dict(current=np.array([0.0, 1.0])), "integer array"),
        (dict(goodput=np.ones(3)), "matrix"),
    ],
)
def test_invalid_problems_are_rejected(change, message):
    base = dict(
        goodput=np.array([[1.0, 2.0], [1.0, 2.0]]),
        valid=np.ones((2, 2), dtype=bool),
        current=np.array([0, -1]),
        restart_factor=np.array([1.0, 0.5]),
        locked=np.array([False, False]),
        config_type=np.array([0, 1]),
        config_gpus=np.array([1, 2]),
        capacity=np.array([2, 2]),
    )
    base.update(change)
    with pytest.raises(ValueError, match=message):
        IlpProblem(**base)


def test_nan_goodput_outside_valid_cells_is_fine_and_no_jobs_is_fine():
    pr = problem([[np.nan, 1.0]], config_type=[0, 0], config_gpus=[1, 1], capacity=[1])
    assert solve(pr).choice.tolist() == [1]
    empty = problem(np.zeros((0, 2)), config_type=[0, 0], config_gpus=[1, 2], capacity=[2])
    sol = solve(empty)
    assert sol.choice.shape == (0,) and sol.status == "optimal"
