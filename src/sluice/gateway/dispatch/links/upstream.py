"""HTTP upstreams: an OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp, another sluice) as a worker.

Organisations already run inference servers; sluice puts its tenants, quotas, durable queues and
fair scheduling in front of them without replacing them. The queue stays at the gateway: an
`UpstreamLink` is one more kind of `WorkerLink` (gateway/dispatch/links/base.py), so the dispatcher sends it
jobs by the same scheduler and room rule as a worker process, and its deltas feed the same
quotas, usage, records and metrics. docs/upstreams.md is the operator's view.

Room: at most `max_concurrency` requests sent and not finished (`accepting`). Kind "vllm": the link
also reads GET /metrics every second and estimates the server's own waiting queue as its
`vllm:num_requests_waiting` plus the jobs sent since that reading that have not started; the
dispatcher's room rule (`dispatch.max_worker_waiting`) applies to that estimate as to a worker's
report, so the server's queue stays short and priority is decided here (the TNG lever). Kind
"openai": the cap alone (such a server reports no queue).

Requests (upstream_body.py): POST /v1/completions with the gateway's token ids as the prompt (so usage, prefix salts
and templates stay sluice's), the sampling parameters mapped, `stream: true` with usage. Each
streamed chunk becomes a RequestDelta (token ids when the server returns them, vLLM's
`return_token_ids`; logprobs from kind "vllm", checked as upstream_chunks.py says); the final one
carries the server's completion token count.

Context: each served model's `max_model_len` from the server's /v1/models (`max_model_lens`, read
at every attach); the gateway checks requests against the smaller of it and its own.

Failures, each ending the job as a worker's would (no URL or key ever reaches a client or a log):
- the server refuses the request itself (`REFUSAL_STATUSES`): the job ends with its status and
  message (`RequestDelta.error_status`), which the client gets as that same HTTP error;
- an HTTP error status, an error event, a timeout: this job ends with finish_reason ERROR and a
  message naming the upstream by its configured name;
- a transport error (refused, reset, the stream cut): this job is handled as if its worker were
  lost (a batch line is re-queued, a stream ends with an error) and the server is probed at once;
- a failed probe: the link is lost, every job as `Dispatcher._lose_worker` handles them; probing
  goes on in the background and re-attaches the link once the server answers again;
- client disconnect: the dispatcher's abort cancels the job's task, which closes the HTTP stream
  (vLLM aborts a request whose stream is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from sluice.gateway.dispatch.cache_index import CacheIndex
from sluice.gateway.dispatch.links.base import LinkHost
from sluice.gateway.dispatch.links.upstream_body import UpstreamError, completion_body
from sluice.gateway.dispatch.links.upstream_chunks import MalformedChunk, billed_completion, read_choice
from sluice.gateway.dispatch.links.upstream_http import StreamedResponse, TransportError, UpstreamHTTP
from sluice.gateway.dispatch.links.vllm_kv_events import UpstreamKvEvents
from sluice.gateway.dispatch.slots import has_room
from sluice.gateway.dispatch.ttft import WorkerLoad
from sluice.protocol import FinishReason, GenerateRequest, Priority, RequestDelta
from sluice.settings import Settings, UpstreamSpec, upstream_root

if TYPE_CHECKING:
    from sluice.gateway.dispatch.jobs import Job

log = logging.getLogger(__name__)

METRICS_INTERVAL_S = 1.0  # kind vllm: how often its /metrics gauges are read
_KV_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the second: older vLLM versions
_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", *_KV_GAUGES)
_GAUGE_LINES = tuple(f"{name}{after}" for name in _GAUGES for after in ("{", " ")) + tuple(
    f"# {kind} {name} " for name in _GAUGES for kind in ("HELP", "TYPE"))
KV_FULL = 0.95  # kind vllm: at this `vllm:kv_cache_usage_perc` its batch takes nothing more
DRAIN_AFTER_DONE_S = 1.0  # after [DONE], the server's end of the body is awaited this long (else: closed)
MAX_ERROR_DETAIL = 300  # characters of an upstream's own error message passed on to the client
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode  # msgspec.DecodeError (a ValueError) on garbage


# An upstream's answer that says the request itself is wrong (too long, a bad parameter): the
# client gets the same status and the server's message. 401/403/404 (our key, our model name) and
# 429/5xx are the deployment's problems, not the client's: those stay a 500 for the client.
REFUSAL_STATUSES = frozenset({400, 413, 422})


def vllm_gauges(text: str) -> tuple[int, int, float]:
    """(waiting, running, KV cache use) from a vLLM server's /metrics; ValueError when they are not
    there or do not parse. Only the gauges' own lines are parsed: the whole exposition (~60 KB,
    ~650 lines of histograms) cost 24 ms of the gateway's loop per reading, each second."""
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_GAUGE_LINES)) + "\n"
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(lines):  # ValueError on garbage
        values = [sample.value for sample in family.samples]
        if family.name in _KV_GAUGES:
            found["kv"] = max(values, default=0.0)
        elif family.name in _GAUGES:
            found[family.name] = sum(values)
    if "vllm:num_requests_waiting" not in found or "vllm:num_requests_running" not in found:
        raise ValueError("no vllm:num_requests_waiting / vllm:num_requests_running gauge")
    if not all(math.isfinite(v) and v >= 0 for v in found.values()):
        raise ValueError(f"a gauge out of range: {found}")
    return int(found["vllm:num_requests_waiting"]), int(found["vllm:num_requests_running"]), found.get("kv", 0.0)


