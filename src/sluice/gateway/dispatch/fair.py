"""The gateway's in-memory scheduler: priority classes × weighted fair sharing between tenants.

Pure Python (no asyncio, no Kafka) so it is unit-tested with hand-made items.

Between classes: strict order interactive > standard > batch, with two anti-starvation rules
(settings.scheduler): a lower class is served first once its oldest item has waited `aging_s`,
and a backlogged lower class gets at least `min_share_<class>` of recent dispatches.

Inside a class: the virtual token counter (VTC) of "Fairness in Serving Large Language Models"
(OSDI'24). Each tenant has a counter that grows by (tokens served) / weight; the backlogged tenant
with the smallest counter is served next. A tenant that becomes backlogged is lifted to the
smallest counter among the backlogged tenants, so idle time never banks credit. Tokens are charged
as they are served: the prompt when dispatched, generated tokens as the worker reports them.

Several replicas (`shared_counters=True`, driven by gateway/dispatch/fair_shared.py): the counters are the
cluster's. This scheduler keeps serving from its local counters and records what it charged and
which tenants became backlogged; every few tens of milliseconds `take_sync()` hands those to the
shared store and `set_counters()` puts back the cluster-wide values (plus what was charged here
meanwhile), so every replica orders its tenants by the service they got everywhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sluice.protocol import Priority

T = TypeVar("T")

# How many recent dispatches the minimum-share rule looks at.
SHARE_WINDOW = 100


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """Anti-starvation rules between classes (see the module docstring)."""

    priority_enabled: bool = True
    aging_s: float = 30.0  # 0 disables aging
    min_share: dict[Priority, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.aging_s < 0:
            raise ValueError(f"aging_s must be zero (off) or positive, got {self.aging_s}")
        for cls, share in self.min_share.items():
            if not 0.0 <= share < 1.0:
                raise ValueError(f"the minimum share of {cls.label} must be in [0, 1), got {share}")


@dataclass(slots=True)
class LaneSync:
    """What one lane did since the last sync, for the shared counters (see the module docstring)."""

    charges: dict[str, float]  # tenant -> counter increase (tokens / weight)
    backlogged: list[str]  # tenants with items queued now
    joined: list[str]  # tenants that became backlogged since the last sync (to be lifted)
    last_served: float  # the lift when no tenant is backlogged anywhere


@dataclass(slots=True)
class Pending(Generic[T]):
    """One queued item. `payload` is whatever the caller dispatches (a GenerateRequest, ...)."""

    request_id: str
    tenant: str
    priority: Priority
    enqueued_at: float
    payload: T
    prompt_tokens: int = 0
    weight: float = 1.0


class _TenantQueues(Generic[T]):
    """One class: a FIFO per tenant plus the tenants' virtual token counters."""

    def __init__(self, track: bool = False) -> None:
        self.queues: dict[str, deque[Pending[T]]] = {}
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.size = 0
        self._last_served = 0.0  # counter of the last tenant served: the lift when nobody is backlogged
        # Shared counters only: charges and newly backlogged tenants since the last sync.
        self._track = track
        self._unsynced: dict[str, float] = {}
        self._joined: set[str] = set()

    def push(self, item: Pending[T]) -> None:
        tenant = item.tenant
        self.weights[tenant] = item.weight
        queue = self.queues.get(tenant)
        if queue is None:
            # Newly backlogged: lift to the backlogged minimum (no banking of idle credit).
            floor = min((self.counters[t] for t in self.queues), default=self._last_served)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
            queue = self.queues[tenant] = deque()
            if self._track:
                self._joined.add(tenant)
        queue.append(item)
        self.size += 1

    def push_front(self, item: Pending[T]) -> None:
        """Re-queue an item that was already dispatched once (its worker died): it keeps its turn."""
        self.push(item)
        queue = self.queues[item.tenant]
        queue.rotate(1)  # the item just appended becomes the head

    def next_tenant(self) -> str | None:
        if not self.queues:
            return None
        return min(self.queues, key=lambda t: (self.counters[t], self.queues[t][0].enqueued_at))

    def pop(self) -> Pending[T] | None:
        tenant = self.next_tenant()
        if tenant is None:
            return None
        queue = self.queues[tenant]
        item = queue.popleft()
        if not queue:
            del self.queues[tenant]
        self.size -= 1
        self._last_served = self.counters[tenant]
        return item

    def take(self, tenant: str, item: Pending[T]) -> None:
        """Removes `item` (queued for `tenant`), as `pop` would."""
        queue = self.queues[tenant]
        queue.remove(item)
        if not queue:
            del self.queues[tenant]
        self.size -= 1
        self._last_served = self.counters[tenant]

    def peek(self) -> Pending[T] | None:
        tenant = self.next_tenant()
        return None if tenant is None else self.queues[tenant][0]

    def oldest(self) -> float | None:
        return min((q[0].enqueued_at for q in self.queues.values()), default=None)

    def charge(self, tenant: str, tokens: int, weight: float | None = None) -> None:
        w = weight if weight is not None else self.weights.get(tenant, 1.0)
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / w
        if self._track:
            self._unsynced[tenant] = self._unsynced.get(tenant, 0.0) + tokens / w

    def take_sync(self) -> LaneSync:
        sync = LaneSync(self._unsynced, list(self.queues), sorted(self._joined), self._last_served)
        self._unsynced, self._joined = {}, set()
        return sync

    def restore_sync(self, sync: LaneSync) -> None:
        for tenant, amount in sync.charges.items():
            self._unsynced[tenant] = self._unsynced.get(tenant, 0.0) + amount
        self._joined.update(sync.joined)

    def set_counters(self, counters: dict[str, float]) -> None:
        """The cluster's counters, plus what was charged here since they were read."""
        for tenant, value in counters.items():
            self.counters[tenant] = value + self._unsynced.get(tenant, 0.0)

    def remove(self, request_id: str) -> Pending[T] | None:
        for tenant, queue in self.queues.items():
            for item in queue:
                if item.request_id == request_id:
                    queue.remove(item)
                    self.size -= 1
                    if not queue:
                        del self.queues[tenant]
                    return item
        return None


