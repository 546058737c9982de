"""The PNG for `sluice bench serve --plot`: latency CDFs per class and throughput over time."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers; must precede pyplot
import matplotlib.pyplot as plt


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    rows = report["requests"]
    classes = sorted({row["priority_class"] for row in rows})
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ttft_ax, itl_ax, time_ax, tput_ax = axes.flat
    for cls in classes:
        mine = [r for r in rows if r["priority_class"] == cls and not r["error"]]
        _cdf(ttft_ax, [r["ttft_s"] for r in mine if r["ttft_s"] is not None], cls)
        gaps = [b - a for r in mine for a, b in itertools.pairwise(r["token_times"])]
        _cdf(itl_ax, gaps, cls)
        timed = [(r["sent_offset_s"], r["ttft_s"]) for r in mine if r["ttft_s"] is not None]
        time_ax.scatter([t for t, _ in timed], [v for _, v in timed], s=6, label=cls)
    slo = report["slo"]
    ttft_ax.axvline(slo["ttft_s"], color="grey", linestyle="--", linewidth=1)
    itl_ax.axvline(slo["itl_s"], color="grey", linestyle="--", linewidth=1)
    ttft_ax.set(title="TTFT CDF by class", xlabel="seconds", ylabel="fraction of requests")
    itl_ax.set(title="Inter-token latency CDF by class", xlabel="seconds", ylabel="fraction of gaps")
    itl_ax.set_xscale("log")
    time_ax.set(title="TTFT by send time", xlabel="send time (s from start)", ylabel="TTFT (s)")
    # Output tokens per 1-second bin, from the chunk times of every request.
    start = min((r["arrival"] for r in rows), default=0.0)
    bins: dict[int, int] = {}
    for row in rows:
        for t in row["token_times"]:
            bins[int(t - start)] = bins.get(int(t - start), 0) + 1
    if bins:
        xs = list(range(max(bins) + 1))
        tput_ax.plot(xs, [bins.get(x, 0) for x in xs])
    tput_ax.set(title="Streamed chunks per second", xlabel="time (s from start)", ylabel="chunks/s")
    for ax in (ttft_ax, itl_ax, time_ax):
        if classes:
            ax.legend(fontsize=8)
    fig.suptitle(f"sluice bench serve: {report['scenario']} ({report['summary']['requests']} requests)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
