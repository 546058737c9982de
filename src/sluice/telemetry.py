"""Per-request records and Prometheus metrics: the one place sluice's latency numbers come from.

Every finished request (HTTP, Batch API line, or an engine-level experiment) becomes one
`RequestRecord`; `emit_record` writes it as a JSON line on the `sluice.records` logger (and to a
file when `configure(record_log_path=...)` was called) and feeds the same numbers to the
Prometheus histograms, so a dashboard and a JSONL analysis agree on every request's TTFT.

Records never carry secrets or content: no API keys, no prompt or completion text, only ids,
labels, timestamps and token counts.

Times are unix seconds (time.time()); durations are seconds. Percentiles everywhere in sluice are
computed by `percentile()` below (linear interpolation between closest ranks, numpy's default
"linear" method, a.k.a. Hyndman-Fan type 7), so the load generator, the experiments and the
records agree.

Metric names and semantics follow vLLM's (`vllm:time_to_first_token_seconds` and friends) with the
`sluice:` prefix. Label values for tenants and workers are capped (see sluice/metric_labels.py; the tenant cap
is `gateway.metrics_max_tenants`) so a deployment with thousands of tenants cannot explode the series
count: the tenants past the cap share the label value "other".
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sluice.batch_gauges import BatchWindowCollector
from sluice.live_window import WINDOW
from sluice.metric_labels import MAX_TENANT_LABELS, MAX_WORKER_LABELS, class_label, tenant_label, worker_label
from sluice.protocol import WorkerCapacity
from sluice.tenant_gauges import TenantQueueCollector

RECORDS_LOGGER = "sluice.records"
_log = logging.getLogger(RECORDS_LOGGER)


# --------------------------------------------------------------------------------------------
# Percentiles: one definition for the whole project.
# --------------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks.

    Same result as `numpy.percentile(values, q)` (method "linear"). None for no values, so an
    empty series is never reported as a zero latency.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be between 0 and 100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# --------------------------------------------------------------------------------------------
# The record.
# --------------------------------------------------------------------------------------------

class RequestRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished request. Durations are None when the request never reached that point
    (e.g. aborted before its first token)."""

    request_id: str
    tenant: str
    model: str
    priority_class: str  # interactive | standard | batch
    worker: str  # worker id that served it ("" when it never reached one)
    arrival: float  # unix s: request accepted at the gateway (or added to the engine)
    queue_wait_s: float | None  # arrival -> dispatch to a worker
    dispatch_time: float | None
    first_token_time: float | None  # as seen by the component that emits the record
    finish_time: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float | None  # arrival -> first token
    itl_mean_s: float | None  # inter-token latency over the completion's token gaps
    itl_p50_s: float | None
    itl_p95_s: float | None
    itl_max_s: float | None  # worst stall between two tokens of this stream
    e2e_s: float  # arrival -> finish
    finish_reason: str  # stop | length | abort | error
    # Worker-side view: the worker's receipt of the request (else its dispatch, else the engine's
    # first scheduling of it) -> the engine's first token. ttft_s - engine_ttft_s is what the
    # gateway, the queues and the network add.
    engine_ttft_s: float | None = None
    prefill_s: float | None = None  # engine: first scheduled -> first token
    decode_s: float | None = None  # first token -> finish
    batch_id: str | None = None
    engine_first_scheduled: float | None = None  # raw engine timestamps (unix s), for joins
    engine_first_token: float | None = None
    route: str = ""  # why the gateway sent it to `worker` (gateway/dispatch/routing.py; "" = not routed)
    route_cached_tokens: int = 0  # prompt tokens routing expected that worker to have cached
    # Its latency objective (sluice/objectives.py) and whether it was met: TTFT within its target and
    # its own p95 token gap within the ITL target. None: no target, or not judged (the client left).
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    slo_met: bool | None = None
    # The TTFT the gateway predicted at admission (gateway/dispatch/ttft.py), to set beside ttft_s;
    # None: no target, or no worker's TTFT could be predicted.
    predicted_ttft_s: float | None = None