class FairScheduler(Generic[T]):
    """Priority classes with anti-starvation; VTC fair sharing between tenants inside a class."""

    def __init__(self, policy: ClassPolicy | None = None, *, shared_counters: bool = False) -> None:
        self.policy = policy or ClassPolicy()
        self._classes: dict[Priority, _TenantQueues[T]] = {p: _TenantQueues(shared_counters) for p in Priority}
        self._recent: deque[Priority] = deque(maxlen=SHARE_WINDOW)

    # ---- queue ---------------------------------------------------------------------------------

    def _lane(self, priority: Priority) -> Priority:
        # Priority off (the isolation experiment's control arm): every class shares one lane.
        return priority if self.policy.priority_enabled else Priority.STANDARD

    def push(self, item: Pending[T]) -> None:
        if item.weight <= 0:
            raise ValueError(f"tenant weight must be positive, got {item.weight}")
        self._classes[self._lane(item.priority)].push(item)

    def requeue(self, item: Pending[T]) -> None:
        """Put back an item whose dispatch failed; it is served before its tenant's newer items."""
        self._classes[self._lane(item.priority)].push_front(item)

    def remove(self, request_id: str) -> Pending[T] | None:
        for lane in self._classes.values():
            item = lane.remove(request_id)
            if item is not None:
                return item
        return None

    def __len__(self) -> int:
        return sum(lane.size for lane in self._classes.values())

    def depth(self, priority: Priority) -> int:
        """Items queued whose own class is `priority` (whatever lane they sit in)."""
        return sum(1 for item in self.items() if item.priority == priority)

    def items(self) -> Iterator[Pending[T]]:
        for lane in self._classes.values():
            for queue in lane.queues.values():
                yield from queue

    # ---- choice --------------------------------------------------------------------------------

    def _choose_lane(self, now: float) -> Priority | None:
        backlogged = [p for p in Priority if self._classes[p].size]  # most urgent first
        if not backlogged:
            return None
        policy = self.policy
        # Minimum share: a backlogged lower class that got less than its share of recent
        # dispatches goes first (checked from the least urgent class up, so batch is not
        # starved by standard either).
        if len(backlogged) > 1 and self._recent:
            for p in reversed(backlogged[1:]):
                share = policy.min_share.get(p, 0.0)
                if share and self._recent.count(p) < share * len(self._recent):
                    return p
        # Aging: the lower class whose oldest item waited longest past aging_s goes first.
        if policy.aging_s and len(backlogged) > 1:
            aged = [
                (oldest, p) for p in backlogged[1:]
                if (oldest := self._classes[p].oldest()) is not None and now - oldest >= policy.aging_s
            ]
            if aged:
                return min(aged)[1]
        return backlogged[0]

    def peek(self, now: float) -> Pending[T] | None:
        lane = self._choose_lane(now)
        return None if lane is None else self._classes[lane].peek()

    def pop(self, now: float) -> Pending[T] | None:
        """The next item to dispatch; its prompt tokens are charged to its tenant."""
        lane = self._choose_lane(now)
        if lane is None:
            return None
        item = self._classes[lane].pop()
        if item is not None:
            self._recent.append(lane)
            self._classes[lane].charge(item.tenant, item.prompt_tokens, item.weight)
        return item

    def pop_if(self, now: float, accept: Callable[[Pending[T]], bool]) -> Pending[T] | None:
        """The first item in dispatch order that `accept(item)` takes (e.g. a worker serving its
        model has room for its class), removed as `pop` would. See `first`."""
        item = self.first(now, accept)
        if item is not None:
            self.claim(item)
        return item

    def first(self, now: float, accept: Callable[[Pending[T]], bool]) -> Pending[T] | None:
        """The first item in dispatch order that `accept(item)` takes, left in the queue (a caller
        that must ask the shared store before sending claims it afterwards). An item nobody can
        take now (no live worker serves its model) does not hold back the items behind it: the
        chosen lane first, then the others most urgent first; in a lane, tenants by virtual
        counter, each tenant's items in order."""
        first = self._choose_lane(now)
        if first is None:
            return None
        for priority in (first, *(p for p in Priority if p != first)):
            lane = self._classes[priority]
            for tenant in sorted(lane.queues, key=lambda t: (lane.counters[t], lane.queues[t][0].enqueued_at)):
                for item in lane.queues[tenant]:
                    if accept(item):
                        return item
        return None

    def claim(self, item: Pending[T]) -> None:
        """Removes a queued `item` (from `first`) as `pop` would: its prompt is charged."""
        priority = self._lane(item.priority)
        lane = self._classes[priority]
        lane.take(item.tenant, item)
        self._recent.append(priority)
        lane.charge(item.tenant, item.prompt_tokens, item.weight)

    def charge(self, tenant: str, priority: Priority, tokens: int) -> None:
        """Generated tokens served to `tenant` (reported by a worker)."""
        if tokens:
            self._classes[self._lane(priority)].charge(tenant, tokens)

    # ---- shared counters (see the module docstring) --------------------------------------------

    def take_sync(self) -> dict[Priority, LaneSync]:
        """Per lane: charges and joins since the last sync, and who is backlogged now."""
        return {p: lane.take_sync() for p, lane in self._classes.items()}

    def restore_sync(self, syncs: dict[Priority, LaneSync]) -> None:
        """A sync that did not reach the store: its charges and joins are told next time."""
        for p, sync in syncs.items():
            self._classes[p].restore_sync(sync)

    def set_counters(self, lane: Priority, counters: dict[str, float]) -> None:
        self._classes[lane].set_counters(counters)

    def counter(self, lane: Priority, tenant: str) -> float:
        return self._classes[lane].counters.get(tenant, 0.0)

    # ---- views ---------------------------------------------------------------------------------

    def snapshot(self, now: float) -> dict[str, object]:
        """Depth per class and tenant, and the oldest wait, for the admin live views."""
        classes: dict[str, object] = {}
        for p in Priority:
            per_tenant: dict[str, int] = {}
            oldest_by_tenant: dict[str, float] = {}
            for item in self.items():
                if item.priority != p:
                    continue
                per_tenant[item.tenant] = per_tenant.get(item.tenant, 0) + 1
                oldest_by_tenant[item.tenant] = min(oldest_by_tenant.get(item.tenant, item.enqueued_at),
                                                    item.enqueued_at)
            oldest = min(oldest_by_tenant.values(), default=None)
            classes[p.label] = {
                "depth": sum(per_tenant.values()),
                "tenants": per_tenant,
                "oldest_wait_s": None if oldest is None else max(0.0, now - oldest),
                "tenant_oldest_wait_s": {t: max(0.0, now - at) for t, at in oldest_by_tenant.items()},
            }
        return {"priority_enabled": self.policy.priority_enabled, "classes": classes}
