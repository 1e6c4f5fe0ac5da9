"""MuPPET's switching rule: gradient diversity, T(e), the schedule check."""

import math

import numpy as np
import pytest

from keras_mp.muppet import (
    SwitchingPolicy,
    gradient_diversity,
    switching_threshold,
)
from keras_mp.muppet.policy import check_schedule
from tests.muppet.conftest import DIVERSITIES, EXPECTED_SWITCHES


def test_gradient_diversity_hand_cases():
    a, b = np.array([3.0, 4.0]), np.array([1.0, 0.0])
    assert gradient_diversity([[a], [a], [a]]) == pytest.approx(1 / 3)
    assert gradient_diversity([[a], [np.array([-4.0, 3.0])]]) == pytest.approx(
        1.0
    )
    # Second tensor sums to zero and is left out of the mean.
    assert gradient_diversity([[a, b], [a, -b]]) == pytest.approx(0.5)
    assert math.isnan(gradient_diversity([[b], [-b]]))


def test_policy_on_synthetic_sequence():
    policy = SwitchingPolicy((8, 12, None), patience=2)
    switched = []
    for i, d in enumerate(DIVERSITIES):
        epoch = 3 * i + 2
        p, t, did = policy.update(d, epoch)
        assert t == pytest.approx(1 + 1.5 * math.exp(-0.1 * epoch))
        if did:
            switched.append(epoch)
    assert switched == EXPECTED_SWITCHES
    assert policy.stage == 2 and policy.final
    assert switching_threshold(0) == 2.5


@pytest.mark.parametrize(
    "schedule, match",
    [
        ((8, 16), "must end with None.*Append None"),
        ((16, 8, None), "strictly increase"),
        ((1, 8, None), r"2\.\.32.*Received: schedule entry=1"),
        ((8, 33, None), "Received: schedule entry=33"),
        ((8.5, None), "schedule entry=8.5"),
        ("8,16", "sequence of bit widths ending with None"),
    ],
)
def test_bad_schedules_say_why(schedule, match):
    with pytest.raises(ValueError, match=match):
        check_schedule(schedule)
    assert check_schedule([8, 16, None]) == (8, 16, None)


def test_gradient_diversity_needs_an_epoch():
    with pytest.raises(ValueError, match="at least one epoch"):
        gradient_diversity([])