def _gap_summary(token_times: Sequence[float]) -> tuple[float | None, ...]:
    gaps = [b - a for a, b in itertools.pairwise(token_times)]
    if not gaps:
        return None, None, None, None
    return sum(gaps) / len(gaps), percentile(gaps, 50), percentile(gaps, 95), max(gaps)


def _since(end: float | None, start: float | None) -> float | None:
    if end is None or start is None:
        return None
    return max(0.0, end - start)  # clocks of two processes on one host: never report negatives


def make_record(*, request_id: str, tenant: str, model: str, priority_class: str, worker: str,
                arrival: float, dispatch_time: float | None, first_token_time: float | None,
                finish_time: float, token_times: Sequence[float], prompt_tokens: int,
                completion_tokens: int, cached_tokens: int, finish_reason: str,
                engine_first_scheduled: float | None = None, engine_first_token: float | None = None,
                engine_arrival: float | None = None, batch_id: str | None = None, route: str = "",
                route_cached_tokens: int = 0, ttft_target_s: float | None = None,
                itl_target_s: float | None = None, predicted_ttft_s: float | None = None) -> RequestRecord:
    """Build a record from raw timestamps.

    `token_times` are the times each completion token became available (engine-side in the
    worker, or client-side in the gateway); ITL statistics are computed over their gaps.
    `engine_arrival` is when the worker received the request; when absent, `dispatch_time`
    stands in for it in the worker-side TTFT, and without either the engine's first scheduling
    (so the worker's own short waiting queue then counts as overhead, not as worker time).
    """
    if finish_time < arrival:
        raise ValueError(f"record {request_id}: finish_time {finish_time} precedes arrival {arrival}")
    itl_mean, itl_p50, itl_p95, itl_max = _gap_summary(token_times)
    worker_start = next((t for t in (engine_arrival, dispatch_time, engine_first_scheduled)
                         if t is not None), None)
    ttft = _since(first_token_time, arrival)
    return RequestRecord(
        request_id=request_id, tenant=tenant, model=model, priority_class=priority_class,
        worker=worker, arrival=arrival, queue_wait_s=_since(dispatch_time, arrival),
        dispatch_time=dispatch_time, first_token_time=first_token_time, finish_time=finish_time,
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens,
        ttft_s=_since(first_token_time, arrival), itl_mean_s=itl_mean, itl_p50_s=itl_p50,
        itl_p95_s=itl_p95, itl_max_s=itl_max, e2e_s=finish_time - arrival,
        finish_reason=str(finish_reason),
        engine_ttft_s=_since(engine_first_token, worker_start),
        prefill_s=_since(engine_first_token, engine_first_scheduled),
        decode_s=_since(finish_time, first_token_time), batch_id=batch_id,
        engine_first_scheduled=engine_first_scheduled, engine_first_token=engine_first_token,
        route=route, route_cached_tokens=route_cached_tokens,
        ttft_target_s=ttft_target_s, itl_target_s=itl_target_s,
        slo_met=_slo_met(str(finish_reason), ttft, itl_p95, ttft_target_s, itl_target_s),
        predicted_ttft_s=predicted_ttft_s,
    )


def _slo_met(finish_reason: str, ttft_s: float | None, itl_p95_s: float | None,
             ttft_target_s: float | None, itl_target_s: float | None) -> bool | None:
    """Met: a normal finish within both targets. An error misses; an abort (the client left) is not judged."""
    if (ttft_target_s is None and itl_target_s is None) or finish_reason == "abort":
        return None
    if finish_reason == "error" or ttft_s is None:
        return False
    return ((ttft_target_s is None or ttft_s <= ttft_target_s)
            and (itl_target_s is None or itl_p95_s is None or itl_p95_s <= itl_target_s))


