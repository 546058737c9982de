"""Per-partition commit watermarks: commit the lowest unfinished offset."""

from __future__ import annotations

import pytest

from sluice.gateway.queueing.consumer import PartitionWatermark
from sluice.gateway.queueing.kafka import decode_request, encode_request
from sluice.protocol import GenerateRequest, Priority, SamplingParams

pytestmark = pytest.mark.unit


def test_commit_offset_waits_for_the_lowest_unfinished() -> None:
    mark = PartitionWatermark()
    for offset in range(5, 10):
        mark.track(offset)
    assert mark.finish(7) is None  # 5 and 6 still unfinished
    assert mark.finish(6) is None
    assert mark.finish(5) == 8  # 5..7 done: commit points at 8
    assert mark.finish(9) is None
    assert mark.finish(8) == 10
    assert mark.num_unfinished == 0


def test_finishing_twice_or_unknown_offsets_is_harmless() -> None:
    mark = PartitionWatermark()
    mark.track(0)
    mark.track(1)
    assert mark.finish(0) == 1
    assert mark.finish(0) is None
    assert mark.finish(1) == 2
    mark.track(2)
    assert mark.finish(2) == 3


def test_request_round_trips_through_msgpack() -> None:
    request = GenerateRequest(
        request_id="r1", tenant_id="t", model="demo", priority=Priority.BATCH,
        prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=4), cache_salt="s",
        arrival_time=1.5, batch_id="b", custom_id="c", tenant_weight=2.0,
    )
    assert decode_request(encode_request(request)) == request
