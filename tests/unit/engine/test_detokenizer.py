"""Incremental detokenization: never splits a UTF-8 character, never emits part of a stop string."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from sluice.workers.demo import train_demo_tokenizer
from sluice.workers.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_demo_tokenizer()


def _detok(tokenizer: Tokenizer, stop: tuple[str, ...] = (), prompt: str = "Q: ") -> IncrementalDetokenizer:
    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return IncrementalDetokenizer(decode, tokenizer.encode(prompt).ids, stop)


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    pieces, stopped = [], False
    for t in ids:
        out = detok.add_tokens([t])
        pieces.append(out.text)
        stopped = out.stopped
        if stopped:
            break
    return pieces, stopped


def test_incremental_text_equals_full_decode_and_never_splits_characters(tokenizer: Tokenizer) -> None:
    text = "Hello 🙂 river, 你好 — Привет ☕ 🚀!"
    ids = tokenizer.encode(text).ids
    # byte-level BPE over a small corpus: the emoji and CJK characters span several tokens
    assert len(ids) > len(text.split())
    detok = _detok(tokenizer)
    pieces, stopped = _feed(detok, ids)
    assert not stopped
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text


def test_stop_string_split_across_tokens_is_caught_and_not_emitted(tokenizer: Tokenizer) -> None:
    text = "The keeper writes the level in a notebook every morning."
    stop = "level in a note"
    ids = tokenizer.encode(text).ids
    detok = _detok(tokenizer, stop=(stop,))
    pieces, stopped = _feed(detok, ids)
    assert stopped
    emitted = "".join(pieces)
    assert emitted == "The keeper writes the "
    # no prefix of the stop string ever left the detokenizer, and nothing comes after the stop
    assert detok.add_tokens(ids[:2]).text == "" and detok.flush() == ""


def test_held_back_prefix_is_released_when_no_match(tokenizer: Tokenizer) -> None:
    text = "the river rises, the river falls"
    detok = _detok(tokenizer, stop=("river runs",))
    pieces, stopped = _feed(detok, tokenizer.encode(text).ids)
    assert not stopped
    emitted = "".join(pieces)
    assert not emitted.endswith("river")  # "river" at the very end is held: it may become "river runs"
    assert emitted + detok.flush() == text


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    detok = _detok(tokenizer, stop=("falls", "rises"))
    pieces, stopped = _feed(detok, tokenizer.encode("the river rises, the river falls").ids)
    assert stopped and "".join(pieces) == "the river "


def test_multi_token_add_stops_inside_the_batch(tokenizer: Tokenizer) -> None:
    detok = _detok(tokenizer, stop=("B",))
    out = detok.add_tokens(tokenizer.encode("aaa B ccc").ids)
    assert out.stopped and out.text == "aaa "


def test_empty_stop_string_is_rejected(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        _detok(tokenizer, stop=("",))


def _primed(tokenizer: Tokenizer, resume: list[int], stop: tuple[str, ...] = ()) -> IncrementalDetokenizer:
    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return IncrementalDetokenizer(decode, tokenizer.encode("Q: ").ids, stop, resume)


@pytest.mark.parametrize("stop", [(), ("river runs",), ("你好 — П",)])
def test_primed_with_resumed_tokens_emits_exactly_what_the_undisturbed_run_would(
        tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
    """Worker failover: resumed at any k (a multi-byte character or a stop-string prefix split
    there included), the text after k is exactly the undisturbed run's text after k."""
    text = "the river rises 🙂, 你好 — Привет ☕ the river runs 🚀!"
    ids = tokenizer.encode(text).ids
    undisturbed = _detok(tokenizer, stop=stop)
    pieces, stopped = _feed(undisturbed, ids)
    tail = "" if stopped else undisturbed.flush()
    assert stopped == bool(stop)
    for k in range(len(pieces)):
        primed = _primed(tokenizer, ids[:k], stop)
        assert primed.text == "".join(pieces[:k])  # what the client already has
        after, primed_stopped = _feed(primed, ids[k:])
        assert after == pieces[k:], k
        assert primed_stopped == stopped
        assert ("" if stopped else primed.flush()) == tail


def test_resumed_tokens_that_already_hit_a_stop_string_are_refused(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("aaa B ccc").ids
    with pytest.raises(ValueError, match="stop string"):
        _primed(tokenizer, ids, stop=("B",))
