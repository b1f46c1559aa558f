"""Learning-rate scaling rules and statistical progress."""

import math

import pytest

from goodput_train.lr import RULES, LrScaling, default_rule


@pytest.mark.parametrize("rule", RULES)
def test_at_the_initial_batch_nothing_scales(rule):
    scaling = LrScaling(rule, init_batch=128, warmup_epochs=0.0)
    assert scaling.factor(128, 2.0, 3.0, epochs_done=5) == pytest.approx(1.0)
    assert scaling.progress(128, 2.0, 3.0) == pytest.approx(128.0)


def test_the_rules_at_four_times_the_batch():
    sqr, var = 1.0, 3.0  # AdaScale gain (3 + 1) / (3/4 + 1) = 16/7
    assert LrScaling("linear", 64).factor(256, sqr, var) == 4.0
    assert LrScaling("sqrt", 64).factor(256, sqr, var) == 2.0
    assert LrScaling("adascale", 64).factor(256, sqr, var) == pytest.approx(16 / 7)
    assert LrScaling("adascale", 64).factor(256) == 4.0  # no statistics yet: all noise
    legw = LrScaling("legw", 64, warmup_epochs=2.0)
    assert legw.factor(256, epochs_done=4.0) == pytest.approx(1.0)  # halfway through 2 x 4 epochs
    assert legw.factor(256, epochs_done=100.0) == pytest.approx(2.0)


def test_adascale_progress_equals_the_efficiency_model():
    """r·M0 = EFFICIENCY(M)·M: AdaScale's scale-invariant steps and the goodput model agree."""
    sqr, var = 0.5, 2.0
    for batch in (64, 200, 1024):
        adascale = LrScaling("adascale", 64).progress(batch, sqr, var)
        assert adascale == pytest.approx(LrScaling("sqrt", 64).progress(batch, sqr, var))
        assert 64 <= adascale <= batch


def test_gain_is_between_one_and_k():
    scaling = LrScaling("adascale", 32)
    for sqr, var in ((1e-9, 1.0), (1.0, 1e-9), (1.0, 1.0)):
        assert 1.0 <= scaling.gain(320, sqr, var) <= 10.0 + 1e-9
    assert math.isclose(scaling.gain(320, 1.0, 0.0), 1.0)  # no noise: no gain


def test_defaults_and_bad_rules():
    assert default_rule("SGD") == "adascale" and default_rule("AdamW") == "sqrt"
    with pytest.raises(ValueError, match="unknown learning-rate rule"):
        LrScaling("cosine", 64)
    with pytest.raises(ValueError):
        LrScaling("sqrt", 0)
