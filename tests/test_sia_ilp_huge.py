"""The huge-model path of Sia's ILP (policies/sia_ilp/huge.py): sampled prices, a regret
assignment and a greedy fill, with a bound on its distance from the optimum."""

from __future__ import annotations

import numpy as np

from policies import sia_ilp
from policies.sia_ilp import solve
from policies.sia_ilp.problem import IlpProblem, objective


def contended(seed: int, jobs: int, scale: int = 1, running: float = 0.4) -> IlpProblem:
    """`jobs` jobs on three GPU types (16, 8 and 16 GPUs, times `scale`), a share `running` of them
    running, every job must-run for odd seeds."""
    rng = np.random.default_rng(seed)
    config_type = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])
    config_gpus = np.array([1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8, 16])
    speed = rng.lognormal(0, 0.5, size=(jobs, 3))[:, config_type]
    knee = rng.uniform(2, 32, size=(jobs, 1))
    raw = speed * config_gpus / (1 + (config_gpus - 1) / knee)
    valid = config_gpus <= 2 ** rng.integers(0, 5, size=(jobs, 1))
    goodput = np.where(valid, raw, np.nan)
    goodput = goodput / np.nanmin(goodput, axis=1, keepdims=True)
    current = np.array([rng.choice(np.flatnonzero(row)) if rng.random() < running else -1 for row in valid])
    return IlpProblem(
        goodput=goodput,
        valid=valid,
        current=current,
        restart_factor=rng.uniform(0.3, 1, jobs),
        locked=(rng.random(jobs) < 0.1) & (current >= 0),
        config_type=config_type,
        config_gpus=config_gpus,
        capacity=np.array([16, 8, 16]) * scale,
        must_run=np.ones(jobs, dtype=bool) if seed % 2 else None,
        waited=np.where(current < 0, rng.uniform(0, 600, jobs), 0.0),
    )


def test_the_greedy_answer_is_feasible_and_within_its_gap_bound(monkeypatch):
    greedy = 0
    for seed in range(6):
        pr = contended(seed, 60)
        exact = solve(pr)
        monkeypatch.setattr(sia_ilp, "HUGE_MODEL_ENTRIES", 0)
        fast = solve(pr)
        monkeypatch.undo()
        assert exact.status == "optimal" and exact.gap == 0
        # "optimal" when its bound proves it (gap 0)
        assert fast.status in ("greedy", "optimal") and not fast.fallback and fast.gap >= 0
        greedy += fast.status == "greedy"
        choice = fast.choice
        on = choice >= 0
        assert np.all(pr.valid[np.flatnonzero(on), choice[on]] | pr.pinned[on])
        assert np.all(choice[pr.pinned] == pr.current[pr.pinned])
        used = np.bincount(pr.config_type[choice[on]], weights=pr.config_gpus[choice[on]], minlength=3)
        assert np.all(used <= pr.capacity)
        # Never better than the optimum, and no further from it than its bound says.
        assert objective(pr, choice) >= objective(pr, exact.choice) - 1e-6
        assert objective(pr, choice) - objective(pr, exact.choice) <= fast.gap + 1e-6
    assert greedy >= 2


def test_the_greedy_path_is_close_to_the_optimum_with_many_jobs(monkeypatch):
    pr = contended(3, 200, scale=5, running=0.1)
    exact = solve(pr)
    monkeypatch.setattr(sia_ilp, "HUGE_MODEL_ENTRIES", 0)
    fast = solve(pr)
    assert fast.status in ("greedy", "optimal")
    assert objective(pr, fast.choice) <= 1.02 * objective(pr, exact.choice)


def test_a_large_model_takes_the_greedy_answer_only_within_its_acceptance(monkeypatch):
    monkeypatch.setattr(sia_ilp, "LARGE_MODEL_ENTRIES", 0)
    for seed in range(4):
        pr = contended(seed, 60)
        monkeypatch.setattr(sia_ilp, "GREEDY_ACCEPT_GAP", 0.0)
        exact = solve(pr)
        assert exact.status == "optimal" and exact.gap == 0
        monkeypatch.setattr(sia_ilp, "GREEDY_ACCEPT_GAP", 1e-4)
        fast = solve(pr)
        assert not fast.fallback and fast.gap >= 0
        # its cost is within 1e-4 of the optimum's; the objective (without the left-out costs) within the bound
        assert objective(pr, fast.choice) - objective(pr, exact.choice) <= max(fast.gap, 1e-9) + 1e-6
