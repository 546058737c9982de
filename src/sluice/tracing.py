"""OpenTelemetry tracing, off by default (`[tracing] enabled`; the `tracing` extra installs the SDK).

One trace per request, across processes, in W3C Trace Context (`traceparent`):

- gateway (`edge/tracing.py`'s middleware): a server span per HTTP request, the child of the
  client's `traceparent` when it sent one; inside it `authenticate`, `admission` (quotas) and
  `kafka.append`; the dispatcher adds `queue.wait` (accepted -> sent to a worker) and `dispatch`.
- the request's context travels as `GenerateRequest.traceparent` (the worker protocol and the Kafka
  record) and as a Kafka header, and goes to upstream servers as the `traceparent` header;
- worker: `worker.queue` (received -> first scheduled), `prefill` (-> first token) and `decode`
  (-> finish), children of the request's span, built from the engine's timestamps when it ends.

Spans are exported over OTLP/HTTP (protobuf) by a batching exporter thread. While tracing is off
(or the SDK is not installed) every function here is a cheap no-op and nothing is imported.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
_tracer: Any = None  # an opentelemetry Tracer once configure() enabled tracing
_provider: Any = None


def configure(enabled: bool, endpoint: str, service_name: str, sample_ratio: float = 1.0) -> bool:
    """Starts exporting spans of this process to `endpoint` (OTLP/HTTP) when `enabled`; True if on."""
    global _tracer, _provider
    if not enabled:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise ValueError("[tracing] enabled needs the OpenTelemetry SDK: pip install 'sluice[tracing]'") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    # Short export delay: a worker may be stopped soon after a request; shutdown() flushes the rest.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=500))
    _provider, _tracer = provider, provider.get_tracer("sluice")
    log.info("tracing: exporting %s's spans to %s", service_name, endpoint)
    return True


def shutdown() -> None:
    """Flushes and stops the exporter (at process exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def _context_of(traceparent: str | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent} if traceparent else {})


def extract(headers: Mapping[str, str]) -> Any:
    """The context a client's `traceparent` header names (an empty context without one)."""
    return _context_of(headers.get(TRACEPARENT))


_OFF = contextlib.nullcontext()  # reusable: what span() is while tracing is off (no generator per call)


def span(name: str, *, context: Any = None, kind: str = "internal",
         attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager[Any]:
    """A span around a block, current inside it (a child of the current span, or of `context`);
    yields the span, or None while tracing is off."""
    if _tracer is None:
        return _OFF
    return _span(name, context, kind, attributes)


@contextlib.contextmanager
def _span(name: str, context: Any, kind: str, attributes: Mapping[str, Any] | None) -> Iterator[Any]:
    from opentelemetry.trace import SpanKind

    with _tracer.start_as_current_span(name, context=context, kind=getattr(SpanKind, kind.upper()),
                                       attributes=dict(attributes or {})) as current:
        yield current


def current_traceparent() -> str | None:
    """The current span's context as a `traceparent` value (None when there is none or tracing is off)."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get(TRACEPARENT)


def record_span(name: str, traceparent: str | None, start: float, end: float,
                attributes: Mapping[str, Any] | None = None) -> None:
    """A finished span from timestamps (unix seconds), the child of `traceparent`: for intervals
    measured without a block around them (queue wait, prefill, decode). Nothing without a parent."""
    if _tracer is None or traceparent is None or end < start:
        return
    recorded = _tracer.start_span(name, context=_context_of(traceparent), start_time=int(start * 1e9),
                                  attributes=dict(attributes or {}))
    recorded.end(end_time=int(end * 1e9))
