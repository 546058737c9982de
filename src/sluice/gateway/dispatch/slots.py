"""Worker slots: who may send a job to a worker's short waiting queue (the room rule).

`dispatch.max_worker_waiting` keeps each worker's own waiting queue short, so priority and
fairness are decided at the gateway at the last moment. With one gateway, what it knows is exact:
`LocalSlots` applies the room rule to the worker's report, what is on the wire and its own
unstarted jobs, synchronously (no await per dispatch). With several replicas each sending its own
jobs to every worker, no replica knows the others' unstarted jobs: `RedisSlots` keeps, per worker,
the jobs sent and not yet started per class over all replicas, and one Lua script (TAKE_SLOT)
applies the same rule to those counts and counts the job, atomically, before the job is sent. So
the bound and the priority overtaking hold across the cluster (docs/scale-out.md, "One global
schedule").

A slot is released when its job starts producing (first delta), finishes, is aborted or its worker
is lost. Each is filed under its replica like the quota ledger's holds, so a dead replica's slots
are released by the ledger's lease sweep within `shared.lease_s`.

A release is announced to every replica (Redis pub/sub, published by the release script itself),
and each replica's dispatch loop wakes on it. Without that, only the replica whose own job freed a
slot woke at once and the others polled every `SLOT_RETRY_S`: the freed slot nearly always went
back to the replica that freed it, and a replica holding the most deserving work (a light
tenant's) could wait ~50 dispatches for a slot, so the cluster was not one schedule. A lost
subscription only costs latency: the poll stays as the fallback.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.gateway.cluster import redis_scripts
from sluice.gateway.cluster.pubsub import Subscription
from sluice.protocol import Priority

if TYPE_CHECKING:
    from sluice.gateway.dispatch.jobs import Job
    from sluice.gateway.dispatch.links.base import WorkerLink

log = logging.getLogger(__name__)


def has_room(est_waiting: int, unstarted: list[Priority], priority: Priority, max_waiting: int) -> bool:
    """The room rule (see gateway/dispatch/dispatcher.py) for a job of class `priority`.

    `est_waiting`: the worker's waiting queue including what is on the wire; `unstarted`: the
    classes of the jobs sent to it that have produced nothing yet.
    """
    if est_waiting < max_waiting:
        return True
    ahead = sum(1 for p in unstarted if p <= priority)  # this class or more urgent: not jumped
    behind = any(p > priority for p in unstarted)  # less urgent work it would overtake
    return behind and ahead < max_waiting


def room_for(worker: WorkerLink, priority: Priority, max_waiting: int, by_class: bool) -> bool:
    """Whether `worker` has room for a job of `priority` by this replica's view: the room rule, or
    with one class (`by_class` False) the plain queue bound."""
    return worker.has_room_for(priority, max_waiting) if by_class else worker.est_waiting < max_waiting


class LocalSlots:
    """One gateway alone: its view of each worker is the whole truth (today's rule, synchronous)."""

    def take(self, job: Job, candidates: Sequence[WorkerLink], max_waiting: int,
             by_class: bool) -> WorkerLink | None:
        """The first of `candidates` (least loaded first) with room for `job`."""
        priority = job.request.priority
        return next((w for w in candidates if room_for(w, priority, max_waiting, by_class)), None)

    def release(self, job: Job) -> None:
        """Nothing to do: the worker's `inflight` jobs are the record."""
        return None


class RedisSlots:
    """The slots of every replica in Redis: the room rule on cluster-wide counts (module docstring).

    `take` is awaited by the dispatch loop (one script per decision, whatever the number of
    candidates); `release` returns at once and is applied in the background, like the ledger's
    settlements. A release that cannot reach Redis is retried before the next take: until then
    the slot still counts, which can only refuse more, never overfill a worker."""

    def __init__(self, client: Redis, *, prefix: str, lease_s: float, replica: str,
                 subscription: Redis | None = None, channels: str | None = None) -> None:
        self._client = client
        # `channels`: what pub/sub channel names start with (cluster/shared.py: channel_prefix).
        self._channel = f"{channels or prefix}:slots-freed"
        # Hears the other replicas' releases (None: polling only); our own wake us in _release_now.
        self._releases = (None if subscription is None else
                          Subscription(subscription, self._channel, self._heard_release, what="slot releases"))
        self._prefix = prefix
        self._lease_ms = int(lease_s * 1000)
        self.replica = replica
        self._take = client.register_script(redis_scripts.TAKE_SLOT)
        self._release = client.register_script(redis_scripts.RELEASE_SLOTS)
        self._ids = itertools.count(1)
        self._retry: set[str] = set()  # slots whose release did not reach Redis yet
        self._tasks: set[asyncio.Task[None]] = set()
        self.on_release: Callable[[], None] = lambda: None  # the dispatcher wakes: room may be back

    async def start(self) -> None:
        """Listens for the other replicas' releases (each wakes this replica's dispatcher)."""
        if self._releases is not None:
            self._releases.start()

    async def stop(self) -> None:
        if self._releases is not None:
            await self._releases.stop()

    def _heard_release(self, data: bytes) -> None:
        if data != self.replica.encode():  # the release script publishes the releasing replica's name
            self.on_release()

    async def take(self, job: Job, candidates: Sequence[WorkerLink], max_waiting: int,
                   by_class: bool, *, counter: float = 0.0) -> WorkerLink | None:
        """The first of `candidates` with room for `job` by the counts of every replica, its slot
        taken; None when none has room, or when another replica's refused head job deserves the
        slot more (`counter`: `job`'s fair-share counter; TAKE_SLOT's arbitration). Raises
        RedisError when Redis cannot be reached (the job stays queued: the bound is never skipped)."""
        if not candidates:
            return None
        if self._retry:
            await self._release_now(list(self._retry))
        # Its own key per take: a late release of a job's previous slot (its worker was lost, it
        # was re-queued and is sent again) can never end the new one.
        slot = f"{job.request_id}/{next(self._ids)}"
        pairs: list[str | int] = []
        for worker in candidates:
            pairs += [worker.worker_id, worker.est_waiting]
        args: list[str | int] = [self._prefix, self.replica, self._lease_ms, slot,
                                 int(job.request.priority), max_waiting, "1" if by_class else "0",
                                 job.request.model, repr(float(counter)), *pairs]
        try:
            chosen = int(await self._take(args=args))
        except (RedisError, asyncio.CancelledError):
            self._retry.add(slot)  # the script may have run with its answer lost
            raise
        if not chosen:
            return None
        job.slot = slot
        return candidates[chosen - 1]

    def release(self, job: Job) -> None:
        """Ends the job's slot, if it holds one (at most once)."""
        if not job.slot:
            return
        slots, job.slot = [job.slot], ""
        task = asyncio.get_running_loop().create_task(self._release_now(slots))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release_now(self, slots: list[str]) -> None:
        try:
            await self._release(args=[self._prefix, self.replica, self._channel, *slots])
        except RedisError as exc:
            if not self._retry:
                log.warning("shared state: releasing worker slots deferred, Redis unreachable: %s", exc)
            self._retry.update(slots)
            return
        self._retry.difference_update(slots)
        self.on_release()

    async def flush(self) -> None:
        """Waits for the releases in flight (tests, and a clean stop)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


WorkerSlots = LocalSlots | RedisSlots
