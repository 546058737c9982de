"""The worker-link seam: what the dispatcher needs of a worker, and what a worker needs of it.

A worker is anything behind `WorkerLink` (send, abort, room and load, close, view). Its kinds:
- `WorkerConn` (links/tcp.py): a worker process connected to the gateway's worker port
  (`gateway/dispatch/links/tcp.py`, the TCP protocol of `sluice.protocol`);
- `InProcessLink` (`gateway/dispatch/links/inprocess.py`): an engine hosted in this process;
- `UpstreamLink` (`gateway/dispatch/links/upstream.py`): an OpenAI-compatible HTTP server.
The first two carry requests to the same engine host (`workers/engine_host.py`), so they share
`EngineLink`: room from the host's `WorkerCapacity` reports, resumable after a failover. The
dispatcher treats every kind alike: same queue, room rule, deltas, and loss.

A link reports back through its `LinkHost` (the dispatcher): each delta of a job it holds goes to
`deliver`, each capacity report to `report`, and a link that can no longer reach its worker calls
`lose` (its jobs: resumed elsewhere, re-queued, or ended with an error).
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from sluice.gateway.dispatch.cache_index import CacheIndex
from sluice.gateway.dispatch.slots import has_room
from sluice.gateway.dispatch.ttft import WorkerLoad
from sluice.protocol import (
    GenerateRequest,
    KvEvents,
    Priority,
    RequestDelta,
    WorkerCapacity,
)

if TYPE_CHECKING:
    from sluice.gateway.dispatch.jobs import Job

RECENT_SENDS = 64  # sends a link remembers for the TTFT prediction (its worker's queue is kept far shorter)


class WorkerLink(Protocol):
    """What the dispatcher needs of a worker, whatever carries its requests (module docstring)."""

    worker_id: str
    models: frozenset[str]
    inflight: dict[str, Job]  # sent and not finished, by request id (the dispatcher keeps it)
    last_seen: float  # monotonic: when it last showed its worker alive (heartbeat monitor)
    # Whether a job it held can go on elsewhere from the tokens already delivered (an engine
    # recomputes them; an upstream cannot, and may send no token ids).
    resumes: bool
    cache: CacheIndex  # what its prefix cache holds, as this gateway knows it (dispatch/routing.py)

    @property
    def est_waiting(self) -> int: ...

    @property
    def load(self) -> float: ...

    @property
    def kv_use(self) -> float:
        """The share of its KV blocks held by requests (0.0 when unknown)."""
        ...

    @property
    def accepting(self) -> bool:
        """Under its own cap (an engine: always; an upstream: its max_concurrency)."""
        ...

    @property
    def ttft_load(self) -> WorkerLoad | None:
        """What its TTFT is predicted from (dispatch/ttft.py); None when it cannot be (an upstream,
        an engine whose cost model is still cold)."""
        ...

    def has_room_for(self, priority: Priority, max_waiting: int) -> bool: ...

    def send(self, request: GenerateRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def close(self) -> None:
        """The worker is lost: stop its transport (the dispatcher has taken its jobs)."""
        ...

    def view(self, draining: bool = False) -> dict[str, Any]: ...


class LinkHost(Protocol):
    """The dispatcher, as a link sees it."""

    def attach(self, link: WorkerLink) -> bool:
        """A worker ready for jobs; False when its id is taken by another live one."""
        ...

    def deliver(self, worker: WorkerLink, delta: RequestDelta) -> None: ...

    def report(self, worker: EngineLink, capacity: WorkerCapacity) -> None: ...

    def kv_events(self, worker: EngineLink, events: KvEvents) -> None: ...

    def lose(self, worker: WorkerLink, reason: str) -> None: ...

    def lose_job(self, worker: WorkerLink, request_id: str, reason: str) -> None: ...

    def wake(self) -> None: ...


class EngineLink(ABC):
    """A link to an engine host (workers/engine_host.py): its room is what the host last reported.

    The room rule's waiting estimate is `num_waiting + sent - num_received`: what the host
    reported plus what is on the way to it (the host counts what it received from this link).
    A kind says how requests and aborts travel (`_send`, `_abort`) and how it is closed."""

    resumes = True
    kind = "worker"  # as /admin/workers shows it

    def __init__(self, worker_id: str, models: frozenset[str], capacity: WorkerCapacity, device: str,
                 pid: int, *, max_index_blocks: int = 1_000_000) -> None:
        self.worker_id = worker_id
        self.models = models
        self.capacity = capacity
        self.reported_at = time.monotonic()  # when `capacity` came
        self.device = device
        self.pid = pid
        self.sent = 0  # GenerateRequests sent on this link
        # The latest sends (id, class as sent, prompt tokens): those the worker has not reported yet.
        self._recent_sends: deque[tuple[str, int, int]] = deque(maxlen=RECENT_SENDS)
        self.inflight: dict[str, Job] = {}
        self.last_seen = time.monotonic()
        self.connected_at = time.time()
        # Fed by its engine's KV events; a new link (a reconnect, a restart) starts empty.
        self.cache = CacheIndex(max_index_blocks)

    @property
    def est_waiting(self) -> int:
        on_the_way = self.sent - self.capacity.num_received
        return max(0, self.capacity.num_waiting + on_the_way)

    def has_room_for(self, priority: Priority, max_waiting: int) -> bool:
        unstarted = [job.request.priority for job in self.inflight.values() if not job.started]
        return has_room(self.est_waiting, unstarted, priority, max_waiting)

    @property
    def load(self) -> float:
        return (self.capacity.num_running + self.est_waiting) / max(1, self.capacity.max_num_seqs)

    @property
    def kv_use(self) -> float:
        cap = self.capacity
        return 1.0 - cap.free_kv_blocks / cap.total_kv_blocks if cap.total_kv_blocks else 0.0

    @property
    def accepting(self) -> bool:
        return True  # its engine queues what it cannot run yet; the room rule bounds that queue

    def take_report(self, capacity: WorkerCapacity) -> WorkerCapacity:
        """Its engine host's new report (sent between two steps); returns the one before."""
        before, self.capacity, self.reported_at = self.capacity, capacity, time.monotonic()
        self.last_seen = self.reported_at
        return before

    @property
    def ttft_load(self) -> WorkerLoad | None:
        return WorkerLoad.of(self.capacity, since_report=time.monotonic() - self.reported_at,
                             unreported=self._unreported_backlog())

    def _unreported_backlog(self) -> tuple[int, ...]:
        """Prompt tokens, by the class they were sent as, of the jobs sent since the worker's report
        counted what it had received: the latest `sent - num_received` sends, those still in flight
        here that have not started."""
        backlog = [0] * len(Priority)
        for request_id, priority, tokens in itertools.islice(
                reversed(self._recent_sends), max(0, self.sent - self.capacity.num_received)):
            job = self.inflight.get(request_id)
            if job is not None and not job.started:
                backlog[priority] += tokens
        return tuple(backlog)

    def send(self, request: GenerateRequest) -> None:
        self.sent += 1
        tokens = len(request.prompt_token_ids) + len(request.resume_token_ids)
        self._recent_sends.append((request.request_id, int(request.priority), tokens))
        self._send(request)

    def abort(self, request_id: str) -> None:
        self._abort(request_id)

    @abstractmethod
    def _send(self, request: GenerateRequest) -> None: ...

    @abstractmethod
    def _abort(self, request_id: str) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """The worker is lost: stop its transport (the dispatcher has taken its jobs)."""

    def view(self, draining: bool = False) -> dict[str, Any]:
        cap = self.capacity
        return {
            "worker_id": self.worker_id, "models": sorted(self.models), "device": self.device,
            "pid": self.pid, "alive": True, "num_running": cap.num_running, "num_waiting": cap.num_waiting,
            "est_waiting": self.est_waiting, "free_kv_blocks": cap.free_kv_blocks,
            "total_kv_blocks": cap.total_kv_blocks, "max_num_seqs": cap.max_num_seqs,
            "inflight": len(self.inflight), "load": round(self.load, 3),
            "num_preemptions": cap.num_preemptions,
            "num_draft_tokens": cap.num_draft_tokens,
            "num_accepted_draft_tokens": cap.num_accepted_draft_tokens,
            "last_heartbeat_age_s": round(time.monotonic() - self.last_seen, 3),
            "draining": draining, "kind": self.kind, "cache_index_blocks": len(self.cache),
        }
