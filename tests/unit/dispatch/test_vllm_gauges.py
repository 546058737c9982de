"""What a vLLM-kind upstream's link reads from its /metrics (`vllm_gauges`, issue #35): the three
gauges from a real vLLM 0.32 server's exposition (tests/data/vllm_metrics.txt, taken while it ran 8
requests), parsed from their own lines only; an exposition without them, with garbage in them or
with a value out of range is refused (the probe then reports "served unreadable /metrics")."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.gateway.dispatch.links.upstream import vllm_gauges

pytestmark = pytest.mark.unit

REAL = (Path(__file__).resolve().parents[2] / "data" / "vllm_metrics.txt").read_text(encoding="utf-8")


def test_the_gauges_of_a_real_vllm_server() -> None:
    waiting, running, kv = vllm_gauges(REAL)
    assert (waiting, running) == (0, 8) and 0.0 < kv < 1.0


def test_a_gauge_named_like_another_is_not_taken_for_it() -> None:
    extra = "vllm:num_requests_waiting_by_reason{reason=\"x\"} 5.0\n"
    assert vllm_gauges(REAL + extra)[0] == 0


@pytest.mark.parametrize("text", [
    "",
    "garbage\n",
    "\n".join(line for line in REAL.splitlines() if "num_requests_running" not in line),
    REAL.replace("vllm:num_requests_running{", "vllm:num_requests_running{{"),
    REAL + 'vllm:num_requests_waiting{engine="1"} -3.0\n',
    REAL + 'vllm:num_requests_waiting{engine="1"} NaN\n',
    REAL + 'vllm:num_requests_running{engine="1"} +Inf\n',
])
def test_garbage_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        vllm_gauges(text)
