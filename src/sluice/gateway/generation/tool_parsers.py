"""Tool calls out of a model's text, per family, for streamed and whole answers alike.

One incremental parser (`ToolCallParser`) serves both: a stream feeds it each delta's text and
sends what it returns (content, and `tool_calls` deltas as OpenAI sends them: index, id, type and
name in a call's first delta, then `arguments` in pieces); a whole answer feeds it the whole text
(`parse_whole`), so the two never disagree.

Formats (generation/tools.py picks one per model):
- `hermes` (Hermes, Qwen, and the fallback for templates without tool support): calls are
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere after some text. The
  arguments stream as the model writes them (a scanner finds where the JSON value ends);
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}` (several joined by `;`).
For `mistral` and `llama3_json` the calls are parsed when the answer ends, and each call's
arguments go in one delta. Text that does not parse as calls stays content (as vLLM does).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from sluice.gateway.edge.schemas import ToolCall, ToolCallDelta, ToolCallFunction, ToolCallFunctionDelta
from sluice.gateway.generation.tools import ToolFormat

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_OPEN = "[TOOL_CALLS]"
# The start of a Hermes call, up to its arguments' value: the name comes first in every model we serve.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def tool_calls_finish(finish: str | None) -> str | None:
    """An answer that called tools and then stopped ends with "tool_calls" (OpenAI's reason)."""
    return "tool_calls" if finish == "stop" else finish


def call_id(request_id: str, index: int) -> str:
    """A call's id, the same wherever the answer is parsed (a whole answer, a stream, the replica
    that takes a stream over): derived from the request and the call's index."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


class _ValueEnd:
    """Finds where a JSON object or array ends, fed piece by piece (strings and escapes respected)."""

    __slots__ = ("depth", "escaped", "in_string")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> int | None:
        """The index in `text` just after the value's end, or None when it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass(slots=True)
class Parsed:
    """What one piece of text adds: content for `delta.content`, and tool-call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser:
    """Incremental tool-call parser of one answer (module docstring)."""

    def __init__(self, fmt: ToolFormat, request_id: str) -> None:
        self.fmt = fmt
        self.request_id = request_id
        self.num_calls = 0
        self._buffer = ""  # text not yet given out
        self._in_call = False  # hermes: after <tool_call>
        self._args: _ValueEnd | None = None  # hermes: streaming a call's arguments
        self._args_done = False
        self._started = False  # mistral / llama3_json: the answer is calls (buffered to the end)
        self._seen_text = False

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        if self.fmt == "hermes":
            self._hermes(out)
        else:
            self._whole_formats(out)
        return _merged(out)

    def finish(self) -> Parsed:
        """The end of the answer: what was held back (a partial marker, unparsed calls)."""
        out = Parsed()
        if self.fmt != "hermes":
            if self._started:
                calls = _parse_calls(self._buffer, self.fmt)
                if calls is None:
                    out.content = self._buffer
                else:
                    out.calls = [self._whole_delta(name, args) for name, args in calls]
            else:
                out.content = self._buffer
        elif not self._in_call:
            out.content = self._buffer
        elif self._args is None:  # a call cut before its arguments began
            call = _json_call(self._buffer.split(_HERMES_CLOSE, 1)[0])
            if call is not None:
                out.calls.append(self._whole_delta(*call))
            elif self.num_calls == 0:
                out.content = _HERMES_OPEN + self._buffer
        self._buffer = ""
        return _merged(out)

    # ---- hermes ------------------------------------------------------------------------------

    def _hermes(self, out: Parsed) -> None:
        while self._buffer:
            if not self._in_call:
                at = self._buffer.find(_HERMES_OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, _HERMES_OPEN)
                    out.content += self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return
                out.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(_HERMES_OPEN):]
                self._in_call, self._args, self._args_done = True, None, False
                continue
            if self._args is None:
                head = _CALL_HEAD.match(self._buffer)
                if head is None or head.end() == len(self._buffer):  # wait for the value's first character
                    close = self._buffer.find(_HERMES_CLOSE)
                    if close < 0:
                        return
                    call = _json_call(self._buffer[:close])  # another key order: parsed whole
                    if call is not None:
                        out.calls.append(self._whole_delta(*call))
                    else:  # not a call after all: the text stays the answer's
                        out.content += _HERMES_OPEN + self._buffer[:close + len(_HERMES_CLOSE)]
                    self._buffer = self._buffer[close + len(_HERMES_CLOSE):]
                    self._in_call = False
                    continue
                name = json.loads(head.group(1))
                out.calls.append(ToolCallDelta(index=self.num_calls, id=call_id(self.request_id, self.num_calls),
                                               type="function",
                                               function=ToolCallFunctionDelta(name=name, arguments="")))
                self.num_calls += 1
                self._buffer = self._buffer[head.end():]
                self._args = _ValueEnd()
                continue
            if not self._args_done:
                end = self._args.feed(self._buffer)
                piece = self._buffer if end is None else self._buffer[:end]
                if piece:
                    out.calls.append(ToolCallDelta(index=self.num_calls - 1,
                                                   function=ToolCallFunctionDelta(arguments=piece)))
                self._buffer = "" if end is None else self._buffer[end:]
                self._args_done = end is not None
                continue
            close = self._buffer.find(_HERMES_CLOSE)  # the call's closing brace and tag: dropped
            if close < 0:
                self._buffer = self._buffer[len(self._buffer) - _partial_suffix(self._buffer, _HERMES_CLOSE):]
                return
            self._buffer = self._buffer[close + len(_HERMES_CLOSE):].lstrip()
            self._in_call = False

    # ---- mistral, llama3_json ------------------------------------------------------------------

    def _whole_formats(self, out: Parsed) -> None:
        if self._started:
            return
        stripped = self._buffer.lstrip()
        if not stripped:
            return
        # Mistral: `[TOOL_CALLS]`, or the array alone (workers skip special tokens in their text).
        markers = (_MISTRAL_OPEN, "[{") if self.fmt == "mistral" else ("{",)
        if not self._seen_text and any(stripped.startswith(m) for m in markers):
            self._started = True
            return
        if not self._seen_text and any(m.startswith(stripped) for m in markers):
            return  # maybe a marker, not complete yet
        self._seen_text = True
        if self.fmt == "mistral":  # calls may follow some text
            at = self._buffer.find(_MISTRAL_OPEN)
            if at >= 0:
                out.content, self._buffer, self._started = self._buffer[:at], self._buffer[at:], True
                return
            keep = _partial_suffix(self._buffer, _MISTRAL_OPEN)
            out.content, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            return
        out.content, self._buffer = self._buffer, ""

    def _whole_delta(self, name: str, arguments: Any) -> ToolCallDelta:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        delta = ToolCallDelta(index=self.num_calls, id=call_id(self.request_id, self.num_calls), type="function",
                              function=ToolCallFunctionDelta(name=name, arguments=text))
        self.num_calls += 1
        return delta


def _merged(parsed: Parsed) -> Parsed:
    """One delta per call (a call's name and first arguments piece together), as OpenAI sends them."""
    calls: list[ToolCallDelta] = []
    for delta in parsed.calls:
        if calls and calls[-1].index == delta.index:
            calls[-1].function.arguments += delta.function.arguments
        else:
            calls.append(delta)
    parsed.calls = calls
    return parsed


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: it may become it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_call(text: str) -> tuple[str, Any] | None:
    """{"name": ..., "arguments" | "parameters": ...} as (name, arguments), or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], arguments


def _parse_calls(text: str, fmt: ToolFormat) -> list[tuple[str, Any]] | None:
    text = text.strip()
    if fmt == "mistral":
        try:
            value = json.loads(text.removeprefix(_MISTRAL_OPEN))
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [_json_call(json.dumps(item)) for item in items]
    else:
        calls = [_json_call(part) for part in text.split(";")] if text else []
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def parse_whole(text: str, fmt: ToolFormat, request_id: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None when it is only calls) and its tool calls."""
    parser = ToolCallParser(fmt, request_id)
    content: list[str] = []
    by_index: dict[int, ToolCall] = {}
    for parsed in (parser.feed(text), parser.finish()):
        content.append(parsed.content)
        for delta in parsed.calls:
            call = by_index.get(delta.index)
            if call is None:
                by_index[delta.index] = ToolCall(id=str(delta.id), function=ToolCallFunction(
                    name=str(delta.function.name), arguments=delta.function.arguments))
            else:
                call.function.arguments += delta.function.arguments
    calls = [by_index[i] for i in sorted(by_index)]
    joined = "".join(content)
    return (None if calls and not joined.strip() else joined), calls