def records_from_results(results: Iterable[Any], *, tenant: str = "offline", model: str = "",
                         priority_class: str = "standard", worker: str = "engine",
                         classes: dict[str, str] | None = None) -> list[RequestRecord]:
    """Records for `sluice.workers.engine.GenerationResult`s of an in-process engine run.

    There is no gateway in between, so arrival = dispatch = the engine's arrival time and the
    worker-side TTFT equals the TTFT. `classes` optionally maps request id -> class label.
    """
    records = []
    for result in results:
        finish = result.finished_time if result.finished_time is not None else result.arrival_time
        reason = result.finish_reason.value if result.finish_reason is not None else "abort"
        records.append(make_record(
            request_id=result.request_id, tenant=tenant, model=model,
            priority_class=(classes or {}).get(result.request_id, priority_class), worker=worker,
            arrival=result.arrival_time, dispatch_time=result.arrival_time,
            first_token_time=result.first_token_time, finish_time=finish,
            token_times=result.token_times, prompt_tokens=len(result.prompt_token_ids),
            completion_tokens=len(result.token_ids), cached_tokens=result.num_cached_tokens,
            finish_reason=reason, engine_first_scheduled=result.first_scheduled_time,
            engine_first_token=result.first_token_time, engine_arrival=result.arrival_time,
        ))
    return records


# --------------------------------------------------------------------------------------------
# Prometheus metrics (a dedicated registry: importing sluice never touches the global one).
# --------------------------------------------------------------------------------------------

REGISTRY = CollectorRegistry(auto_describe=True)

# vLLM's TTFT buckets, plus 1.5/2/3 s so a 3 s TTFT SLO falls on a bucket edge.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0,
                2.5, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# ITL buckets with an edge at 0.3 s (the default ITL SLO).
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_REQUEST_LABELS = ("model", "class")
# TTFT and ITL also by tenant (the objectives an application is promised); the other latency
# histograms stay per model and class, so the series count grows with tenants only twice.
_TENANT_REQUEST_LABELS = ("model", "class", "tenant")


def _request_histogram(name: str, documentation: str, buckets: Sequence[float],
                       labels: Sequence[str] = _REQUEST_LABELS) -> Histogram:
    """A per-request latency histogram, labelled by model and class (and tenant for TTFT and ITL)."""
    return Histogram(name, documentation, labels, buckets=buckets, registry=REGISTRY)


