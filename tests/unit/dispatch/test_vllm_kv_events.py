"""A vLLM upstream's KV events become sluice's hashes in the upstream's exact index.

The batches are encoded here in vLLM's wire layout (msgpack: [ts, [events], rank], each event a map
tagged by its class name); `test_real_vllm_frames` decodes messages captured from a real vLLM 0.32
server (tests/data/vllm_kv_events.json), so the layout is checked against the real publisher too.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from sluice.gateway.dispatch.cache_index import CacheIndex
from sluice.gateway.dispatch.links.vllm_kv_events import UpstreamKvEvents
from sluice.prefix_hash import prefix_block_hashes

pytestmark = pytest.mark.unit

BS = 4
_encode = msgspec.msgpack.Encoder().encode
FRAMES = Path(__file__).resolve().parents[2] / "data" / "vllm_kv_events.json"


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int], salt: str | None = None,
           **extra: object) -> dict[str, object]:
    keys = [[salt] if salt is not None else None] + [None] * (len(hashes) - 1)
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": keys if parent is None else None, **extra}


def removed(hashes: list[bytes]) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def message(seq: int, *events: dict[str, object]) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), _encode([1.0, list(events), 0])]


def reader(max_blocks: int = 1000) -> UpstreamKvEvents:
    return UpstreamKvEvents("tcp://127.0.0.1:1", "kv", CacheIndex(max_blocks, approximate=False), name="v")


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_stored_chain_is_renamed_with_the_tenant_salt() -> None:
    r = reader()
    tokens = list(range(100, 112))  # three blocks
    r.receive(message(0, stored([h(1), h(2)], None, tokens[:8], salt="tenant-a")))
    r.receive(message(1, stored([h(3)], h(2), tokens[8:12])))
    ours = prefix_block_hashes("tenant-a", [*tokens, 0], BS)
    assert r.index.block_size == BS
    assert r.index.matched_blocks(ours) == 3
    # Another tenant's salt names other blocks: its identical prompt finds nothing here.
    assert r.index.matched_blocks(prefix_block_hashes("tenant-b", [*tokens, 0], BS)) == 0


def test_removed_blocks_leave_the_index() -> None:
    r = reader()
    tokens = list(range(8))
    r.receive(message(0, stored([h(1), h(2)], None, tokens, salt="t")))
    r.receive(message(1, removed([h(2), h(99)])))  # one unknown hash: nothing to do for it
    ours = prefix_block_hashes("t", [*tokens, 0], BS)
    assert r.index.matched_blocks(ours) == 1
    assert len(r.translator) == 1


def test_a_block_whose_parent_is_unknown_stays_out() -> None:
    r = reader()
    r.receive(message(0, stored([h(5)], h(4), [1, 2, 3, 4])))
    assert len(r.index) == 0


def test_a_gap_in_the_sequence_empties_the_index() -> None:
    r = reader()
    r.receive(message(0, stored([h(1)], None, [1, 2, 3, 4], salt="t")))
    assert len(r.index) == 1
    r.receive(message(5, removed([h(7)])))  # 1..4 lost: what we knew may be gone
    assert len(r.index) == 0 and len(r.translator) == 0 and r.num_resets == 1


def test_a_restarted_server_counting_from_zero_empties_the_index() -> None:
    r = reader()
    r.receive(message(0, stored([h(1)], None, [1, 2, 3, 4], salt="t")))
    r.receive(message(1, stored([h(2)], h(1), [5, 6, 7, 8])))
    r.receive(message(0, stored([h(3)], None, [9, 9, 9, 9], salt="t")))
    assert len(r.index) == 1 and r.num_resets == 1


def test_all_blocks_cleared() -> None:
    r = reader()
    r.receive(message(0, stored([h(1)], None, [1, 2, 3, 4], salt="t")))
    r.receive(message(1, {"type": "AllBlocksCleared"}))
    assert len(r.index) == 0 and len(r.translator) == 0


@pytest.mark.parametrize("frames", [
    [b"kv", b"\x00" * 8],  # two parts
    [b"kv", b"\x00" * 7, b""],  # a short sequence number
    [b"kv", (0).to_bytes(8, "big"), b"\xc1garbage"],  # not msgpack
    [b"kv", (0).to_bytes(8, "big"), _encode({"ts": 1})],  # not a batch
    [b"kv", (0).to_bytes(8, "big"), _encode([1.0, [{"type": "Unknown"}], 0])],
])
def test_garbage_is_skipped_and_the_reader_goes_on(frames: list[bytes]) -> None:
    r = reader()
    r.receive(frames)
    r.receive(message(1, stored([h(1)], None, [1, 2, 3, 4], salt="t")))
    assert len(r.index) == 1


@pytest.mark.parametrize("event", [
    stored([h(1)], None, [1, 2, 3]),  # token count is not blocks x block size
    stored([b""], None, [1, 2, 3, 4], salt="t"),  # an empty hash
    stored([b"x" * 65], None, [1, 2, 3, 4], salt="t"),  # an oversized hash
    stored([h(1)], None, [1, 2, 3, 4], salt="t", lora_name="adapter"),  # an adapter's block
    {**stored([h(1)], None, [1, 2, 3, 4]), "extra_keys": [["img", 3]]},  # multimodal keys
])
def test_a_bad_event_is_skipped_alone(event: dict[str, object]) -> None:
    r = reader()
    r.receive(message(0, event, stored([h(9)], None, [5, 6, 7, 8], salt="t")))
    assert len(r.index) == 1
    assert r.index.matched_blocks(prefix_block_hashes("t", [5, 6, 7, 8, 0], BS)) == 1


def test_the_translation_map_is_bounded() -> None:
    r = reader(max_blocks=3)
    r.receive(message(0, stored([h(i) for i in range(1, 6)], None, list(range(20)), salt="t")))
    assert len(r.translator) == 3 and len(r.index) == 3


def test_integer_hashes_of_older_releases() -> None:
    r = reader()
    r.receive(message(0, stored([2**63 + 5], None, [1, 2, 3, 4], salt="t")))
    r.receive(message(1, stored([-7], 2**63 + 5, [5, 6, 7, 8])))
    assert r.index.matched_blocks(prefix_block_hashes("t", [*list(range(1, 9)), 0], BS)) == 2


def test_real_vllm_frames() -> None:
    """Messages a real vLLM 0.32 server published for two requests of the same prompt with
    cache salts "tenant-a" and "tenant-b" (300 tokens; block size 128 on the CPU: two full blocks each)."""
    captured = json.loads(FRAMES.read_text())
    r = reader()
    for frames in captured["messages"]:
        r.receive([bytes.fromhex(part) for part in frames])
    prompt = captured["prompt_token_ids"]
    assert r.index.block_size == captured["block_size"]
    for salt in ("tenant-a", "tenant-b"):
        ours = prefix_block_hashes(salt, prompt, r.index.block_size)
        assert ours and r.index.matched_blocks(ours) == len(ours)


async def test_subscribes_over_zmq_and_starts_over_when_the_publisher_restarts() -> None:
    """A real ZMQ PUB socket stands in for the server's publisher (same socket type and framing)."""
    import asyncio

    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    r = UpstreamKvEvents("tcp://127.0.0.1:0", "kv", CacheIndex(1000, approximate=False), name="v")

    def publisher() -> tuple[zmq.asyncio.Socket, str]:
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        return pub, f"tcp://127.0.0.1:{port}"

    async def publish_until(pub: zmq.asyncio.Socket, frames: list[bytes], done: object) -> None:
        for _ in range(200):  # a SUB joins a moment after connecting: publish until it has read
            await pub.send_multipart(frames)
            await pub.send_multipart([b"other-topic", b"\x00" * 8, b"ignored"])
            await asyncio.sleep(0.02)
            if done():  # type: ignore[operator]
                return
        raise AssertionError("the subscriber never read the message")

    pub, endpoint = publisher()
    r.endpoint = endpoint
    r.start()
    try:
        await publish_until(pub, message(0, stored([h(1)], None, [1, 2, 3, 4], salt="t")), lambda: len(r.index) == 1)
        pub.close(linger=0)  # the server goes away: the connection drops and the index empties
        for _ in range(400):
            if len(r.index) == 0:
                break
            await asyncio.sleep(0.05)
        assert len(r.index) == 0 and r.num_resets >= 1
    finally:
        await r.stop()
