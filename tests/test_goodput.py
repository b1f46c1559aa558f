"""Properties of the Pollux throughput/efficiency model and its fit (train/goodput_train/goodput.py)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from goodput_train.goodput import (
    BatchLimits,
    FitError,
    GoodputModel,
    Observation,
    Retune,
    ThroughputParams,
    _observation_array,
    _SquaredLogError,
    efficiency,
    fit_throughput,
    iteration_time,
    optimize_batch,
    retune_all,
    throughput,
)

TRUE = ThroughputParams(0.02, 0.0005, 0.01, 0.002, 0.05, 0.004, 2.5)

positive = st.floats(1e-4, 1.0)
params_strategy = st.builds(
    lambda ac, bc, ar, br, extra_a, extra_b, g: ThroughputParams(
        ac, bc * 1e-2, ar, br * 1e-2, ar + extra_a, br * 1e-2 + extra_b * 1e-2, g
    ),
    positive,
    positive,
    positive,
    positive,
    positive,
    positive,
    st.floats(1.0, 10.0),
)


def synthetic(params, with_compute=True):
    rows = []
    for nodes, gpus in [(1, 1), (1, 2), (1, 4), (2, 4), (2, 8), (3, 12), (4, 16)]:
        for m in (8, 16, 32, 64, 128):
            for s in (0, 1):
                t = float(iteration_time(params, nodes, gpus, m, s))
                tg = float(params.alpha_c + params.beta_c * m) if with_compute else math.nan
                rows.append(Observation(nodes, gpus, m, s, t, tg))
    return rows


# --- efficiency -------------------------------------------------------------------------------


@given(phi=st.floats(0.0, 1e6), m0=st.integers(1, 1000), factor=st.floats(1.0, 1e3))
@settings(derandomize=True)
def test_efficiency_in_unit_interval_and_one_at_init_batch(phi, m0, factor):
    batches = m0 * np.array([1.0, factor, factor * 2])
    eff = efficiency(phi, m0, batches)
    assert eff[0] == pytest.approx(1.0)
    assert np.all(eff > 0) and np.all(eff <= 1.0 + 1e-12)
    assert np.all(np.diff(eff) <= 1e-12)  # non-increasing in M


def test_efficiency_is_one_without_statistics():
    model = GoodputModel(TRUE, None, None, 32)
    assert np.all(model.efficiency(np.array([32, 64, 4096])) == 1.0)
    assert GoodputModel(TRUE, 0.0, 1.0, 32).efficiency(4096) == 1.0  # vanished signal: noise dominates
    assert GoodputModel(TRUE, float("nan"), 1.0, 32).efficiency(4096) == 1.0


def test_efficiency_matches_pollux_gain_over_scale():
    sqr, var, m0, batch = 2.0, 3.0, 32, 256
    scale = batch / m0
    gain = (var + sqr) / (var / scale + sqr)
    assert GoodputModel(TRUE, sqr, var, m0).efficiency(batch) == pytest.approx(gain / scale)


# --- throughput -------------------------------------------------------------------------------


@given(params_strategy)
@settings(max_examples=50, deadline=None, derandomize=True)
def test_throughput_increases_in_m_with_diminishing_returns(params):
    m = np.arange(1, 513, dtype=float)
    for nodes, gpus in [(1, 1), (1, 4), (2, 8)]:
        x = throughput(params, nodes, gpus, m)
        assert np.all(np.diff(x) > 0)
        assert np.all(np.diff(x, 2) <= 1e-9 * x[2:])


@given(params_strategy, st.integers(1, 512))
@settings(max_examples=50, deadline=None, derandomize=True)
def test_per_gpu_throughput_non_increasing_in_gpus(params, m):
    gpus = np.array([1, 2, 3, 4, 8, 12, 16, 32, 64])
    nodes = np.where(gpus <= 4, 1, gpus // 4)  # 4 GPUs a node
    per_gpu = throughput(params, nodes, gpus, m) / gpus
    assert np.all(np.diff(per_gpu) <= 1e-12 * per_gpu[:-1])


def test_iteration_time_formula_by_hand():
    p = TRUE
    t_grad = p.alpha_c + p.beta_c * 32
    t_sync = p.alpha_n + p.beta_n * (8 - 2)
    expected = 3 * t_grad + (t_grad**p.gamma + t_sync**p.gamma) ** (1 / p.gamma)
    assert iteration_time(p, 2, 8, 32, 3) == pytest.approx(expected)
    assert iteration_time(p, 1, 1, 32, 0) == pytest.approx(t_grad)  # no sync on one GPU


def test_vectorised_equals_scalar():
    model = GoodputModel(TRUE, 1.0, 4.0, 64)
    nodes, gpus, m, s = (
        np.array([1, 1, 2, 4]),
        np.array([1, 4, 8, 16]),
        np.array([64, 32, 16, 8]),
        np.array([0, 1, 0, 2]),
    )
    vec = model.goodput(nodes, gpus, m, s)
    assert np.allclose(vec, [model.goodput(*args) for args in zip(nodes, gpus, m, s)])


# --- fitting ----------------------------------------------------------------------------------


def test_analytic_gradient_matches_finite_differences():
    data = _observation_array(synthetic(TRUE))
    theta = np.array(TRUE) * 1.3
    free, zero = np.zeros(7, dtype=bool), np.zeros(7)
    error = _SquaredLogError(data, free, zero)
    _, grad = error(theta)
    for i in range(7):
        step = np.zeros(7)
        step[i] = 1e-7 * max(theta[i], 1e-3)
        numeric = (error(theta + step)[0] - error(theta - step)[0]) / (2 * step[i])
        assert grad[i] == pytest.approx(numeric, rel=1e-4, abs=1e-9)


@pytest.mark.parametrize("with_compute", [True, False])
def test_fit_recovers_known_parameters(with_compute):
    fitted = fit_throughput(synthetic(TRUE, with_compute))
    assert np.allclose(fitted, TRUE, rtol=0.05)


def test_priors_give_perfect_scaling_for_untried_configurations():
    single = [Observation(1, 1, m, 0, float(iteration_time(TRUE, 1, 1, m))) for m in (8, 16, 32, 64)]
    fitted = fit_throughput(single)
    assert fitted.alpha_r == fitted.beta_r == fitted.alpha_n == fitted.beta_n == 0.0
    for nodes, gpus in [(1, 2), (1, 4), (2, 8), (8, 64)]:
        assert throughput(fitted, nodes, gpus, 32) == pytest.approx(gpus * throughput(fitted, 1, 1, 32))


def test_priors_open_one_at_a_time():
    two = [o for o in synthetic(TRUE) if o.gpus <= 2]
    fitted = fit_throughput(two)
    assert fitted.beta_r == 0.0 and fitted.alpha_n == fitted.beta_n == 0.0  # never > 2 GPUs, never 2 nodes
    assert fitted.alpha_r > 0


def test_fit_from_one_observation():
    fitted = fit_throughput([Observation(1, 1, 32, 0, 0.05)])
    assert iteration_time(fitted, 1, 1, 32) == pytest.approx(0.05, rel=1e-6)
    assert fitted.alpha_c == pytest.approx(0.025)  # half fixed cost, half per-sample


def test_fit_with_duplicates_equals_fit_without():
    rows = synthetic(TRUE)
    assert np.allclose(fit_throughput(rows + rows), fit_throughput(rows), rtol=1e-3)


def test_fit_drops_glitches_and_refuses_nothing_usable():
    rows = synthetic(TRUE)
    glitches = [
        Observation(1, 2, 32, 0, 0.0),
        Observation(1, 2, 32, 0, float("nan")),
        Observation(1, 2, 32, 0, float("inf")),
    ]
    fitted = fit_throughput(rows + glitches)
    assert np.all(np.isfinite(fitted))
    assert np.allclose(fitted, TRUE, rtol=0.05)
    with pytest.raises(FitError, match="finite, positive"):
        fit_throughput(glitches)
    with pytest.raises(FitError, match="no observations"):
        fit_throughput([])
    with pytest.raises(ValueError, match="impossible configuration"):
        fit_throughput([Observation(2, 1, 32, 0, 0.1)])  # fewer GPUs than nodes


# --- the best batch ---------------------------------------------------------------------------


@given(
    params_strategy,
    st.floats(0.1, 1e5),
    st.integers(1, 256),
    st.integers(1, 64),
    st.integers(0, 6),
    st.integers(1, 8),
    st.integers(1, 512),
)
@settings(max_examples=200, deadline=None, derandomize=True)
def test_best_batch_respects_every_bound(params, phi, init, growth, gpus_log, min_local, local_span):
    gpus = 2**gpus_log
    nodes = max(1, gpus // 4)
    limits = BatchLimits(init, init * growth, min_local, min_local + local_span)
    choice = GoodputModel(params, 1.0, phi / init, init).best_batch(nodes, gpus, limits)
    if choice.goodput > 0:
        total = gpus * choice.m * (choice.s + 1)
        assert limits.min_local <= choice.m <= limits.max_local
        assert limits.init_batch <= total <= limits.max_batch
        # s is the smallest accumulation count whose micro-batch fits
        assert choice.s == 0 or math.ceil(total / (gpus * choice.s)) > limits.max_local
    else:
        # Nothing feasible: no candidate batch has a per-GPU micro-batch within the limits.
        assert choice.m == 0 and choice.s == 0
        assert (
            not any(
                limits.min_local <= -(-m // (gpus * (s + 1))) <= limits.max_local
                and limits.init_batch <= gpus * -(-m // (gpus * (s + 1))) * (s + 1) <= limits.max_batch
                for m in range(limits.init_batch, limits.max_batch + 1, max(1, limits.init_batch // 4))
                for s in range(0, 4)
            )
            or limits.max_batch < gpus * limits.min_local
        )


def test_best_batch_beats_every_feasible_integer_choice():
    model = GoodputModel(TRUE, 1.0, 8.0, 32)  # PGNS 256
    limits = BatchLimits(32, 2048, 4, 64)
    best = model.best_batch(1, 4, limits)
    brute = max(
        float(model.goodput(1, 4, m, s)) for m in range(4, 65) for s in range(0, 8) if 32 <= 4 * m * (s + 1) <= 2048
    )
    assert float(best.goodput) >= 0.98 * brute  # 50 geometric candidates: within 2%


def test_infeasible_allocation_has_zero_goodput():
    model = GoodputModel(TRUE, None, None, 32)
    best = model.best_batch(4, 16, BatchLimits(32, 64, 8, 64))  # 16 GPUs x 8 > max batch 64
    assert best.goodput == 0 and best.m == 0


def test_optimize_batch_broadcasts_over_jobs_and_configurations():
    stacked = ThroughputParams.stack([TRUE, TRUE._replace(beta_c=0.001)])
    params = ThroughputParams(*(np.asarray(f)[:, None] for f in stacked))
    gpus = np.array([[1, 2, 4]])
    out = optimize_batch(params, np.array([[100.0], [1e9]]), 32, 1024, 4, 128, 1, gpus)
    assert out.goodput.shape == (2, 3)
    single = GoodputModel(TRUE._replace(beta_c=0.001), 1.0, 1e9 / 32, 32).best_batch(
        1, 4, BatchLimits(32, 1024, 4, 128)
    )
    assert out.goodput[1, 2] == pytest.approx(float(single.goodput))


def test_retune_keeps_batch_unless_gain_passes_threshold():
    model = GoodputModel(TRUE, 1.0, 8.0, 32)
    limits = BatchLimits(32, 2048, 4, 64)
    best_goodput, m, s = model.retune(1, 4, limits)
    near = (m - 1, s)  # a hair off the optimum: keep it
    kept = model.retune(1, 4, limits, current=near)
    assert kept[1:] == near
    far = (4, 1)  # far off: change
    assert model.retune(1, 4, limits, current=far)[1:] == (m, s)
    # threshold 0 means always take the best
    assert model.retune(1, 4, limits, current=near, threshold=0.0)[1:] == (m, s)
    # a current batch that is invalid for the new allocation is never kept
    assert model.retune(2, 8, limits, current=(64, 7))[1:] != (64, 7)


def test_many_jobs_retuned_at_once_get_each_its_own_answer_to_the_last_bit():
    """`retune_all` (a simulated round's thousands of jobs) answers exactly as each job's `retune`:
    the best batch, or the current one kept within the threshold, or none that fits."""
    rng = np.random.default_rng(3)
    questions = []
    for _ in range(400):
        params = ThroughputParams(*(TRUE[i] * rng.uniform(0.2, 5) for i in range(6)), rng.uniform(1, 3))
        init = int(rng.choice([16, 32, 128]))
        limits = BatchLimits(
            init, init * int(rng.choice([1, 8, 64])), int(rng.choice([1, 4])), int(rng.choice([8, 64]))
        )
        model = GoodputModel(params, float(rng.uniform(0.1, 2)), float(rng.uniform(0.1, 50)), init)
        nodes = int(rng.choice([1, 2]))
        gpus = nodes * int(rng.choice([1, 2, 4]))
        best = model.retune(nodes, gpus, limits)
        near = (max(best[1] + int(rng.integers(-2, 3)), 1), best[2])
        current = [None, near, near, near, (64, 7)][int(rng.integers(5))]  # (64, 7): often invalid here
        questions.append(Retune(model, nodes, gpus, limits, current))
    answers = retune_all(questions)
    assert answers == [q.model.retune(q.nodes, q.gpus, q.limits, q.current) for q in questions]
    kept = sum(q.current is not None and a[1:] == q.current for q, a in zip(questions, answers))
    changed = sum(q.current is not None and a[1:] != q.current for q, a in zip(questions, answers))
    assert kept > 50 and changed > 50  # both ways exercised
    assert retune_all([]) == []