def _counter(name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
    return Counter(name, documentation, labels, registry=REGISTRY)


def _gauge(name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
    return Gauge(name, documentation, labels, registry=REGISTRY)


TTFT = _request_histogram("sluice:time_to_first_token_seconds", "Time to first token (arrival -> first token).",
                          TTFT_BUCKETS, _TENANT_REQUEST_LABELS)
ITL = _request_histogram("sluice:inter_token_latency_seconds", "Gap between consecutive output tokens of a request.",
                         ITL_BUCKETS, _TENANT_REQUEST_LABELS)
E2E = _request_histogram("sluice:e2e_request_latency_seconds", "Arrival -> finish of a request.",
                         REQUEST_LATENCY_BUCKETS)
QUEUE_TIME = _request_histogram("sluice:request_queue_time_seconds", "Arrival -> dispatch to a worker.",
                                REQUEST_LATENCY_BUCKETS)
PREFILL_TIME = _request_histogram("sluice:request_prefill_time_seconds", "Engine: first scheduled -> first token.",
                                  REQUEST_LATENCY_BUCKETS)
DECODE_TIME = _request_histogram("sluice:request_decode_time_seconds", "First token -> finish.",
                                 REQUEST_LATENCY_BUCKETS)

PROMPT_TOKENS = _counter("sluice:prompt_tokens_total", "Prompt tokens of finished requests.", ("model", "tenant"))
GENERATION_TOKENS = _counter("sluice:generation_tokens_total", "Generated tokens of finished requests.",
                             ("model", "tenant"))
REQUESTS = _counter("sluice:requests_total", "Finished requests by class, tenant and finish reason.",
                    ("model", "class", "tenant", "finish_reason"))
REJECTIONS = _counter("sluice:request_rejections_total", "Requests refused before admission (quotas, limits).",
                      ("tenant", "class", "reason"))
PREEMPTIONS = _counter("sluice:num_preemptions_total", "Requests preempted by a worker's engine.", ("worker",))
SPEC_DRAFTS = _counter("sluice:spec_decode_num_draft_tokens_total",
                       "Prompt-lookup draft tokens a worker's engine verified.", ("worker",))
SPEC_ACCEPTED = _counter("sluice:spec_decode_num_accepted_tokens_total",
                         "Of the draft tokens, those kept (each saved its request a step).", ("worker",))
PREFIX_CACHE_QUERIES = _counter("sluice:prefix_cache_queries_total", "Prompt tokens looked up in the cache.",
                                ("worker",))
PREFIX_CACHE_HITS = _counter("sluice:prefix_cache_hits_total", "Prompt tokens served from the prefix cache.",
                             ("worker",))

WAITING = _gauge("sluice:num_requests_waiting", "Requests queued at the gateway, per class.", ("class",))
RUNNING = _gauge("sluice:num_requests_running", "Requests dispatched to workers and not finished, per class.",
                 ("class",))
KV_USAGE = _gauge("sluice:kv_cache_usage_perc", "Fraction of a worker's KV blocks in use (0..1, as in vLLM).",
                  ("worker",))
PREFIX_HIT_RATE = _gauge("sluice:prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens, per worker.",
                         ("worker",))
WORKER_RUNNING = _gauge("sluice:worker_num_requests_running", "Requests running inside a worker's engine.", ("worker",))
WORKER_WAITING = _gauge("sluice:worker_num_requests_waiting", "Requests waiting inside a worker's engine.", ("worker",))
# Usage is written behind (gateway/quotas/usage.py): a count that keeps growing means the database is not
# taking the writes.
USAGE_PENDING = _gauge("sluice:usage_pending_rows", "(tenant, model, day) usage rows not yet written.")
WORKER_TOKENS = _counter("sluice:worker_generation_tokens_total", "Tokens generated by a worker (as they stream).",
                         ("worker",))
# Goodput (issue #32): rate(...{outcome="met"}) per class and tenant; SLO attainment: met / (met + missed).
SLO_REQUESTS = _counter("sluice:slo_requests_total",
                        "Finished requests with a latency objective, by whether they met it (met | missed).",
                        ("model", "class", "tenant", "outcome"))
ADMISSIONS = _counter("sluice:request_admissions_total", "Requests admitted (accepted into a queue).",
                      ("tenant", "class"))
ROUTES = _counter("sluice:route_decisions_total",
                  "Dispatches by why routing chose the worker (docs/routing.md: cache, load, spread, ...).",
                  ("reason",))
CACHE_INDEX_BLOCKS = _gauge("sluice:worker_cache_index_blocks",
                            "Prefix-cache blocks the gateway's index holds for a worker (from its KV events).",
                            ("worker",))
USAGE_WRITE_FAILURES = _counter("sluice:usage_write_failures_total", "Failed usage writes (retried later).")
# For the alert rules (deploy/prometheus/alerts.yml): workers lost, a dependency unreachable, 5xx.
WORKERS_CONNECTED = _gauge("sluice:workers_connected", "Workers and upstreams this gateway can dispatch to now.")
READINESS = _gauge("sluice:readiness_check", "/ready's checks at the last scrape (1 passes, 0 fails): "
                   "accepting, database, shared (Redis), broker (Kafka), workers.", ("check",))
ERROR_RESPONSES = _counter("sluice:http_error_responses_total", "Error answers (4xx and 5xx) by status code.",
                           ("status",))




class _RecordSink:
    """The optional JSONL file. One lock: records come from several asyncio tasks and threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        self.path = ""

    def configure(self, path: str) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            self.path = path
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._file = open(path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the sink

    def write(self, line: bytes) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(line + b"\n")


_sink = _RecordSink()
_prefix_lock = threading.Lock()
_prefix_totals: dict[str, list[int]] = {}  # worker label -> [cached tokens, prompt tokens]


def configure(record_log_path: str = "", max_tenant_labels: int = MAX_TENANT_LABELS) -> None:
    """Append every emitted record to `record_log_path` as JSON lines ("" = logger only); at most
    `max_tenant_labels` tenants get their own series, the first seen from now on."""
    if max_tenant_labels < 1:
        raise ValueError(f"max_tenant_labels must be at least 1, got {max_tenant_labels}")
    _sink.configure(record_log_path)
    tenant_label.reset(max_tenant_labels)


def encode_record(record: RequestRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_records(lines: Iterable[bytes | str]) -> list[RequestRecord]:
    """Parse JSON lines written by `emit_record` (blank lines skipped)."""
    decoder = msgspec.json.Decoder(RequestRecord)
    return [decoder.decode(line) for line in lines if line.strip()]


def read_records(path: str | Path) -> list[RequestRecord]:
    with open(path, "rb") as handle:
        return decode_records(handle)


def observe_record(record: RequestRecord, token_times: Sequence[float] = ()) -> None:
    """Feed one record to the Prometheus metrics (emit_record does this; exposed for tests)."""
    labels = {"model": record.model or "unknown", "class": class_label(record.priority_class)}
    tenant = tenant_label(record.tenant)
    if record.ttft_s is not None:
        TTFT.labels(tenant=tenant, **labels).observe(record.ttft_s)
    if record.queue_wait_s is not None:
        QUEUE_TIME.labels(**labels).observe(record.queue_wait_s)
    if record.prefill_s is not None:
        PREFILL_TIME.labels(**labels).observe(record.prefill_s)
    if record.decode_s is not None:
        DECODE_TIME.labels(**labels).observe(record.decode_s)
    E2E.labels(**labels).observe(record.e2e_s)
    # The histogram gets one observation per token gap. With the raw token times we observe
    # the real gaps; a record alone only keeps a summary, so then the mean stands in for each
    # gap (count and sum stay exact, which rate()- and average-based queries need).
    if len(token_times) > 1:
        itl = ITL.labels(tenant=tenant, **labels)
        for earlier, later in itertools.pairwise(token_times):
            itl.observe(later - earlier)
    elif record.itl_mean_s is not None and record.completion_tokens > 1:
        itl = ITL.labels(tenant=tenant, **labels)
        for _ in range(record.completion_tokens - 1):
            itl.observe(record.itl_mean_s)
    PROMPT_TOKENS.labels(model=labels["model"], tenant=tenant).inc(record.prompt_tokens)
    GENERATION_TOKENS.labels(model=labels["model"], tenant=tenant).inc(record.completion_tokens)
    REQUESTS.labels(model=labels["model"], tenant=tenant, finish_reason=record.finish_reason,
                    **{"class": labels["class"]}).inc()
    if record.slo_met is not None:
        SLO_REQUESTS.labels(model=labels["model"], tenant=tenant, outcome="met" if record.slo_met else "missed",
                            **{"class": labels["class"]}).inc()
    if record.worker:
        worker = worker_label(record.worker)
        PREFIX_CACHE_QUERIES.labels(worker=worker).inc(record.prompt_tokens)
        PREFIX_CACHE_HITS.labels(worker=worker).inc(record.cached_tokens)
        with _prefix_lock:
            totals = _prefix_totals.setdefault(worker, [0, 0])
            totals[0] += record.cached_tokens
            totals[1] += record.prompt_tokens
            if totals[1]:
                PREFIX_HIT_RATE.labels(worker=worker).set(totals[0] / totals[1])


def emit_record(record: RequestRecord, token_times: Sequence[float] = ()) -> None:
    """Log the record as one JSON line, append it to the configured file, observe its metrics.

    Pass the request's `token_times` (the ones given to `make_record`) when at hand, so the ITL
    histogram sees every real gap rather than the mean.
    """
    line = encode_record(record)
    # With a record file (`make run`'s var/records.jsonl) the terminal shows records only at DEBUG:
    # one INFO line per request buried the log; without a file the logger is where they go.
    level = logging.DEBUG if _sink.path else logging.INFO
    if _log.isEnabledFor(level):
        _log.log(level, "%s", line.decode())
    _sink.write(line)
    observe_record(record, token_times)
    WINDOW.observe_request(record.tenant, ttft_s=record.ttft_s, token_times=token_times,
                           completion_tokens=record.completion_tokens, finish_reason=record.finish_reason)
    if record.slo_met is not None:
        WINDOW.observe_slo(class_label(record.priority_class), record.tenant, met=record.slo_met,
                           ttft_s=record.ttft_s, itl_p95_s=record.itl_p95_s,
                           ttft_target_s=record.ttft_target_s, itl_target_s=record.itl_target_s)


def count_rejection(tenant: str, reason: str, priority_class: str = "") -> None:
    REJECTIONS.labels(tenant=tenant_label(tenant), reason=reason, **{"class": class_label(priority_class)}).inc()
    WINDOW.count_rejection(tenant, reason, priority_class)


def count_admission(tenant: str, priority_class: str) -> None:
    ADMISSIONS.labels(tenant=tenant_label(tenant), **{"class": class_label(priority_class)}).inc()
    WINDOW.count_admission(tenant, priority_class)


_worker_token_counters: dict[str, Any] = {}  # worker id -> its labelled counter (labels() per delta cost 2 µs)


def count_worker_tokens(worker: str, n: int) -> None:
    """Tokens a worker streamed (counted per delta, so long streams show up before they finish)."""
    if n > 0:
        counter = _worker_token_counters.get(worker)
        if counter is None:
            if len(_worker_token_counters) >= 4 * MAX_WORKER_LABELS:  # ids of workers long gone
                _worker_token_counters.clear()
            counter = _worker_token_counters[worker] = WORKER_TOKENS.labels(worker=worker_label(worker))
        counter.inc(n)
        WINDOW.count_worker_tokens(worker, n)


def set_queue_depth(priority_class: str, depth: int) -> None:
    WAITING.labels(class_label(priority_class)).set(depth)


def set_running(priority_class: str, n: int) -> None:
    RUNNING.labels(class_label(priority_class)).set(n)


TENANT_QUEUES = TenantQueueCollector()
REGISTRY.register(TENANT_QUEUES)
BATCH_WINDOW = BatchWindowCollector()  # published by gateway/batches/window.py
REGISTRY.register(BATCH_WINDOW)


def set_tenant_queues(waiting: Iterable[tuple[str, str]], running: Iterable[tuple[str, str]]) -> None:
    """One (tenant name, class) pair per request queued at the gateway and per request on a worker:
    `sluice:tenant_num_requests_waiting` / `_running` by tenant (capped) and class."""
    TENANT_QUEUES.publish(((tenant_label(t), class_label(c)) for t, c in waiting),
                          ((tenant_label(t), class_label(c)) for t, c in running))


def set_readiness(checks: dict[str, bool]) -> None:
    for check, ok in checks.items():
        READINESS.labels(check=check).set(1 if ok else 0)


def count_error_response(status: int) -> None:
    ERROR_RESPONSES.labels(status=str(status)).inc()


def observe_worker(capacity: WorkerCapacity) -> None:
    worker = worker_label(capacity.worker_id)
    if capacity.total_kv_blocks > 0:
        used = capacity.total_kv_blocks - capacity.free_kv_blocks
        KV_USAGE.labels(worker=worker).set(used / capacity.total_kv_blocks)
    WORKER_RUNNING.labels(worker=worker).set(capacity.num_running)
    WORKER_WAITING.labels(worker=worker).set(capacity.num_waiting)


def count_route(reason: str) -> None:
    ROUTES.labels(reason=reason).inc()


def set_cache_index_blocks(worker_id: str, blocks: int) -> None:
    CACHE_INDEX_BLOCKS.labels(worker=worker_label(worker_id)).set(blocks)


def count_engine_events(before: WorkerCapacity, after: WorkerCapacity) -> None:
    """Count what a worker's engine did between two of its capacity reports (cumulative counts;
    a count that went down is a restarted engine, and counts nothing)."""
    worker = worker_label(after.worker_id)
    for counter, old, new in ((PREEMPTIONS, before.num_preemptions, after.num_preemptions),
                              (SPEC_DRAFTS, before.num_draft_tokens, after.num_draft_tokens),
                              (SPEC_ACCEPTED, before.num_accepted_draft_tokens, after.num_accepted_draft_tokens)):
        if new > old:
            counter.labels(worker=worker).inc(new - old)


def metrics_payload() -> tuple[bytes, str]:
    """Body and content type for `GET /metrics` (Prometheus text format)."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def metric_names() -> set[str]:
    """Every sample name the registry can expose (with _bucket/_sum/_count/_total suffixes),
    including labelled metrics that have not been observed yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names: set[str] = set()
    for family in REGISTRY.collect():
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names
