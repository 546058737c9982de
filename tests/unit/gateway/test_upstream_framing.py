"""The upstream client's body framing (gateway/dispatch/links/upstream_http.py): the same pieces however the
bytes are split across reads."""

from __future__ import annotations

import asyncio

import pytest

from sluice.gateway.dispatch.links.upstream_http import BodyFraming

EVENTS = [b'data: {"choices":[{"text":" tok"}]}\n\n', b'data: {"choices":[{"text":"!"}]}\n\n', b"data: [DONE]\n\n"]
CHUNKED = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\nx-trailer: 1\r\n\r\n"


def feed_split(framing: BodyFraming, data: bytes, cuts: list[int]) -> bytes:
    out = b""
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        out += b"".join(framing.feed(data[start:end]))
    return out


@pytest.mark.parametrize("cut", range(1, len(CHUNKED)))
def test_chunked_body_split_anywhere(cut: int) -> None:
    framing = BodyFraming(chunked=True, length=None)
    assert feed_split(framing, CHUNKED, [cut]) == b"".join(EVENTS)
    assert framing.done


def test_chunked_body_one_byte_at_a_time_and_nothing_after_its_end() -> None:
    framing = BodyFraming(chunked=True, length=None)
    assert feed_split(framing, CHUNKED + b"junk", list(range(1, len(CHUNKED) + 4))) == b"".join(EVENTS)
    assert framing.done


def test_content_length_body_stops_at_its_length() -> None:
    framing = BodyFraming(chunked=False, length=10)
    assert feed_split(framing, b"0123456789abc", [3, 7]) == b"0123456789"
    assert framing.done
    assert BodyFraming(chunked=False, length=0).done


def test_close_delimited_body_ends_at_eof_and_a_framed_one_is_cut() -> None:
    framing = BodyFraming(chunked=False, length=None)
    assert feed_split(framing, b"all of it", [4]) == b"all of it"
    assert not framing.done
    framing.eof()
    assert framing.done
    for cut in (BodyFraming(chunked=True, length=None), BodyFraming(chunked=False, length=10)):
        cut.feed(b"3\r\nab")
        with pytest.raises(asyncio.IncompleteReadError):
            cut.eof()


def test_garbage_chunk_size_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        BodyFraming(chunked=True, length=None).feed(b"zz\r\nhello\r\n")
