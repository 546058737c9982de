"""The quota ledger in Redis: exact limits across gateway replicas (docs/scale-out.md).

Every check-and-update is one Lua script (gateway/cluster/redis_scripts.py), so two replicas can never
both take the last slot. Each hold (concurrency, queued, the TPM and day reservation) is filed
under the replica that took it; the replica renews its lease every `lease_s / 3`, and a replica
that stops renewing (killed, partitioned) has all its holds released by the first script that runs
after its deadline, at most `lease_s` after its last renewal.

`admit` fails closed: when Redis cannot be reached the request gets a 503 OpenAI error. A
settlement that cannot reach Redis is retried at each lease renewal (the hold stays counted
meanwhile, which can only refuse more, never admit more).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from sluice.gateway.cluster import redis_scripts
from sluice.gateway.edge.errors import service_unavailable
from sluice.gateway.quotas.ledger import WINDOW_S, Ask, DayUnseeded, Outcome, Refusal, RefusedLimit, WindowView

log = logging.getLogger(__name__)

_REFUSALS: frozenset[str] = frozenset({"concurrent", "queued", "requests", "tokens", "day"})


@dataclass(slots=True)
class _MyHold:
    tenant_id: str
    day: str
    running: bool = False


@dataclass(frozen=True, slots=True)
class _Finish:
    tenant_id: str
    hold: str
    day: str
    used: int


def _limit(value: int | None) -> str:
    return "" if value is None else str(value)


class RedisLedger:
    def __init__(self, client: Redis, *, prefix: str, lease_s: float, replica: str | None = None) -> None:
        if not lease_s > 0:
            raise ValueError(f"shared.lease_s must be positive, got {lease_s}")
        self._client = client
        self._prefix = prefix
        self._lease_s = lease_s
        self.replica = replica or uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(getattr(redis_scripts, name))
            for name in ("ADMIT", "SEED_DAY", "MARK_RUNNING", "FINISH", "REFRESH", "ALIVE")
        }
        self._mine: dict[str, _MyHold] = {}  # this replica's holds
        self._views: dict[str, tuple[WindowView, float, int]] = {}  # tenant -> (newest view, monotonic read time, seq)
        self._retry: list[_Finish] = []  # settlements that did not reach Redis yet
        self._tasks: set[asyncio.Task[None]] = set()
        self._finishing: dict[str, asyncio.Task[None]] = {}  # hold -> its settlement in flight
        self._refresher: asyncio.Task[None] | None = None
        self._stop_renewing = asyncio.Event()

    async def _run(self, script: str, *args: str | int) -> Any:
        return await self._scripts[script](args=[self._prefix, *args])

    # ---- lease -----------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.refresh()
        except RedisError as exc:  # admission fails closed until Redis answers
            log.error("shared state: Redis unreachable at start (%s); admission answers 503 meanwhile", exc)
        self._stop_renewing.clear()
        self._refresher = asyncio.get_running_loop().create_task(self._renew_forever())

    async def refresh(self) -> None:
        """Retries pending settlements, renews this replica's lease and sweeps dead replicas."""
        pending, self._retry = self._retry, []
        for item in pending:
            await self._finish(item)
        await self._run("REFRESH", self.replica, int(self._lease_s * 1000))

    async def _renew_forever(self) -> None:
        while not self._stop_renewing.is_set():
            await asyncio.sleep(self._lease_s / 3)
            try:
                await self.refresh()
            except RedisError as exc:
                log.warning("shared state: lease renewal failed: %s", exc)

    async def stop(self) -> None:
        """Stops renewing (as a killed replica would), then, on a clean stop, gives the lease up."""
        await self.stop_renewing()
        await self.flush()
        with contextlib.suppress(RedisError):
            await self._run("REFRESH", self.replica, 0)  # releases whatever is still held

    async def stop_renewing(self) -> None:
        if self._refresher is not None:
            # The flag as well as the cancel: redis-py can swallow a cancellation that lands in the
            # middle of a command, and the loop must still end (at its next turn, at the latest).
            self._stop_renewing.set()
            self._refresher.cancel()
            await asyncio.wait({self._refresher}, timeout=self._lease_s + 5.0)
            self._refresher = None

    # ---- admission -------------------------------------------------------------------------------

    async def admit(self, ask: Ask) -> Outcome:
        limits, day = ask.limits, ask.day.isoformat()
        hold = f"{self.replica}:{next(self._ids)}"
        try:
            reply = await self._run(
                "ADMIT", self.replica, hold, int(self._lease_s * 1000), ask.tenant_id, ask.need, day,
                _limit(limits.max_concurrent), _limit(limits.max_queued), _limit(limits.requests_per_minute),
                _limit(limits.tokens_per_minute), _limit(limits.tokens_per_day),
            )
        except asyncio.CancelledError:
            # The script may have run with its answer lost: end the hold in case it exists.
            self._retry.append(_Finish(ask.tenant_id, hold, day, 0))
            raise
        except RedisError as exc:
            self._retry.append(_Finish(ask.tenant_id, hold, day, 0))  # as above
            log.error("shared state: admission failed, Redis unreachable: %s", exc)
            raise service_unavailable() from None
        status = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        self._remember_view(ask.tenant_id, reply[2:])
        if status == "ok":
            self._mine[hold] = _MyHold(ask.tenant_id, day)
            return hold
        if status == "unseeded":
            return DayUnseeded()
        if status not in _REFUSALS:
            raise RuntimeError(f"unexpected answer from the admission script: {status!r}")
        limit: RefusedLimit = status  # type: ignore[assignment]
        detail = int(reply[1])
        if limit == "day":
            return Refusal(limit, day_left=detail)
        return Refusal(limit, wait_s=detail / 1000)

    async def seed_day(self, tenant_id: str, day: dt.date, used: int) -> None:
        try:
            await self._run("SEED_DAY", tenant_id, day.isoformat(), used)
        except RedisError as exc:
            log.error("shared state: seeding the day failed, Redis unreachable: %s", exc)
            raise service_unavailable() from None

    # ---- settlement (returns at once, applied in the background) --------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def mark_running(self, tenant_id: str, hold: str) -> None:
        mine = self._mine.get(hold)
        if mine is not None and not mine.running:
            mine.running = True
            self._spawn(self._mark_running(hold))

    async def _mark_running(self, hold: str) -> None:
        try:
            await self._run("MARK_RUNNING", self.replica, hold)
        except RedisError as exc:  # harmless: the settlement ends the hold whatever its state
            log.warning("shared state: could not mark %s running: %s", hold, exc)

    def finish(self, tenant_id: str, hold: str, used: int) -> None:
        mine = self._mine.pop(hold, None)
        if mine is not None:
            task = self._finishing[hold] = self._spawn(self._finish(_Finish(tenant_id, hold, mine.day, used)))
            task.add_done_callback(lambda _: self._finishing.pop(hold, None))

    async def finished(self, hold: str) -> None:
        task = self._finishing.get(hold)
        if task is not None:
            await asyncio.shield(task)  # a cancelled waiter must not cancel the settlement

    async def _finish(self, item: _Finish) -> None:
        try:
            reply = await self._run("FINISH", self.replica, item.hold, item.tenant_id, item.day, item.used)
        except RedisError as exc:
            self._retry.append(item)
            log.warning("shared state: settlement of %s deferred, Redis unreachable: %s", item.hold, exc)
            return
        self._remember_view(item.tenant_id, reply)

    async def alive(self, replica: str) -> bool:
        """Whether `replica`'s lease lies in the future (Redis's clock); raises RedisError when
        Redis cannot be reached (the caller then decides nothing)."""
        return bool(await self._run("ALIVE", replica))

    async def flush(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- views -----------------------------------------------------------------------------------

    def _remember_view(self, tenant_id: str, values: list[Any]) -> None:
        """Keeps the newest view Redis produced (its sequence number), whatever order the
        replies of concurrent scripts arrive in. A view older than the window is replaced
        whatever its number (the counter starts over after a Redis restart)."""
        requests, requests_reset, tokens, tokens_reset, seq = (int(v) for v in values)
        known = self._views.get(tenant_id)
        if known is not None and known[2] > seq and time.monotonic() - known[1] < WINDOW_S:
            return
        view = WindowView(requests, requests_reset / 1000, tokens, tokens_reset / 1000)
        self._views[tenant_id] = (view, time.monotonic(), seq)

    def view(self, tenant_id: str) -> WindowView:
        """The window as the last script on this replica saw it (the headers are advisory)."""
        found = self._views.get(tenant_id)
        if found is None:
            return WindowView()
        view, read_at, _ = found
        elapsed = time.monotonic() - read_at
        return WindowView(
            view.requests, max(0.0, view.requests_reset_s - elapsed),
            view.tokens, max(0.0, view.tokens_reset_s - elapsed),
        )

    def live(self, tenant_id: str) -> tuple[int, int]:
        holds = [h for h in self._mine.values() if h.tenant_id == tenant_id]
        return len(holds), sum(not h.running for h in holds)
