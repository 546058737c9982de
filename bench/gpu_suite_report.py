"""Result rows, the JSON report and the timer shared by bench/gpu_suite.py's sections."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Row:
    section: str
    name: str
    ms: float | None = None
    achieved: float | None = None  # GB/s or TFLOP/s, per `unit`
    unit: str = ""
    fraction: float | None = None  # achieved / measured ceiling
    error: float | None = None  # relative error norm for checks
    ok: bool | None = None
    note: str = ""


@dataclass(slots=True)
class Report:
    path: Path | None
    device: str
    dry_run: bool
    rows: list[Row] = field(default_factory=list)
    ceilings: dict[str, float] = field(default_factory=dict)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        value = "" if row.ms is None else f"{row.ms:9.4f} ms"
        extra = "" if row.achieved is None else f" {row.achieved:9.1f} {row.unit}"
        frac = "" if row.fraction is None else f" ({100 * row.fraction:5.1f}% of ceiling)"
        err = "" if row.error is None else f" rel_err={row.error:.2e} {'ok' if row.ok else 'FAIL'}"
        print(f"[{row.section}] {row.name}: {value}{extra}{frac}{err} {row.note}".rstrip(), flush=True)
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "device": self.device,
            "dry_run": self.dry_run,
            "ceilings": self.ceilings,
            "rows": [asdict(r) for r in self.rows],
        }
        self.path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def bench_ms(fn: Callable[[], Any], on_cuda: bool) -> float:
    """Median milliseconds of fn(): do_bench on CUDA, a few host-timed calls under the interpreter."""
    if on_cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
