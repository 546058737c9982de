"""An upstream's streamed choice, logprobs included, checked before anything of it is relayed
(gateway/dispatch/links/upstream_chunks.py): vLLM's completions shape under
`return_tokens_as_token_ids`, and what breaks it."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.gateway.dispatch.links.upstream_chunks import MalformedChunk, read_choice
from sluice.protocol import PositionLogprobs, TokenLogprob

pytestmark = pytest.mark.unit


def choice(token_ids: list[Any], logprobs: Any) -> dict[str, Any]:
    return {"index": 0, "text": "ab", "token_ids": token_ids, "finish_reason": None, "logprobs": logprobs}


def vllm_logprobs(tokens: list[Any], values: list[Any], tops: Any) -> dict[str, Any]:
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": [0] * len(tokens)}


def test_vllm_logprobs_become_positions_with_the_top_n_by_value() -> None:
    # vLLM's top_logprobs hold the chosen token first, then its top N: N + 1 entries at most.
    tops = [{"token_id:7": -2.5, "token_id:3": -0.1, "token_id:9": -1.0},
            {"token_id:8": -0.25, "token_id:4": -9999.0}]
    raw = choice([7, 8], vllm_logprobs(["token_id:7", "token_id:8"], [-2.5, -0.25], tops))
    piece = read_choice(raw, 2)
    assert piece.token_ids == (7, 8)
    assert piece.logprobs == (
        PositionLogprobs(TokenLogprob(7, -2.5), (TokenLogprob(3, -0.1), TokenLogprob(9, -1.0))),
        PositionLogprobs(TokenLogprob(8, -0.25), (TokenLogprob(8, -0.25), TokenLogprob(4, -9999.0))),
    )
    chosen_only = read_choice(choice([7], vllm_logprobs(["token_id:7"], [0], [{"token_id:7": 0}])), 0)
    assert chosen_only.logprobs == (PositionLogprobs(TokenLogprob(7, 0.0), ()),)
    # Not asked for: none kept, whatever the chunk carries.
    assert read_choice(raw).logprobs == ()
    # A chunk with no output (the usage chunk, a finish alone) needs none.
    assert read_choice({"index": 0, "text": "", "finish_reason": "stop"}, 2).logprobs == ()


@pytest.mark.parametrize(("raw", "why"), [
    (choice([7], None), "no logprobs"),
    ({"index": 0, "text": "ab", "logprobs": vllm_logprobs(["token_id:7"], [-1.0], None)}, "one for one"),
    (choice([7, 8], vllm_logprobs(["token_id:7"], [-1.0], None)), "one for one"),
    (choice([7], vllm_logprobs(["token_id:8"], [-1.0], None)), "does not name"),
    (choice([7], vllm_logprobs(["a"], [-1.0], None)), "named by its id"),
    (choice([7], vllm_logprobs(["token_id:-7"], [-1.0], None)), "named by its id"),
    (choice([7], vllm_logprobs(["token_id:99999999999"], [-1.0], None)), "named by its id"),
    (choice([7], vllm_logprobs(["token_id:7"], [0.5], None)), "finite number <= 0"),
    (choice([7], vllm_logprobs(["token_id:7"], [float("nan")], None)), "finite number <= 0"),
    (choice([7], vllm_logprobs(["token_id:7"], [float("-inf")], None)), "finite number <= 0"),
    (choice([7], vllm_logprobs(["token_id:7"], [-(10**400)], None)), "finite number <= 0"),
    (choice([7], vllm_logprobs(["token_id:7"], ["-1"], None)), "finite number <= 0"),
    (choice([7], vllm_logprobs(["token_id:7"], [True], None)), "finite number <= 0"),
    (choice([7], vllm_logprobs(["token_id:7"], [None], None)), "finite number <= 0"),
    (choice([7], vllm_logprobs(["token_id:7"], [-1.0], [{"token_id:1": -1, "token_id:2": -2,
                                                          "token_id:3": -3}])), "at most"),
    (choice([7], vllm_logprobs(["token_id:7"], [-1.0], [["token_id:1", -1]])), "at most"),
    (choice([7], vllm_logprobs(["token_id:7"], [-1.0], [{"x": -1}])), "named by its id"),
    (choice([7], vllm_logprobs(["token_id:7"], [-1.0], [{"token_id:1": 3}])), "finite number <= 0"),
    (choice([7], vllm_logprobs(["token_id:7"], [-1.0], [{}, {}])), "top_logprobs does not match"),
    (choice([7], {"tokens": "token_id:7", "token_logprobs": [-1.0]}), "not a list"),
])
def test_malformed_logprobs_are_refused_naming_what(raw: dict[str, Any], why: str) -> None:
    with pytest.raises(MalformedChunk, match=why):
        read_choice(raw, 1)
