"""Small charts as inline SVG, drawn on the server: a sparkline is a few polyline coordinates.

Nothing here is text from a tenant; the template renders the numbers (escaped all the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 180
HEIGHT = 36
PAD = 2


@dataclass(frozen=True, slots=True)
class Sparkline:
    segments: tuple[str, ...]  # SVG polyline `points`, one per unbroken run of values
    dots: tuple[tuple[float, float], ...]  # isolated values (a run of one) as dots
    peak: float | None  # the largest value shown (the chart's top), None when there is none
    last: float | None  # the newest value that exists
    width: int = WIDTH
    height: int = HEIGHT


def sparkline(values: Sequence[float | None], width: int = WIDTH, height: int = HEIGHT) -> Sparkline:
    """Values oldest first; None leaves a gap. The y axis runs from 0 to the largest value."""
    present = [v for v in values if v is not None]
    peak = max(present, default=None)
    scale = peak if peak else 1.0
    step = (width - 2 * PAD) / max(1, len(values) - 1)
    span = (height - 2 * PAD) / scale
    runs: list[list[tuple[float, float]]] = [[]]
    for i, value in enumerate(values):
        if value is None:
            if runs[-1]:
                runs.append([])
            continue
        runs[-1].append((PAD + i * step, height - PAD - span * value))
    segments = tuple(" ".join([f"{x:.1f},{y:.1f}" for x, y in run]) for run in runs if len(run) > 1)
    dots = tuple((round(run[0][0], 1), round(run[0][1], 1)) for run in runs if len(run) == 1)
    return Sparkline(segments, dots, peak, present[-1] if present else None, width, height)
