"""A job: one request the dispatcher is responsible for, from `enqueue` to its final delta.

The dispatcher (dispatch/dispatcher.py) owns the jobs. A job refers to its request's one record
(`RequestState`, generation/state.py), where the dispatcher folds in each delta before handing it
to the job's sink (a client's stream, a whole answer's collector, or a batch line's), and where it
notes which worker runs it; the job itself holds only what dispatching needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice.gateway.generation.state import RequestState
from sluice.protocol import GenerateRequest, RequestDelta

if TYPE_CHECKING:
    from sluice.gateway.dispatch.routing import Decision, PromptBlocks

DeltaSink = Callable[[RequestDelta], None]


def ended_sink(delta: RequestDelta) -> None:
    """A finished job's sink: nothing reaches it (its first sink is dropped, so no cycle through
    the client's submission outlives the request)."""


@dataclass(slots=True, eq=False)
class Job:
    """One request the dispatcher is responsible for until its final delta."""

    state: RequestState
    sink: DeltaSink  # receives every delta, in order, the final one included
    enqueued_at: float = field(default_factory=time.time)  # its place in line (accepted at the gateway)
    ref: Any = None  # where it sits in Kafka (a RecordRef), handed back when finished
    started: bool = False  # the worker produced something for it (it left the waiting queue)
    slot: str = ""  # its worker slot in the shared store while it holds one (dispatch/slots.py)
    prompt_blocks: PromptBlocks | None = None  # its prompt's block hashes, once routing needed them
    ranking: list[Decision] = field(default_factory=list)  # routing's last ranking of its candidates
    held_since: float | None = None  # first held back to wait for the worker holding its prefix

    @property
    def request(self) -> GenerateRequest:
        return self.state.request

    @property
    def request_id(self) -> str:
        return self.state.request.request_id

    @property
    def worker(self) -> str:
        """The worker it was last sent to ("" while it waits here)."""
        return self.state.worker
