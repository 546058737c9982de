"""The last few minutes of telemetry in memory, for the admin console's live views.

Prometheus holds the long history; this holds what a page shows without a Prometheus server:
per-tenant TTFT p95 / ITL p95 / throughput in time buckets, admitted and rejected requests per
minute (per tenant and per class), tokens/s per worker, the most recent rejections and errors, and
per class and tenant the latency objectives' outcomes (attainment, goodput; issue #32).

`sluice.telemetry` feeds the process-wide `WINDOW` from the same calls that feed the metrics
(`emit_record`, `count_rejection`, `count_admission`, `count_worker_tokens`), so the console and a
dashboard agree. Memory is bounded: `horizon_s / bucket_s` buckets per series, at most
`MAX_SAMPLES` latency samples per bucket (a uniform reservoir), `MAX_EVENTS` recent events,
`MAX_SLO_OUTCOMES` outcomes per (class, tenant).
Every method takes an optional `now` (unix s) so tests need no clock.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

MAX_SAMPLES = 200  # latency samples kept per (tenant, bucket)
MAX_EVENTS = 200  # recent rejections and errors kept
RATE_WINDOW_S = 60.0  # "per minute"
TOKENS_WINDOW_S = 10.0  # tokens/s of a worker: over the last 10 s
MAX_SLO_OUTCOMES = 2000  # judged requests kept per (class, tenant): the newest, within the horizon


@dataclass(frozen=True, slots=True)
class Event:
    """A recent rejection (kind "rejected": a 429 or a 503) or a failed request (kind "error")."""

    at: float
    tenant: str
    kind: str
    code: str
    priority_class: str = ""


@dataclass(frozen=True, slots=True)
class _SloOutcome:
    """A finished request judged against its objective (telemetry.RequestRecord.slo_met)."""

    at: float
    met: bool
    ttft_s: float | None
    itl_p95_s: float | None  # the request's own p95 token gap (what its ITL target is judged on)
    ttft_target_s: float | None
    itl_target_s: float | None


@dataclass(frozen=True, slots=True)
class SloSummary:
    """One (class, tenant)'s outcomes over the horizon. Targets: the loosest a request had (a
    request's header can only tighten its tenant's objective, so this is the objective itself
    unless every request tightened it); None: no request had that target."""

    priority_class: str
    tenant: str
    requests: int
    met: int
    ttft_target_s: float | None
    itl_target_s: float | None
    ttft_p95_s: float | None  # over the requests' TTFTs
    itl_p95_s: float | None  # over the requests' own p95 token gaps

    @property
    def attained(self) -> float:
        return self.met / self.requests if self.requests else 0.0


@dataclass(slots=True)
class _Bucket:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    ttft_seen: int = 0
    itl_seen: int = 0
    tokens: int = 0
    requests: int = 0
    # (ttft p95, itl p95) once the bucket is over: records are made at `now`, so a past bucket
    # never changes, and a page refresh re-sorts only the current buckets' samples.
    closed_p95: tuple[float | None, float | None] | None = None


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One bucket of a tenant's series; None where the bucket saw no sample."""

    start: float
    ttft_p95_s: float | None
    itl_p95_s: float | None
    tokens_per_s: float


def _keep(samples: list[float], seen: int, value: float, rng: random.Random) -> None:
    """Reservoir sampling: after `seen` offers, each offered value is kept with equal chance."""
    if len(samples) < MAX_SAMPLES:
        samples.append(value)
        return
    slot = rng.randrange(seen)
    if slot < MAX_SAMPLES:
        samples[slot] = value


def _trim(times: deque[float], before: float) -> None:
    while times and times[0] < before:
        times.popleft()


def _trim_pairs(samples: deque[tuple[float, int]], before: float) -> None:
    while samples and samples[0][0] < before:
        samples.popleft()


