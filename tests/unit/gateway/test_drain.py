"""The drain sequence (gateway/cluster/drain.py) on its own: order of its steps, its bound, its 503."""

from __future__ import annotations

import asyncio

import pytest

from sluice.gateway.cluster.drain import Drain
from sluice.gateway.edge.errors import OpenAIError


def test_refuses_new_work_only_while_draining_and_rejects_a_bad_timeout() -> None:
    drain = Drain(30.0)
    drain.refuse_new()  # serving: nothing raised
    drain.draining = True
    with pytest.raises(OpenAIError) as refused:
        drain.refuse_new()
    assert refused.value.status == 503 and refused.value.code == "replica_draining"
    assert refused.value.headers == {"retry-after": "1"}
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="drain_timeout_s"):
            Drain(bad)


def _run(drain: Drain, open_requests: list[int], finish_after_s: float | None) -> list[str]:
    steps: list[str] = []

    async def stop_consuming() -> None:
        steps.append(f"stop consuming with {open_requests[0]} open")

    async def close_rest() -> None:
        steps.append(f"close with {open_requests[0]} open")

    async def main() -> None:
        if finish_after_s is not None:
            asyncio.get_running_loop().call_later(finish_after_s, open_requests.__setitem__, 0, 0)
        await drain.run(lambda: open_requests[0], stop_consuming, close_rest)
        await drain.run(lambda: open_requests[0], stop_consuming, close_rest)  # a second run does nothing

    asyncio.run(main())
    return steps


def test_leaves_the_group_first_then_waits_for_the_open_requests() -> None:
    drain = Drain(30.0)
    assert _run(drain, [3], finish_after_s=0.3) == ["stop consuming with 3 open", "close with 0 open"]
    assert drain.draining


def test_closes_what_is_left_at_the_timeout() -> None:
    assert _run(Drain(0.3), [2], finish_after_s=None) == ["stop consuming with 2 open", "close with 2 open"]
