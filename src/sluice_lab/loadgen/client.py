"""One streaming OpenAI-compatible request, timed on the client.

Works against any server that speaks the OpenAI streaming API (sluice, vLLM, ...): POST
/v1/chat/completions or /v1/completions with `stream: true` and
`stream_options.include_usage`, then read `data:` SSE lines until `[DONE]`. Each chunk that
carries text is one token event (servers stream one token per chunk; a chunk with several
tokens counts as one event, which is what a user sees). `ignore_eos` is a vLLM extension that
sluice also accepts; it is only sent when the scenario asks for it.

With `reconnects` > 0 a broken connection is not an error yet: the request re-attaches to the
rest of its stream as `sluice.client` does (`GET .../{id}/events` with `Last-Event-ID`, or the
same POST with its `Idempotency-Key` when nothing had arrived), up to that many times, and its
timings go on in the same result (the stall shows in its ITL). Off by default: a server without
resumable streams (vLLM, ...) would answer the re-attach with a 404, or run a re-sent POST twice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import httpx

from sluice import objectives
from sluice.client import EventParser, attach_target
from sluice.objectives import Objective
from sluice.telemetry import RequestRecord, make_record

RECONNECT_BACKOFF_S = 0.2  # times the attempt number


@dataclass(slots=True)
class RequestSpec:
    local_id: str
    workload: str
    tenant: str
    api_key: str = field(repr=False)
    prompt: str
    max_tokens: int
    service_tier: str | None
    ignore_eos: bool
    temperature: float


@dataclass(slots=True)
class ClientResult:
    spec: RequestSpec
    sent: float  # unix s, just before the request was written
    request_id: str = ""  # the server's response id ("" until the first chunk)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    service_tier: str = ""  # as echoed by the server
    error: str = ""  # "" = success; else a short type: http_429, http_500, timeout, connect, stream
    error_detail: str = ""
    reconnects: int = 0  # broken connections it re-attached after (send_streaming's `reconnects`)
    # The targets the server says it served the request against (sluice's X-Sluice-Objective);
    # None: the answer had no such header (another server, or an error before it was served).
    objective: Objective | None = None
    # The TTFT sluice predicted at admission (X-Sluice-Predicted-TTFT-Ms), to set beside the TTFT
    # measured here; None: no such header (no target, not predictable, or another server).
    predicted_ttft_s: float | None = None

    @property
    def ok(self) -> bool:
        return not self.error

    def to_record(self, model: str) -> RequestRecord:
        finish = max(self.finish, self.sent)
        return make_record(
            request_id=self.request_id or self.spec.local_id, tenant=self.spec.tenant, model=model,
            priority_class=self.service_tier or self.spec.service_tier or "default", worker="",
            arrival=self.sent, dispatch_time=None, first_token_time=self.first_token,
            finish_time=finish, token_times=self.token_times, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, cached_tokens=self.cached_tokens,
            finish_reason=self.finish_reason or ("error" if self.error else "stop"),
            ttft_target_s=self.objective.ttft_s if self.objective is not None else None,
            itl_target_s=self.objective.itl_s if self.objective is not None else None,
            predicted_ttft_s=self.predicted_ttft_s,
        )


def build_body(spec: RequestSpec, model: str, endpoint: str) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.service_tier:
        body["service_tier"] = spec.service_tier
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return body


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _apply_chunk(result: ClientResult, chunk: dict, endpoint: str, now: float) -> None:
    result.request_id = result.request_id or str(chunk.get("id", ""))
    result.service_tier = result.service_tier or str(chunk.get("service_tier") or "")
    if _chunk_text(chunk, endpoint):
        if result.first_token is None:
            result.first_token = now
        result.token_times.append(now)
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason"):
            result.finish_reason = str(choice["finish_reason"])
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens") or 0)


class _Cut(Exception):
    """The stream ended without `[DONE]` or an error event: the connection was cut."""


async def send_streaming(client: httpx.AsyncClient, spec: RequestSpec, *, model: str,
                         endpoint: str, reconnects: int = 0) -> ClientResult:
    """Send one request and time every chunk; never raises for server or network faults.
    `reconnects`: how many broken connections to re-attach after (module docstring)."""
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    if reconnects:
        headers["Idempotency-Key"] = uuid.uuid4().hex
        headers["X-Sluice-Resumable"] = "1"  # events with ids (docs/streams.md)
    body = build_body(spec, model, endpoint)
    path = endpoint_path(endpoint)
    result = ClientResult(spec=spec, sent=time.time())
    last_id = ""
    while True:
        if last_id:
            url, resume = attach_target(path, last_id)
            call = client.stream("GET", url, headers={**headers, **resume})
        else:
            call = client.stream("POST", path, json=body, headers=headers)
        try:
            async with call as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    result.error = f"http_{resp.status_code}"
                    result.error_detail = text[:300]
                    break
                if result.objective is None:
                    result.objective = objectives.parse_served(resp.headers.get(objectives.HEADER))
                    result.predicted_ttft_s = objectives.parse_predicted_ttft(
                        resp.headers.get(objectives.PREDICTED_TTFT_HEADER))
                parser = EventParser()
                async for line in resp.aiter_lines():
                    event = parser.feed(line.rstrip("\r"))
                    if event is None:
                        continue
                    event_id, payload = event
                    last_id = event_id or last_id
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = "stream"
                        result.error_detail = str(chunk["error"])[:300]
                        break
                    _apply_chunk(result, chunk, endpoint, time.time())
                else:
                    raise _Cut("the stream ended without [DONE]")
            break
        except (httpx.TransportError, httpx.StreamError, _Cut) as exc:
            if result.reconnects >= reconnects:
                result.error, result.error_detail = _fault(exc)
                break
            result.reconnects += 1
            await asyncio.sleep(RECONNECT_BACKOFF_S * result.reconnects)
        except json.JSONDecodeError as exc:
            result.error, result.error_detail = "stream", f"{type(exc).__name__}: {exc}"[:300]
            break
    result.finish = time.time()
    if not result.error and not result.completion_tokens:
        result.completion_tokens = len(result.token_times)  # server sent no usage chunk
    return result


def _fault(exc: Exception) -> tuple[str, str]:
    """The short error type and detail of a connection that broke for good."""
    if isinstance(exc, httpx.TimeoutException):
        return "timeout", type(exc).__name__
    if isinstance(exc, httpx.ConnectError):
        return "connect", str(exc)[:300]
    return "stream", f"{type(exc).__name__}: {exc}"[:300]
