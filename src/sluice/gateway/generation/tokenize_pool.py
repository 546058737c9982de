"""Tokenizer capacity shared fairly between tenants: large prompts run on worker threads, at most
`threads` at once, and at most one per tenant.

A prompt over `INLINE_PROMPT_CHARS` characters is rendered and tokenized off the event loop (a
1 MB prompt takes ~2 s of CPU). The threads are few (each tokenization holds the prompt's tokens
and the tokenizer's scratch memory beside everything else), so they are a shared resource: with a
plain semaphore one tenant sending 30 large prompts at once queued every other tenant's large
prompt behind all of them (issue #36: 0.07 s became 6.65 s). Here each tenant waits for its own
previous tokenization first (a per-tenant lock), so one tenant holds at most one thread and one
place in the threads' queue, and another tenant's prompt waits for at most one of its own turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

INLINE_PROMPT_CHARS = 16_384  # tokenized on the event loop up to this size (a thread hop costs more)
TOKENIZE_THREADS = 2


class FairTokenizePool:
    """Runs tokenizations on threads: `threads` at once, one per tenant at a time."""

    def __init__(self, threads: int = TOKENIZE_THREADS) -> None:
        self._threads = asyncio.Semaphore(threads)
        # tenant id -> (its lock, how many of its calls hold or wait for it); dropped at zero.
        self._tenants: dict[str, tuple[asyncio.Lock, int]] = {}

    async def run(self, tenant_id: str, work: Callable[..., T], *args: object) -> T:
        lock, users = self._tenants.get(tenant_id) or (asyncio.Lock(), 0)
        self._tenants[tenant_id] = (lock, users + 1)
        try:
            async with lock, self._threads:
                return await asyncio.to_thread(work, *args)
        finally:
            lock, users = self._tenants[tenant_id]
            if users == 1:
                del self._tenants[tenant_id]
            else:
                self._tenants[tenant_id] = (lock, users - 1)

    def waiting(self, tenant_id: str) -> int:
        """Calls of this tenant running or waiting here."""
        found = self._tenants.get(tenant_id)
        return 0 if found is None else found[1]
