"""Goodput-driven cloud auto-scaling (sim/autoscale.py, `goodput autoscale`), on the model zoo."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from cli.main import main
from goodput_train.goodput import GoodputModel
from services.simulated.truth import job_sources
from shared.settings import settings_for
from sim import autoscale as auto

OPTIONS = auto.ScalingOptions()
SETTINGS = settings_for("pollux", "")


@pytest.fixture(scope="module")
def imagenet():
    return job_sources(use_zoo=True).truths["imagenet"]


@pytest.fixture(scope="module")
def params(imagenet):
    return auto.fitted_throughput(imagenet, "aws", OPTIONS)


@pytest.fixture(scope="module")
def limits(imagenet):
    return auto.batch_limits(imagenet, "aws", SETTINGS)


@pytest.fixture(scope="module")
def runs(imagenet):
    return auto.compare(imagenet, "aws", OPTIONS, SETTINGS)


def test_a_rescale_stops_where_goodput_per_node_first_falls_below_lower():
    scaling = np.array([1.0, 0.9, 0.8, 0.6, 0.55, 0.45, 0.7, 0.6])  # a dip below L, then back above it
    assert auto.next_size(1, scaling, OPTIONS) == 5  # not 7 or 8, past the dip
    assert auto.next_size(4, scaling, OPTIONS) == 4  # 0.6 is within [L, U]: hold
    assert auto.next_size(6, scaling, OPTIONS) == 5  # 0.45 < L: down
    assert auto.next_size(12, scaling, OPTIONS) == 5  # past max_nodes: back within it


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.9])
def test_decide_never_passes_the_size_where_predicted_goodput_per_node_falls_below_lower(
    imagenet, params, limits, fraction
):
    model = GoodputModel(
        params, *imagenet.stats(fraction * imagenet.total_progress, imagenet.init_batch), imagenet.init_batch
    )
    scaling = auto.goodput_scaling(model, limits, OPTIONS)
    for nodes in range(1, OPTIONS.max_nodes + 1):
        chosen = auto.decide(nodes, model, limits, OPTIONS)
        if chosen != nodes:
            assert (scaling[:chosen] >= OPTIONS.lower).all()
            assert chosen == OPTIONS.max_nodes or scaling[chosen] < OPTIONS.lower


def test_node_count_never_falls_while_gradient_noise_grows(imagenet):
    # PGNS = M0 var / sqr rising 100-fold over training, epoch by epoch.
    pgns = np.geomspace(300.0, 30000.0, len(imagenet.boundaries))
    noisy = dataclasses.replace(imagenet, grad_var=(pgns * imagenet.grad_sqr[0] / imagenet.init_batch)[None, :])
    nodes = [x.nodes for x in auto.run_autoscaler(noisy, "goodput", "aws", OPTIONS, SETTINGS).samples]
    assert all(a <= b for a, b in zip(nodes, nodes[1:]))
    assert nodes[-1] > nodes[0]


def test_throughput_scaler_ignores_training_progress(runs):
    assert len(runs["throughput"].node_changes()) == 1


def test_every_rescale_costs_a_restart(runs):
    for run in runs.values():
        assert run.restarts == len(run.node_changes()) - 1


def test_goodput_auto_scaler_costs_fewer_gpu_hours_than_throughput(runs):
    good, base = runs["goodput"], runs["throughput"]
    assert good.finish_s is not None and base.finish_s is not None
    assert good.gpu_hours < base.gpu_hours
    assert good.mean_efficiency() > base.mean_efficiency()  # it waits until big batches are efficient


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(upper=0.5, lower=0.5), "above the lower"),
        (dict(upper=0.4, lower=0.5), "above the lower"),
        (dict(lower=0.0), "L must be > 0"),
        (dict(lower=-0.1), "L must be > 0"),
        (dict(upper=1.5), "U must be <= 1"),
        (dict(max_nodes=0), "max_nodes must be >= 1"),
        (dict(gpus_per_node=0), "at least 1 GPU"),
        (dict(period_s=0), "period must be > 0"),
        (dict(baseline_local_batch=0), "per-GPU batch must be >= 1"),
    ],
)
def test_bad_options_raise_a_clear_value_error(options, message):
    with pytest.raises(ValueError, match=message):
        auto.ScalingOptions(**options)


def test_bad_node_count_policy_or_gpu_type_raise_value_error(imagenet, params, limits):
    with pytest.raises(ValueError, match="at least 1 node"):
        auto.decide(0, GoodputModel(params, None, None, imagenet.init_batch), limits, OPTIONS)
    with pytest.raises(ValueError, match="unknown auto-scaling policy"):
        auto.run_autoscaler(imagenet, "fastest", "aws", OPTIONS, SETTINGS)
    with pytest.raises(ValueError, match="no profile on GPU type"):
        auto.run_autoscaler(imagenet, "goodput", "tpu", OPTIONS, SETTINGS)


def test_cli_writes_results_and_figure(tmp_path, capsys):
    out, png = tmp_path / "autoscale.json", tmp_path / "autoscale.png"
    assert main(["autoscale", "--zoo", "--out", str(out), "--plot", str(png)]) == 0
    results = json.loads(out.read_text())
    assert set(results["runs"]) == {"goodput", "throughput"}
    assert 0 < results["ratios"]["cost_ratio"] < 1
    assert png.stat().st_size > 0
    assert "Pollux §5.4.1 reports cost 0.75" in capsys.readouterr().out


def test_cli_reports_bad_thresholds(capsys):
    assert main(["autoscale", "--zoo", "--upper", "0.4", "--lower", "0.5"]) == 2
    assert "U=0.4 <= L=0.5" in capsys.readouterr().err
