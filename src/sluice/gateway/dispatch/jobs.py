"""A job: one request the gateway's dispatcher is responsible for, with the output it delivered.

The dispatcher (gateway/dispatch/dispatcher.py) owns the jobs; a job owns its output so far (token ids,
the count, batch token times, the first output delta), which only `take_output`, `reset_output`
and `resume_after` change: worker failover resumes from `output_token_ids`, fair share charges the
tokens `take_output` reports, and records read `num_output_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sluice.protocol import GenerateRequest, RequestDelta

DeltaSink = Callable[[RequestDelta], None]


def ended_sink(delta: RequestDelta) -> None:
    """A finished job's sink: nothing reaches it (its first sink is dropped, so no cycle through
    the client's submission outlives the request)."""


@dataclass(slots=True, eq=False)
class Job:
    """One request the gateway is responsible for until its final delta."""

    request: GenerateRequest
    sink: DeltaSink  # receives every delta, in order, the final one included
    enqueued_at: float = field(default_factory=time.time)  # its place in line (accepted at the gateway)
    queued_at: float | None = None  # when it entered this scheduler (unix s)
    ref: Any = None  # where it sits in Kafka (a RecordRef), handed back when finished
    worker: str = ""
    dispatch_time: float | None = None
    started: bool = False  # the worker produced something for it (it left the waiting queue)
    attempts: int = 0
    slot: str = ""  # its worker slot in the shared store while it holds one (gateway/dispatch/slots.py)
    # Its output so far, owned here and changed only by `take_output` / `reset_output` / `resume_after`:
    # token ids delivered to the sink (where a re-queued job resumes, worker failover) ...
    output_token_ids: list[int] = field(default_factory=list)
    # ... and tokens counted without ids (an upstream that sends none, or whose usage says more).
    num_tokens_without_ids: int = 0
    token_times: list[float] = field(default_factory=list)  # kept for batch lines' records only
    # The first delta that carried output: after a resume, its engine times and cached-token count
    # stand for the request (TTFT is the first token ever, whichever worker made it).
    first_output: RequestDelta | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output_tokens(self) -> int:
        """Delivered to its sink, and charged to its tenant's fair-share counter, so far."""
        return len(self.output_token_ids) + self.num_tokens_without_ids

    @property
    def resumable(self) -> bool:
        """Every token delivered is known by id, so another engine can go on after them."""
        return self.num_tokens_without_ids == 0

    def take_output(self, delta: RequestDelta) -> tuple[RequestDelta, int]:
        """Folds one delta from its worker into the output; returns the delta for the sink (a
        resumed attempt's with the first attempt's timing) and how many tokens it added."""
        before = self.num_output_tokens
        if self.request.batch_id is not None:
            self.token_times.extend(delta.token_times)
        self.output_token_ids.extend(delta.token_ids)
        self.num_tokens_without_ids = max(self.num_tokens_without_ids,
                                          delta.num_output_tokens - len(self.output_token_ids))
        if self.first_output is None:
            if delta.token_ids or delta.text:
                self.first_output = delta
        elif self.request.resume_token_ids:  # a resumed attempt: its timing starts at the first one
            first = self.first_output
            delta = msgspec.structs.replace(delta, first_scheduled_time=first.first_scheduled_time,
                                            first_token_time=first.first_token_time,
                                            num_cached_tokens=first.num_cached_tokens)
        return delta, max(0, self.num_output_tokens - before)

    def resume_after(self, token_ids: Sequence[int]) -> None:
        """Tokens another replica delivered before it was lost (a stream taken over): they count as
        delivered, so a later worker failover goes on after them too."""
        if self.num_output_tokens:
            raise ValueError(f"job {self.request_id} already has output; only a fresh job resumes after another's")
        self.output_token_ids.extend(token_ids)

    def reset_output(self) -> None:
        """It runs again from scratch: nothing of it was delivered."""
        self.output_token_ids.clear()
        self.num_tokens_without_ids = 0
        self.token_times.clear()
        self.first_output = None
