"""A streaming client that survives a broken connection: each SSE event exactly once.

    from sluice.client import stream_chat
    for event in stream_chat("http://127.0.0.1:8000", key, {"model": "demo", "messages": [...]}):
        print(event.data)          # the chunk JSON (a dict); an error event ends the stream

It POSTs `/v1/chat/completions` with `stream: true` and a fresh `Idempotency-Key`. When the
connection breaks (or the stream ends without `[DONE]` and without an error event), it reconnects:
with the last event's id it attaches with `GET /v1/chat/completions/{id}/events` and
`Last-Event-ID`, otherwise (nothing received yet) it re-sends the POST with the same key, which
attaches to the response the first POST started instead of starting another. `base_urls` may
list several replicas: each retry goes to the next one. Works with any httpx transport; the
official `openai` SDK does not expose the event ids (docs/streams.md).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class Event:
    id: str  # "<response id>:<seq>"
    data: Any  # the parsed JSON payload; None for [DONE] (not yielded)

    @property
    def is_error(self) -> bool:
        return isinstance(self.data, dict) and "error" in self.data


class StreamBroken(Exception):
    """Still broken after `max_attempts` connections."""


class EventParser:
    """SSE lines in, one (id, data) per complete event out; comments and unknown fields skipped.
    Incremental, so sync and async readers (this module, the load generator) share it."""

    def __init__(self) -> None:
        self._id, self._data = "", list[str]()

    def feed(self, line: str) -> tuple[str, str] | None:
        if not line:
            event = (self._id, "\n".join(self._data)) if self._data else None
            self._id, self._data = "", []
            return event
        if line.startswith("id:"):
            self._id = line[3:].strip()
        elif line.startswith("data:"):
            self._data.append(line[5:].lstrip(" "))
        return None


def _events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(id, data) per SSE event of `lines`."""
    parser = EventParser()
    for line in lines:
        if (event := parser.feed(line)) is not None:
            yield event


def attach_target(path: str, last_event_id: str) -> tuple[str, dict[str, str]]:
    """Where a client that saw `last_event_id` re-attaches to the rest of the stream, and the header
    that says from where: `GET {path}/{response id}/events` with `Last-Event-ID`."""
    response_id = last_event_id.rpartition(":")[0]
    return f"{path}/{response_id}/events", {"last-event-id": last_event_id}


def stream_chat(
    base_urls: str | Sequence[str],
    api_key: str,
    body: dict[str, Any],
    *,
    path: str = "/v1/chat/completions",
    max_attempts: int = 5,
    backoff_s: float = 0.2,
    timeout_s: float = 60.0,
    client: httpx.Client | None = None,
) -> Iterator[Event]:
    """Yields each event of the streamed completion once, reconnecting on a broken connection.
    `path` may be `/v1/completions`. Raises StreamBroken after `max_attempts` broken connections,
    httpx.HTTPStatusError for an HTTP error answer (a 4xx is not retried)."""
    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
    if not urls:
        raise ValueError("stream_chat needs at least one base URL")
    headers = {"authorization": f"Bearer {api_key}", "idempotency-key": uuid.uuid4().hex, "x-sluice-resumable": "1"}
    payload = {**body, "stream": True}
    last_id = ""
    own = client is None
    http = client or httpx.Client(timeout=timeout_s)
    try:
        for attempt in range(max_attempts):
            base = urls[attempt % len(urls)].rstrip("/")
            if last_id:
                url, resume = attach_target(path, last_id)
                request = http.build_request("GET", base + url, headers={**headers, **resume})
            else:
                request = http.build_request("POST", base + path, headers=headers, json=payload)
            try:
                response = http.send(request, stream=True)
                try:
                    if response.status_code >= 500:
                        raise httpx.TransportError(f"HTTP {response.status_code}")  # retried
                    response.raise_for_status()
                    for event_id, data in _events(response.iter_lines()):
                        if data == "[DONE]":
                            return
                        event = Event(event_id, json.loads(data))
                        if event_id:
                            last_id = event_id
                        yield event
                        if event.is_error:
                            return
                finally:
                    response.close()
            except (httpx.TransportError, httpx.StreamError):
                pass
            time.sleep(backoff_s * (attempt + 1))
        raise StreamBroken(f"the stream broke {max_attempts} times (last event {last_id or 'none'})")
    finally:
        if own:
            http.close()
