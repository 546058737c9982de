"""Helpers shared by the experiments: the default model, summaries, JSON output."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sluice.errors import CLIError
from sluice.telemetry import RequestRecord, percentile


def default_model_dir() -> Path:
    """The demo model, built once into the user's cache dir (atomically: parallel runs are safe)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluice" / "demo-model-seed0"
    if (cache / "model.safetensors").is_file():
        return cache
    from sluice.workers.demo import make_demo_model

    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="demo-model-", dir=cache.parent))
    make_demo_model(staging, seed=0)
    try:
        staging.rename(cache)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(staging, ignore_errors=True)
    return cache


def resolve_model(value: str | None) -> Path:
    if not value:
        return default_model_dir()
    path = Path(value)
    if not (path / "config.json").is_file():
        raise CLIError(f"--model: {value} is not a model directory (no config.json)")
    return path


def latency_summary(ttfts: list[float], gaps: list[float], prefix: str = "") -> dict[str, Any]:
    """TTFT percentiles over requests and ITL percentiles over pooled token gaps."""
    out: dict[str, Any] = {}
    for q in (50, 95, 99):
        out[f"{prefix}ttft_p{q}_s"] = percentile(ttfts, q)
        out[f"{prefix}itl_p{q}_s"] = percentile(gaps, q)
    return out


def ttfts_of(records: list[RequestRecord]) -> list[float]:
    return [r.ttft_s for r in records if r.ttft_s is not None]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator
