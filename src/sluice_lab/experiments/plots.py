"""matplotlib setup shared by the experiments (Agg backend: no display on servers)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def new_figure(rows: int, cols: int, figsize: tuple[float, float]):
    fig, axes = plt.subplots(rows, cols, figsize=figsize)
    return fig, axes


def save(fig, path: str | Path) -> None:
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