class UpstreamRefused(UpstreamError):
    """The upstream refused this request as invalid (`REFUSAL_STATUSES`); its own message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def upstream_api_key(spec: UpstreamSpec) -> str:
    """The upstream's API key from its `api_key_env` variable ("" when it has none); ValueError
    when the variable is not set (a start error, naming the variable, never a value)."""
    if not spec.api_key_env:
        return ""
    key = os.environ.get(spec.api_key_env, "")
    if not key:
        raise ValueError(f"upstream {spec.name!r}: the environment variable {spec.api_key_env} "
                         "(its api_key_env) is not set")
    return key


def _headers(request_id: str, traceparent: str | None) -> dict[str, str]:
    """Our request id, and the request's trace context so the server's spans join its trace."""
    if traceparent is None:
        return {"x-request-id": request_id}
    return {"x-request-id": request_id, "traceparent": traceparent}


def _error_message(raw: bytes) -> str:
    """The upstream's own error message (OpenAI's {"error": {"message"}} shape), short; "" if none."""
    try:
        data = json.loads(raw)
    except ValueError:
        return ""
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
    if not isinstance(message, str) and isinstance(data, dict):
        message = data.get("message") or data.get("detail")
    return str(message)[:MAX_ERROR_DETAIL] if message else ""


def _error_detail(raw: bytes) -> str:
    message = _error_message(raw)
    return f": {message}" if message else ""


@dataclass(slots=True, eq=False)
class _Stream:
    """One request on its way through the upstream."""

    request: GenerateRequest
    task: asyncio.Task[None] | None = None
    num_output_tokens: int = 0
    aborting: bool = False
    ended: bool = False  # its final delta was delivered


class UpstreamLink:
    """One [[upstreams]] server as a worker (a `WorkerLink`); one httpx client, probed in the background."""

    resumes = False  # it would start a resumed job over, and may send no token ids

    def __init__(self, spec: UpstreamSpec, host: LinkHost, settings: Settings) -> None:
        self.spec = spec
        self.worker_id = f"upstream/{spec.name}"
        self.models = frozenset(spec.models)
        self.inflight: dict[str, Job] = {}
        self.last_seen = time.monotonic()
        self.sent = 0
        # Exact from the server's own KV events where it publishes them (vllm_kv_events.py); else
        # approximate, filled from the prompts sent here.
        self.cache = CacheIndex(settings.routing.max_index_blocks, approximate=not spec.kv_events_endpoint)
        self.kv_events = (UpstreamKvEvents(spec.kv_events_endpoint, spec.kv_events_topic, self.cache, name=spec.name)
                          if spec.kv_events_endpoint else None)
        self._host = host
        self._priority_enabled = settings.scheduler.priority_enabled
        self._probe_interval_s = METRICS_INTERVAL_S if spec.kind == "vllm" else settings.dispatch.heartbeat_interval_s
        self._probe_timeout_s = settings.dispatch.heartbeat_timeout_s
        # A sluice upstream keeps generating through a disconnect for its resumable-stream grace
        # unless told otherwise: closing our stream means abort (vLLM aborts on a close anyway).
        headers = {"user-agent": "sluice-gateway", "x-sluice-disconnect": "abort"}
        key = upstream_api_key(spec)
        if key:
            headers["authorization"] = f"Bearer {key}"
        # Probes go through httpx; the completions through the lean streaming client (its
        # module says why), bounded as a whole by request_timeout_s.
        self._client = httpx.AsyncClient(
            base_url=upstream_root(spec.base_url), headers=headers,
            timeout=httpx.Timeout(spec.request_timeout_s, connect=spec.connect_timeout_s),
            limits=httpx.Limits(max_connections=2, max_keepalive_connections=1))
        self._http = UpstreamHTTP(upstream_root(spec.base_url), headers, connect_timeout_s=spec.connect_timeout_s)
        self._streams: dict[str, _Stream] = {}
        self._attached = False
        self._suspect = False
        self._probe_now = asyncio.Event()
        self._probe_task: asyncio.Task[None] | None = None
        # Each served model's context as the server publishes it (/v1/models `max_model_len`, read
        # at every attach): requests are checked against the smaller of it and sluice's own.
        self.max_model_lens: dict[str, int] = {}
        # Kind vllm: its gauges at the last /metrics reading, and when it was taken (unix s).
        self.num_waiting = 0
        self.num_running = 0
        self.kv_usage = 0.0  # vllm:kv_cache_usage_perc, 0..1
        self._read_at = 0.0

    # ---- room (the WorkerLink interface) -------------------------------------------------------

    @property
    def accepting(self) -> bool:
        # Suspect: a request just lost its connection; nothing more goes out until a probe answers
        # (else a re-queued batch line would spend its attempts on a dead server at once).
        return not self._suspect and len(self.inflight) < self.spec.max_concurrency

    @property
    def est_waiting(self) -> int:
        """Kind vllm: the server's queue as it is now. Its last reading plus what was sent since,
        but never more than this link's jobs with no token yet: a job that starts (its first token)
        or ends frees room at once, not at the next reading a second later. Of those, the ones its
        batch can take now (`max_num_seqs` minus this link's running jobs, while its KV has room)
        are not waiting: they join the running batch at its next step."""
        if self.spec.kind != "vllm":
            return 0  # no queue is reported: the cap alone bounds what is sent
        unstarted = sent_since = 0
        for job in self.inflight.values():
            if not job.started:
                unstarted += 1
                sent_since += (job.state.dispatch_time or 0.0) >= self._read_at
        queued = min(self.num_waiting + sent_since, unstarted)
        batch_room = 0
        if self.spec.max_num_seqs and self.kv_usage < KV_FULL:
            batch_room = max(0, self.spec.max_num_seqs - (len(self.inflight) - unstarted))
        return max(0, queued - batch_room)

    def has_room_for(self, priority: Priority, max_waiting: int) -> bool:
        waiting = self.est_waiting
        if waiting < max_waiting:  # the rule's first case, decided without listing the unstarted
            return True  # jobs: a kind "openai" server with hundreds in flight is asked per dispatch
        unstarted = [job.request.priority for job in self.inflight.values() if not job.started]
        return has_room(waiting, unstarted, priority, max_waiting)

    @property
    def load(self) -> float:
        return len(self.inflight) / self.spec.max_concurrency

    @property
    def kv_use(self) -> float:
        return 0.0  # not reported

    @property
    def ttft_load(self) -> WorkerLoad | None:
        return None  # an upstream reports no step cost

    def view(self, draining: bool = False) -> dict[str, Any]:
        unstarted = sum(1 for job in self.inflight.values() if not job.started)
        vllm = self.spec.kind == "vllm"
        return {
            "worker_id": self.worker_id, "models": sorted(self.models), "device": f"upstream ({self.spec.kind})",
            "kind": "upstream", "alive": True, "inflight": len(self.inflight),
            "max_concurrency": self.spec.max_concurrency,
            "num_running": self.num_running if vllm else len(self.inflight) - unstarted,
            "num_waiting": self.num_waiting if vllm else unstarted,
            "est_waiting": self.est_waiting, "load": round(self.load, 3),
            "total_kv_blocks": 0, "free_kv_blocks": 0,
            "last_heartbeat_age_s": round(time.monotonic() - self.last_seen, 3), "draining": draining,
            "cache_index_blocks": len(self.cache),
            # Where the index comes from: the server's own KV events, or what this gateway sent.
            "cache_index": "kv_events" if self.kv_events is not None else "approximate",
            "cache_block_size": self.cache.block_size,  # the server's, once its events have named it
        }

    # ---- requests ------------------------------------------------------------------------------

    def send(self, request: GenerateRequest) -> None:
        self.sent += 1
        stream = _Stream(request)
        self._streams[request.request_id] = stream
        stream.task = asyncio.get_running_loop().create_task(self._run(stream), name=f"upstream-{request.request_id}")
        stream.task.add_done_callback(lambda _task: self._ended(stream))

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.task is not None and not stream.aborting:
            stream.aborting = True
            stream.task.cancel()  # leaving `client.stream` closes the connection: the server aborts

    def _ended(self, stream: _Stream) -> None:
        """Its task is done. An abort that cancelled the task before its first step (a batch
        cancel right after the dispatch round that sent it) never ran `_run`'s handler: its final
        delta is delivered here, or the job would wait at this link for ever (the batch stuck in
        `cancelling`, the line without a result)."""
        if stream.aborting and not stream.ended and self._streams.get(stream.request.request_id) is stream:
            self._end(stream, FinishReason.ABORT)
        if self._streams.get(stream.request.request_id) is stream:
            del self._streams[stream.request.request_id]

    def close(self) -> None:
        """The link is lost (the dispatcher took its jobs): every stream is closed, no delta follows."""
        self._attached = False
        for stream in list(self._streams.values()):
            if stream.task is not None:
                stream.task.cancel()
        self._streams.clear()

    async def _run(self, stream: _Stream) -> None:
        request = stream.request
        rid = request.request_id
        try:
            body = _encode(completion_body(request, self.spec, priority_enabled=self._priority_enabled))
            async with asyncio.timeout(self.spec.request_timeout_s):
                async with self._http.post("/v1/completions", body, _headers(rid, request.traceparent)) as response:
                    if response.status in REFUSAL_STATUSES:
                        message = _error_message(await response.read())
                        raise UpstreamRefused(response.status, message or f"upstream {self.spec.name!r} "
                                              f"refused the request (HTTP {response.status})")
                    if response.status >= 400:
                        detail = _error_detail(await response.read())
                        raise UpstreamError(f"upstream {self.spec.name!r} answered HTTP "
                                            f"{response.status}{detail}")
                    await self._relay(stream, response)
        except asyncio.CancelledError:
            if not stream.aborting:
                raise  # the link was lost or the gateway stops: the dispatcher ended the job
            self._end(stream, FinishReason.ABORT)
        except UpstreamRefused as exc:
            self._end(stream, FinishReason.ERROR, str(exc), status=exc.status)
        except UpstreamError as exc:
            self._end(stream, FinishReason.ERROR, str(exc))
        except TimeoutError:
            self._end(stream, FinishReason.ERROR, f"upstream {self.spec.name!r} did not finish this request "
                                                  f"within {self.spec.request_timeout_s:g}s")
        except TransportError as exc:
            log.warning("upstream %s: request %s lost (%s)", self.spec.name, rid, exc)
            self._suspect = True
            self._probe_now.set()
            self._host.lose_job(self, rid, "could not be reached")
        except Exception as exc:  # a bug or a malformed answer ends this job only
            log.warning("upstream %s: request %s failed (%s)", self.spec.name, rid, type(exc).__name__)
            self._end(stream, FinishReason.ERROR, f"upstream {self.spec.name!r} sent an unreadable answer")

    async def _relay(self, stream: _Stream, response: StreamedResponse) -> None:
        """Server-sent events to deltas, until [DONE]; the final delta carries the server's usage.

        Each event is relayed as it arrives, within the connection's read callback
        (`StreamedResponse.each_event`): a token costs no step of this task."""
        request = stream.request
        prompt_tokens = len(request.prompt_token_ids)
        finish: str | None = None
        usage: dict[str, Any] = {}

        max_tokens = request.sampling.max_tokens
        top_logprobs = request.sampling.top_logprobs if request.sampling.logprobs else None
        exact = True  # every chunk with output carried its token ids: the count is exact

        def on_event(data: bytes) -> bool:
            nonlocal finish, usage, exact
            if data == b"[DONE]":
                return True  # the rest of the body is awaited, so the connection is reused
            event = _decode(data)
            if not isinstance(event, dict):
                raise UpstreamError(f"upstream {self.spec.name!r} sent an unreadable event")
            if event.get("error"):
                raise UpstreamError(f"upstream {self.spec.name!r} reported an error{_error_detail(data)}")
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
            choices = event.get("choices")
            if choices is None:
                choices = []  # a chunk without choices (an empty list, the usage chunk, is the usual form)
            if not isinstance(choices, list):
                raise MalformedChunk("choices is not a list")
            for raw in choices:
                choice = read_choice(raw, top_logprobs)
                text, token_ids, positions = choice.text, choice.token_ids, choice.logprobs
                if text or token_ids:
                    exact = exact and bool(token_ids)
                    left = max_tokens - stream.num_output_tokens
                    if len(token_ids) > left:  # past max_tokens: what was reserved is what is relayed
                        token_ids, positions = token_ids[:left], positions[:left]
                    now = time.time()
                    count = len(token_ids) or 1  # no ids: one chunk per token, as servers stream
                    first = now if stream.num_output_tokens == 0 else None
                    stream.num_output_tokens += count
                    self._host.deliver(self, RequestDelta(
                        request_id=request.request_id, token_ids=token_ids, text=text, logprobs=positions,
                        num_prompt_tokens=prompt_tokens, num_output_tokens=stream.num_output_tokens,
                        first_token_time=first, token_times=(now,) * count))
                    if first is not None and self.spec.kind == "vllm":
                        self._host.wake()  # it left the server's queue: room for the next, now
                    if stream.num_output_tokens >= max_tokens and not choice.finish_reason:
                        finish = "length"  # the upstream would go on: sluice stops relaying here
                        return True
                if choice.finish_reason:
                    finish = choice.finish_reason
            return False

        try:
            await response.each_event(on_event, drain_s=DRAIN_AFTER_DONE_S)
        except MalformedChunk as exc:
            raise UpstreamError(f"upstream {self.spec.name!r} sent a malformed chunk ({exc})") from None
        if finish is None:
            raise UpstreamError(f"upstream {self.spec.name!r} ended the stream before the request finished")
        stream.num_output_tokens = billed_completion(
            stream.num_output_tokens, usage.get("completion_tokens"), max_tokens, exact=exact)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = cached if isinstance(cached, int) and not isinstance(cached, bool) else 0
        self._end(stream, _FINISH.get(finish, FinishReason.STOP), cached=min(max(cached, 0), prompt_tokens))

    def _end(self, stream: _Stream, reason: FinishReason, error: str | None = None, *, cached: int = 0,
             status: int | None = None) -> None:
        stream.ended = True
        self._host.deliver(self, RequestDelta(
            request_id=stream.request.request_id, finish_reason=reason, error=error, error_status=status,
            num_prompt_tokens=len(stream.request.prompt_token_ids),
            num_output_tokens=stream.num_output_tokens, num_cached_tokens=cached))

    # ---- health --------------------------------------------------------------------------------

    def start(self) -> None:
        self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop(), name=f"probe-{self.worker_id}")
        if self.kv_events is not None:
            self.kv_events.start()

    async def shutdown(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        self.close()
        await self._http.aclose()
        await self._client.aclose()

    async def _probe_loop(self) -> None:
        down_reason = ""  # logged once per outage
        while True:
            reason = await self._probe()
            if not reason:
                self.last_seen = time.monotonic()
                if self._suspect:
                    self._suspect = False
                    self._host.wake()
                if not self._attached and self._host.attach(self):
                    self._attached = True
                    log.info("upstream %s reachable: serving %s (kind %s, max_concurrency %d)", self.spec.name,
                             ", ".join(sorted(self.models)), self.spec.kind, self.spec.max_concurrency)
                down_reason = ""
            else:
                if self._attached:
                    self._host.lose(self, reason)  # calls close(): _attached is False after it
                    self._attached = False
                if reason != down_reason:
                    log.warning("upstream %s %s; its requests wait, probing again every %.1fs",
                                self.spec.name, reason, self._probe_interval_s)
                    down_reason = reason
            self._probe_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._probe_now.wait(), self._probe_interval_s)

    async def _get(self, path: str, *, optional: bool = False) -> httpx.Response | str | None:
        """The answer to a probe's GET, or why there is none (safe to log: no URL, no key);
        `optional`: None when the server does not serve that path (an HTTP error other than 401/403)."""
        try:
            response = await self._client.get(path, timeout=self._probe_timeout_s)
        except httpx.HTTPError as exc:
            return f"could not be reached ({type(exc).__name__})"
        if response.status_code in (401, 403):
            return f"refused the API key (HTTP {response.status_code} on {path})"
        if response.status_code >= 400:
            return None if optional else f"answered HTTP {response.status_code} on {path}"
        return response

    async def _probe(self) -> str:
        """"" when the server answers as it should, else why not (safe to log: no URL, no key)."""
        vllm = self.spec.kind == "vllm"
        if vllm and not self._attached:  # its models' contexts, before it serves (a vllm kind's
            models = await self._get("/v1/models", optional=True)  # probe reads /metrics, without them)
            if isinstance(models, str):
                return models
            if models is not None:
                self._read_models(models)
        path = "/metrics" if vllm else "/v1/models"
        asked_at = time.time()  # jobs sent after this are not in the gauges it answers with
        response = await self._get(path)
        if not isinstance(response, httpx.Response):
            return response or f"did not serve {path}"
        if not vllm:
            self._read_models(response)
        if vllm:
            try:
                self._read_gauges(response.text, asked_at)
            except (ValueError, TypeError, IndexError):  # what the parser raises on garbage
                return "served unreadable /metrics"
        return ""

    def _read_models(self, response: httpx.Response) -> None:
        """Each served model's `max_model_len` from an OpenAI model list (vLLM and sluice publish it;
        a server that does not, or an unreadable list, leaves sluice's own limit alone)."""
        try:
            listed = response.json().get("data")
        except (ValueError, AttributeError):
            return
        published: dict[str, int] = {}
        for card in listed if isinstance(listed, list) else ():
            limit = card.get("max_model_len") if isinstance(card, dict) else None
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                published[str(card.get("id"))] = limit
        self.max_model_lens = {model: published[name] for model in self.models
                               if (name := self.spec.served_names.get(model, model)) in published}

    def _read_gauges(self, text: str, asked_at: float) -> None:
        waiting, running, kv = vllm_gauges(text)
        self.kv_usage = kv
        changed = (waiting, running) != (self.num_waiting, self.num_running)
        self.num_waiting, self.num_running, self._read_at = waiting, running, asked_at
        if changed:
            self._host.wake()  # its queue may have room again
