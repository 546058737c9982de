"""Validation of uploaded batch input files (JSONL, one request per line).

Every line must be a JSON object `{"custom_id": str, "method": "POST", "url": ENDPOINT, "body": {...}}`
with a unique custom_id, one of the two supported endpoints, and a body that decodes as that
endpoint's request. All bad lines are collected; the 400 names the first few with line numbers
and the field at fault (`body.top_k`). A line's body is decoded into the same msgspec types as an
HTTP body, so it meets the same bounds; JSON nested too deeply for the decoders is a bad line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from sluice.gateway.edge.schemas import ChatCompletionRequest, CompletionRequest

ENDPOINTS: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
MAX_LINES = 50_000
MAX_CUSTOM_ID = 512
SHOWN_ERRORS = 5
_PATH = re.compile(r" - at `\$\.?([^`]*)`")


@dataclass(frozen=True, slots=True)
class BatchLine:
    line_no: int  # 1-based
    custom_id: str
    url: str
    body: msgspec.Struct  # ChatCompletionRequest | CompletionRequest


class InvalidBatchFile(ValueError):
    """The file has bad lines; `errors` holds (line number, message) for every one found."""

    def __init__(self, errors: list[tuple[int, str]]) -> None:
        self.errors = errors
        shown = "; ".join(f"line {n}: {m}" for n, m in errors[:SHOWN_ERRORS])
        more = f" (and {len(errors) - SHOWN_ERRORS} more bad lines)" if len(errors) > SHOWN_ERRORS else ""
        super().__init__(f"The batch input file is invalid: {shown}{more}.")


def _line(number: int, text: str, seen: set[str]) -> BatchLine:
    try:
        obj: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise ValueError(f"custom_id is longer than {MAX_CUSTOM_ID} characters")
    if custom_id in seen:
        raise ValueError(f"custom_id {custom_id!r} is used more than once")
    if obj.get("method") != "POST":
        raise ValueError(f'method must be "POST", got {obj.get("method")!r}')
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise ValueError(f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    if body.get("stream"):
        raise ValueError("body.stream must not be true in a batch")
    try:
        request = msgspec.convert(body, ENDPOINTS[url])
    except msgspec.ValidationError as exc:
        raise ValueError(_body_error(str(exc))) from None
    except RecursionError:
        raise ValueError("the body is nested too deeply") from None
    seen.add(custom_id)
    return BatchLine(line_no=number, custom_id=custom_id, url=url, body=request)


def _body_error(message: str) -> str:
    """msgspec's "Expected `int` <= 5 - at `$.top_k`" as "body.top_k: Expected `int` <= 5"."""
    match = _PATH.search(message)
    if match is None:
        return f"invalid body: {message}"
    field = f"body.{match.group(1)}" if match.group(1) else "body"
    return f"{field}: {message[: match.start()]}"


def parse_batch_file(content: bytes) -> list[BatchLine]:
    """All lines of a batch input file; raises InvalidBatchFile listing the bad ones."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidBatchFile([(0, "the file is not UTF-8 text")]) from None
    lines: list[BatchLine] = []
    errors: list[tuple[int, str]] = []
    seen: set[str] = set()
    numbered = [(n, t) for n, t in enumerate(text.splitlines(), start=1) if t.strip()]
    if not numbered:
        raise InvalidBatchFile([(0, "the file has no request lines")])
    if len(numbered) > MAX_LINES:
        raise InvalidBatchFile([(0, f"the file has {len(numbered)} lines; at most {MAX_LINES} are allowed")])
    for number, line in numbered:
        try:
            lines.append(_line(number, line, seen))
        except ValueError as exc:
            errors.append((number, str(exc)))
    if errors:
        raise InvalidBatchFile(errors)
    return lines
