"""Batch input file validation: every bad line reported with its number."""

from __future__ import annotations

import json

import pytest

from sluice.gateway.batches.validation import InvalidBatchFile, parse_batch_file

pytestmark = pytest.mark.unit


def line(custom_id: str, url: str = "/v1/chat/completions", **body: object) -> str:
    body = body or {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_good_file_parses_every_line() -> None:
    content = "\n".join([line("a"), "", line("b", "/v1/completions", model="demo", prompt="x")]).encode()
    lines = parse_batch_file(content)
    assert [(x.line_no, x.custom_id, x.url) for x in lines] == [
        (1, "a", "/v1/chat/completions"), (3, "b", "/v1/completions")]


def test_bad_lines_are_listed_with_numbers() -> None:
    content = "\n".join([
        line("a"),
        "{not json",
        line("a"),  # duplicate
        json.dumps({"custom_id": "c", "method": "GET", "url": "/v1/chat/completions", "body": {}}),
        line("d", "/v1/embeddings"),
        json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "demo"}}),  # no messages
    ]).encode()
    with pytest.raises(InvalidBatchFile) as info:
        parse_batch_file(content)
    numbers = [n for n, _ in info.value.errors]
    assert numbers == [2, 3, 4, 5, 6]
    message = str(info.value)
    assert "line 2: not valid JSON" in message
    assert "line 3: custom_id 'a' is used more than once" in message
    assert "line 4: method must be" in message
    assert "and 0 more" not in message


def test_empty_and_non_utf8_files_are_rejected() -> None:
    with pytest.raises(InvalidBatchFile, match="no request lines"):
        parse_batch_file(b"\n\n")
    with pytest.raises(InvalidBatchFile, match="not UTF-8"):
        parse_batch_file(b"\xff\xfe")


def test_numbers_outside_what_the_engine_and_wire_accept_are_bad_lines() -> None:
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    poison = [
        {"top_k": 2**63},
        {"top_k": 2**64},
        {"stop_token_ids": [2**64]},
        {"seed": 2**64},
        {"max_tokens": 2**64},
        {"presence_penalty": 1e400},
        {"top_logprobs": 21, "logprobs": True},
        {"stop": [f"s{i}" for i in range(17)]},
        {"temperature": "0.5"},  # strict: a string is not a number, as over HTTP
    ]
    content = "\n".join(line(f"c{i}", **chat, **extra) for i, extra in enumerate(poison)).encode()
    with pytest.raises(InvalidBatchFile) as info:
        parse_batch_file(content)
    errors = dict(info.value.errors)
    assert sorted(errors) == list(range(1, len(poison) + 1))
    assert errors[1].startswith("body.top_k: Expected `int` <=")
    assert errors[3].startswith("body.stop_token_ids[0]:")
    assert errors[4].startswith("body.seed:")
    assert errors[5].startswith("body.max_tokens:")
    assert errors[8].startswith("body.stop: Expected `array` of length <= 16")
    assert errors[9].startswith("body.temperature: Expected `float | null`, got `str`")


def test_deeply_nested_json_is_a_bad_line_not_a_crash() -> None:
    deep = "[" * 5000 + "]" * 5000
    text = (
        '{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
        f'"body": {{"model": "demo", "prompt": "x", "extra": {deep}}}}}'
    )
    with pytest.raises(InvalidBatchFile) as info:
        parse_batch_file(text.encode())
    assert info.value.errors == [(1, "the JSON is nested too deeply")]


def test_top_p_zero_and_top_k_minus_one_are_accepted() -> None:
    content = line("a", "/v1/completions", model="demo", prompt="x", top_p=0, top_k=-1).encode()
    assert parse_batch_file(content)[0].body.top_p == 0  # type: ignore[attr-defined]
