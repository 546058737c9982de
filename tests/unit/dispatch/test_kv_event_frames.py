"""KV events on the wire: the challenge's opt-in, and undecodable frames skipped once a worker is accepted."""

from __future__ import annotations

import msgspec
import pytest

from sluice.protocol import FrameDecoder, KvEvents, WorkerCapacity, WorkerChallenge, encode_frame

pytestmark = pytest.mark.unit


def raw_frame(obj: object) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return len(body).to_bytes(4, "big") + body


def test_an_older_gateways_challenge_does_not_ask_for_events() -> None:
    old = raw_frame({"type": "challenge", "nonce": b"n" * 32})  # what a gateway before KvEvents sends
    (challenge,) = FrameDecoder().feed(old)
    assert isinstance(challenge, WorkerChallenge) and not challenge.kv_events
    (new,) = FrameDecoder().feed(encode_frame(WorkerChallenge(b"n" * 32, kv_events=True)))
    assert isinstance(new, WorkerChallenge) and new.kv_events


def test_kv_events_round_trip() -> None:
    events = KvEvents(block_size=16, stored=(bytes(16),), evicted=(b"\x01" * 16,), cleared=True)
    assert FrameDecoder().feed(encode_frame(events)) == [events]


def test_undecodable_frames_raise_before_acceptance_and_are_skipped_after() -> None:
    capacity = WorkerCapacity(worker_id="w", num_running=0, num_waiting=0, free_kv_blocks=1, total_kv_blocks=1,
                              max_num_seqs=1, sent_at=0.0)
    stream = (raw_frame({"type": "from_the_future", "x": 1})
              + raw_frame({"type": "kv_events", "block_size": "sixteen"})  # malformed field
              + encode_frame(capacity))
    with pytest.raises(msgspec.DecodeError):
        FrameDecoder().feed(stream)
    decoder = FrameDecoder()
    decoder.skip_undecodable = True
    assert decoder.feed(stream) == [capacity]
    assert decoder.num_skipped == 2
