"""The side-by-side confirmation's test of a changed machine speed (``speed_change``): what counts as a change
and what as the noise of the first figure."""

from __future__ import annotations

import pytest

from lightning_ckpt.search.confirm import speed_change


def test_a_change_beyond_15_percent_is_a_speed_change_and_same_moment_noise_is_not():
    assert speed_change(1.0, 1.06) is None  # 6% step-time noise
    assert speed_change(1.0, 1.25) == pytest.approx(0.8)
    assert speed_change(1.0, 0.8) == pytest.approx(1.25)
    assert speed_change(None, 1.0) is None and speed_change(1.0, None) is None


@pytest.mark.parametrize("factor", [5.0, 0.2], ids=["5x slower", "5x faster"])
def test_a_5x_change_is_seen_even_when_the_first_figure_was_noisy(factor):
    # Two steps timed on a loaded machine: 1.0 s and 1.8 s, median 1.4 s, spread 0.4 s (29%): three spreads are
    # a factor of 1.86 either way. A 5x change in either direction is beyond it (as a difference of speeds a 5x
    # slowdown is only 80%, within 86%).
    ratio = speed_change(1.4, 1.4 * factor, spread=0.4)
    assert ratio == pytest.approx(1 / factor)


@pytest.mark.parametrize("factor", [1.6, 1 / 1.6], ids=["1.6x slower", "1.6x faster"])
def test_a_change_within_three_spreads_of_a_noisy_first_figure_is_noise_either_way(factor):
    assert speed_change(1.4, 1.4 * factor, spread=0.4) is None
