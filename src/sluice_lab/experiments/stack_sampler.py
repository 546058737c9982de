"""A wall-clock stack sampler run inside a process: where its event loop spends its time.

For machines without py-spy. A daemon thread reads the main thread's frame (`sys._current_frames`)
`rate` times a second and counts each stack, collapsed ("file:function;file:function count", the
format py-spy's `--format raw` writes and flamegraph tools read). Samples whose innermost frame
is the selector's wait are the loop being idle. The counts are rewritten to `path` every second,
so a process stopped by a signal leaves its profile behind. Sampling holds the GIL for a few
microseconds per sample: at 200 Hz it costs the sampled process about 1 %.

Started by `start_from_env()` when SLUICE_STACK_SAMPLE_OUT is set (bench/profile_upstream_gateway.py
puts a sitecustomize.py that calls it on the gateway's PYTHONPATH).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType

ENV_OUT = "SLUICE_STACK_SAMPLE_OUT"
ENV_RATE = "SLUICE_STACK_SAMPLE_RATE"
FLUSH_S = 1.0


def _collapse(frame: FrameType | None) -> str:
    names: list[str] = []
    while frame is not None:
        code = frame.f_code
        names.append(f"{Path(code.co_filename).name}:{code.co_qualname}")
        frame = frame.f_back
    return ";".join(reversed(names))


class StackSampler:
    """Counts the main thread's collapsed stacks at `rate` Hz; `dump()` writes them to `path`."""

    def __init__(self, path: Path, rate: float = 200.0) -> None:
        if rate <= 0:
            raise ValueError(f"sampling rate must be positive, got {rate}")
        self.path = path
        self.interval = 1.0 / rate
        self.counts: collections.Counter[str] = collections.Counter()
        self._target = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        next_flush = time.monotonic() + FLUSH_S
        while True:
            time.sleep(self.interval)
            frame = sys._current_frames().get(self._target) if self._target is not None else None
            if frame is not None:
                self.counts[_collapse(frame)] += 1
            del frame
            if time.monotonic() >= next_flush:
                next_flush += FLUSH_S
                self.dump()

    def dump(self) -> None:
        lines = [f"{stack} {n}" for stack, n in list(self.counts.items())]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(self.path)


def start_from_env() -> StackSampler | None:
    out = os.environ.get(ENV_OUT)
    if not out:
        return None
    sampler = StackSampler(Path(out), float(os.environ.get(ENV_RATE, "200")))
    sampler.start()
    return sampler
