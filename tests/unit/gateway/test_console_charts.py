"""Sparklines: coordinates scaled to the box, gaps for missing buckets, dots for lone values."""

from __future__ import annotations

import pytest

from sluice.gateway.console.charts import sparkline

pytestmark = pytest.mark.unit


def test_sparkline_scales_to_the_largest_value_and_breaks_at_gaps() -> None:
    # 7 points over 64 - 2 * 2 px: x every 10 px from 2; y from 10 (zero) up to 2 (the peak, 4.0)
    line = sparkline([1.0, 2.0, None, 4.0, None, 0.0, 2.0], width=64, height=12)
    assert line.peak == 4.0 and line.last == 2.0
    assert line.segments == ("2.0,8.0 12.0,6.0", "52.0,10.0 62.0,6.0")
    assert line.dots == ((32.0, 2.0),)  # 4.0 alone between two gaps


def test_sparkline_of_nothing_is_empty() -> None:
    line = sparkline([None, None])
    assert line.segments == () and line.dots == () and line.peak is None and line.last is None
