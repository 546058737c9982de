"""Cluster-wide fairness: the fair scheduler's virtual token counters shared through Redis.

Each replica orders only the tenants it holds, but by the service those tenants got on every
replica: every `FAIR_SYNC_S` one script (SYNC_FAIR, gateway/cluster/redis_scripts.py) adds this replica's
charges since the last sync to the cluster's counters, files which tenants are backlogged here,
lifts the tenants that just became backlogged (cluster-wide: to the smallest counter of the
tenants backlogged on any live replica, unless another replica holds them backlogged already),
and returns the counters of the tenants held here, which replace the local ones (plus what was
charged here meanwhile). Between syncs the local scheduler goes on charging as it always did, so
dispatch never waits for Redis.

Fairness is not a limit: when Redis cannot be reached each replica goes on with its own counters
(its charges are kept and told once Redis answers), and nothing is refused for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.gateway.cluster import redis_scripts
from sluice.gateway.cluster.pubsub import cancel_and_wait
from sluice.gateway.dispatch.fair import FairScheduler
from sluice.protocol import Priority

log = logging.getLogger(__name__)

FAIR_SYNC_S = 0.025  # charges told and counters read this often (a few dispatches' worth)


class RedisFairness:
    """Keeps one FairScheduler's counters in step with the cluster's (see the module docstring)."""

    def __init__(self, client: Redis, *, prefix: str, lease_s: float, replica: str,
                 interval_s: float = FAIR_SYNC_S) -> None:
        self._client = client
        self._prefix = prefix
        self._lease_ms = int(lease_s * 1000)
        self.replica = replica
        self.interval_s = interval_s
        self._script = client.register_script(redis_scripts.SYNC_FAIR)
        self._scheduler: FairScheduler[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._told_backlog = False  # the last sync filed some backlogged tenant (to be cleared)
        self._failing = False

    def bind(self, scheduler: FairScheduler[Any]) -> None:
        """The scheduler whose counters these are (made with `shared_counters=True`)."""
        self._scheduler = scheduler

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sync_forever(), name="fair-sync")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        with contextlib.suppress(RedisError):
            await self.sync()  # the last charges count for the others

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync()
            except Exception:  # a bug here must not stop syncing for good
                log.exception("fairness sync failed")

    async def sync(self) -> None:
        """One exchange with the cluster's counters; a failure keeps what was to be told."""
        scheduler = self._scheduler
        if scheduler is None:
            return
        syncs = scheduler.take_sync()
        backlog = any(s.backlogged for s in syncs.values())
        if not (backlog or self._told_backlog or any(s.charges or s.joined for s in syncs.values())):
            return  # idle here: nothing to tell, no order to decide
        body = {str(int(p)): {"c": s.charges, "b": s.backlogged, "j": s.joined, "l": s.last_served}
                for p, s in syncs.items()}
        try:
            reply = await self._script(args=[self._prefix, self.replica, self._lease_ms, json.dumps(body)])
        except asyncio.CancelledError:
            scheduler.restore_sync(syncs)
            raise
        except RedisError as exc:
            scheduler.restore_sync(syncs)
            if not self._failing:
                self._failing = True
                log.warning("shared state: fairness counters unreachable, ordering by this replica's own (%s)", exc)
            return
        if self._failing:
            self._failing = False
            log.info("shared state: fairness counters reachable again")
        self._told_backlog = backlog
        for lane, counters in json.loads(reply).items():
            if counters:  # cjson writes an empty object for a lane with no tenants
                scheduler.set_counters(Priority(int(lane)), {t: float(v) for t, v in counters.items()})
