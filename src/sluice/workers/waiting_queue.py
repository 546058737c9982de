"""The scheduler's waiting queue: requests in rank order (priority, arrival time, arrival sequence).

A heap with lazy deletion: a request that leaves while waiting (aborted, ended) keeps its entry,
which is skipped when it reaches the top and dropped when stale entries outnumber live ones. An
entry is live while its request's status is WAITING. Pure Python.
"""

from __future__ import annotations

import heapq

from sluice.workers.request import Request, RequestStatus

_COMPACT_ABOVE = 64  # entries kept before stale ones are worth a rebuild


class WaitingQueue:
    __slots__ = ("_count", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._count = 0  # live entries

    def __len__(self) -> int:
        return self._count

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.arrival_seq, request))
        self._count += 1

    def peek(self) -> Request | None:
        """The first waiting request in rank order, or None."""
        heap = self._heap
        while heap:
            request = heap[0][3]
            if request.status == RequestStatus.WAITING:
                return request
            heapq.heappop(heap)  # left while waiting
        return None

    def pop(self) -> Request:
        """Remove and return the request `peek` returned."""
        request = heapq.heappop(self._heap)[3]
        self._count -= 1
        return request

    def discard(self, request: Request) -> None:
        """`request` (still WAITING) leaves the queue; its entry goes stale."""
        self._count -= 1
        heap = self._heap
        if len(heap) > _COMPACT_ABOVE and len(heap) > 2 * self._count:
            self._heap = [e for e in heap if e[3].status == RequestStatus.WAITING and e[3] is not request]
            heapq.heapify(self._heap)

    def head(self, n: int) -> list[Request]:
        """The first `n` entries in rank order, stale ones left out (so maybe fewer)."""
        return [entry[3] for entry in heapq.nsmallest(n, self._heap) if entry[3].status == RequestStatus.WAITING]

    def live(self) -> list[Request]:
        """Every live entry, in heap order (for invariant checks: a request twice is a bug)."""
        return [entry[3] for entry in self._heap if entry[3].status == RequestStatus.WAITING]


__all__ = ["WaitingQueue"]