class LiveWindow:
    """Time-bucketed counters and samples over the last `horizon_s` seconds; thread-safe."""

    def __init__(self, horizon_s: float = 300.0, bucket_s: float = 10.0) -> None:
        if bucket_s <= 0 or horizon_s < bucket_s:
            raise ValueError(f"need 0 < bucket_s <= horizon_s, got bucket_s={bucket_s}, horizon_s={horizon_s}")
        self.horizon_s = horizon_s
        self.bucket_s = bucket_s
        self._lock = threading.Lock()
        self._rng = random.Random(0)
        self._series: dict[str, dict[int, _Bucket]] = {}  # tenant -> bucket index -> bucket
        # (kind, key) -> deque of unix times; kinds: admitted/rejected by tenant and by class
        self._hits: dict[tuple[str, str], deque[float]] = {}
        self._worker_tokens: dict[str, deque[tuple[float, int]]] = {}
        self._events: deque[Event] = deque(maxlen=MAX_EVENTS)
        self._slo: dict[tuple[str, str], deque[_SloOutcome]] = {}  # (class, tenant) -> oldest first

    # ---- feeding -------------------------------------------------------------------------------

    def observe_request(self, tenant: str, *, ttft_s: float | None, token_times: Sequence[float],
                        completion_tokens: int, finish_reason: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            bucket = self._bucket(tenant, now)
            bucket.requests += 1
            bucket.tokens += completion_tokens
            if ttft_s is not None:
                bucket.ttft_seen += 1
                _keep(bucket.ttft, bucket.ttft_seen, ttft_s, self._rng)
            for earlier, later in pairwise(token_times):
                bucket.itl_seen += 1
                _keep(bucket.itl, bucket.itl_seen, later - earlier, self._rng)
            if finish_reason == "error":
                self._events.append(Event(now, tenant, "error", "error"))

    def observe_slo(self, priority_class: str, tenant: str, *, met: bool, ttft_s: float | None,
                    itl_p95_s: float | None, ttft_target_s: float | None, itl_target_s: float | None,
                    now: float | None = None) -> None:
        """A request with an objective finished and was judged (one the client left is not)."""
        now = time.time() if now is None else now
        with self._lock:
            outcomes = self._slo.setdefault((priority_class, tenant), deque(maxlen=MAX_SLO_OUTCOMES))
            outcomes.append(_SloOutcome(now, met, ttft_s, itl_p95_s, ttft_target_s, itl_target_s))

    def count_admission(self, tenant: str, priority_class: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self._hit(("admitted", tenant), now)
            self._hit(("admitted_class", priority_class), now)

    def count_rejection(self, tenant: str, reason: str, priority_class: str = "",
                        now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self._hit(("rejected", tenant), now)
            if priority_class:
                self._hit(("rejected_class", priority_class), now)
            self._events.append(Event(now, tenant, "rejected", reason, priority_class))

    def count_worker_tokens(self, worker: str, tokens: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            samples = self._worker_tokens.setdefault(worker, deque())
            samples.append((now, tokens))
            _trim_pairs(samples, now - TOKENS_WINDOW_S)

    # ---- reading -------------------------------------------------------------------------------

    def per_minute(self, kind: str, key: str, now: float | None = None) -> int:
        """Hits in the last minute; kind: admitted | rejected (by tenant) or admitted_class | rejected_class."""
        now = time.time() if now is None else now
        with self._lock:
            hits = self._hits.get((kind, key))
            if hits is None:
                return 0
            _trim(hits, now - RATE_WINDOW_S)
            return len(hits)

    def tokens_per_s(self, worker: str, now: float | None = None) -> float:
        now = time.time() if now is None else now
        with self._lock:
            samples = self._worker_tokens.get(worker)
            if not samples:
                return 0.0
            _trim_pairs(samples, now - TOKENS_WINDOW_S)
            return sum(n for _, n in samples) / TOKENS_WINDOW_S

    def series(self, tenant: str, now: float | None = None) -> list[SeriesPoint]:
        """The tenant's buckets over the horizon, oldest first (the current, partial bucket last)."""
        from sluice.telemetry import percentile  # telemetry imports this module at its top

        now = time.time() if now is None else now
        last = int(now // self.bucket_s)
        count = int(self.horizon_s // self.bucket_s)
        with self._lock:
            buckets = self._series.get(tenant, {})
            points = []
            for index in range(last - count + 1, last + 1):
                b = buckets.get(index)
                if b is None:
                    points.append(SeriesPoint(index * self.bucket_s, None, None, 0.0))
                    continue
                p95 = b.closed_p95 or (percentile(b.ttft, 95), percentile(b.itl, 95))
                if index < last:
                    b.closed_p95 = p95
                elapsed = min(self.bucket_s, now - index * self.bucket_s) if index == last else self.bucket_s
                points.append(SeriesPoint(index * self.bucket_s, p95[0], p95[1], b.tokens / max(elapsed, 1e-9)))
        return points

    def tenants(self, now: float | None = None) -> list[str]:
        """Tenants with any sample or hit inside the horizon."""
        now = time.time() if now is None else now
        with self._lock:
            self._prune(now)
            names = set(self._series) | {key for (kind, key) in self._hits if kind in ("admitted", "rejected")}
        return sorted(names)

    def slo_summaries(self, now: float | None = None) -> list[SloSummary]:
        """Per (class, tenant) with a judged request inside the horizon, sorted by class then tenant."""
        from sluice.telemetry import percentile  # telemetry imports this module at its top

        now = time.time() if now is None else now
        summaries = []
        with self._lock:
            for key in list(self._slo):
                outcomes = self._slo[key]
                while outcomes and outcomes[0].at < now - self.horizon_s:
                    outcomes.popleft()
                if not outcomes:
                    del self._slo[key]
                    continue
                summaries.append(SloSummary(
                    priority_class=key[0], tenant=key[1], requests=len(outcomes),
                    met=sum(o.met for o in outcomes),
                    ttft_target_s=max((o.ttft_target_s for o in outcomes if o.ttft_target_s is not None), default=None),
                    itl_target_s=max((o.itl_target_s for o in outcomes if o.itl_target_s is not None), default=None),
                    ttft_p95_s=percentile([o.ttft_s for o in outcomes if o.ttft_s is not None], 95),
                    itl_p95_s=percentile([o.itl_p95_s for o in outcomes if o.itl_p95_s is not None], 95),
                ))
        return sorted(summaries, key=lambda s: (s.priority_class, s.tenant))

    def recent_events(self, limit: int = 50) -> list[Event]:
        """Newest first."""
        with self._lock:
            return list(reversed(self._events))[:limit]

    def clear(self) -> None:
        with self._lock:
            self._series.clear()
            self._hits.clear()
            self._worker_tokens.clear()
            self._events.clear()
            self._slo.clear()

    # ---- internals (lock held) -----------------------------------------------------------------

    def _bucket(self, tenant: str, now: float) -> _Bucket:
        buckets = self._series.setdefault(tenant, {})
        index = int(now // self.bucket_s)
        bucket = buckets.get(index)
        if bucket is None:
            bucket = buckets[index] = _Bucket()
            oldest = index - int(self.horizon_s // self.bucket_s)
            for stale in [i for i in buckets if i <= oldest]:
                del buckets[stale]
        return bucket

    def _hit(self, key: tuple[str, str], now: float) -> None:
        hits = self._hits.setdefault(key, deque())
        hits.append(now)
        _trim(hits, now - RATE_WINDOW_S)

    def _prune(self, now: float) -> None:
        oldest = int((now - self.horizon_s) // self.bucket_s)
        for tenant in list(self._series):
            buckets = self._series[tenant]
            for stale in [i for i in buckets if i <= oldest]:
                del buckets[stale]
            if not buckets:
                del self._series[tenant]
        for key in list(self._hits):
            _trim(self._hits[key], now - RATE_WINDOW_S)
            if not self._hits[key]:
                del self._hits[key]


WINDOW = LiveWindow()
