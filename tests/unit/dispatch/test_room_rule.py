"""The dispatcher's room rule: short worker queues, but urgent work may overtake less urgent."""

from __future__ import annotations

import pytest

from sluice.gateway.dispatch.slots import has_room
from sluice.protocol import Priority

pytestmark = pytest.mark.unit

HI, S, B = Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH


def test_room_while_the_waiting_estimate_is_under_the_limit() -> None:
    assert has_room(0, [], B, 2)
    assert has_room(1, [B], B, 2)
    assert not has_room(2, [B, B], B, 2)


def test_urgent_work_may_overtake_unstarted_lower_class_work() -> None:
    assert has_room(2, [B, B], HI, 2)  # the engine will put it ahead of both
    assert has_room(3, [B, B, HI], HI, 2)
    assert not has_room(4, [B, B, HI, HI], HI, 2)  # but its own class stays bounded
    assert not has_room(2, [S, S], S, 2)  # equal class: nothing to overtake
    assert has_room(2, [B, S], S, 2)


def test_nothing_to_overtake_when_all_unstarted_work_is_as_urgent() -> None:
    assert not has_room(2, [HI, HI], B, 2)
    assert not has_room(5, [], HI, 2)  # queued work the gateway did not send (other gateways)
