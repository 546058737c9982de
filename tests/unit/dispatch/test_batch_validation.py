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
