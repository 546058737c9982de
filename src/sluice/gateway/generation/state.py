"""The one record of an accepted request's state in a gateway process, and the table that owns them.

A `RequestState` is made when a request is prepared (from an HTTP body, a batch line, or a
stream taken over from a lost replica) and lives until its end. Everything that follows the
request reads it here, and exactly one place changes each part of it:

- its identity and envelope (`request`, `envelope`): set once, by whoever made it; a resume
  replaces `request` with the same request carrying `resume_token_ids` (`resume_after`);
- its output (`output_token_ids`, counts, token times, first-output timing): folded in by
  `take_output`, which the dispatcher calls once per delta from a worker, before the delta goes to
  its sink. Worker failover resumes from `output_token_ids`, fair share charges what it returns,
  usage and records read the counts, and a stream's pump logs the ids not yet logged with its
  next event (`num_logged_tokens`), which is where a replica takeover resumes;
- where it waited and ran (`queued_at`, `worker`, `dispatch_time`, `attempts`, `route`): set by
  the dispatcher when it queues and sends it;
- its quota hold (`reservation`): set at admission, settled once at the end;
- how it ended (`finish_reason`, `error`): set from the final delta, or by a timeout or abort.

An answer with n choices (`n` > 1) is n requests, each with its own state (its own output,
failover and quota hold) under its own id, sharing one envelope (`Envelope.choices` = n), the
prompt billed with the first alone (`bills_request`);
generation/choices.py launches them and merges their answers. A request with tools carries its
answer's tool-call format in `request.tool_format`, so every answer builder parses the same way.

`RequestTable` holds the states of the client requests this process runs (accepted here or taken
over), by request id: what a drain waits for, and where a stream's follower finds its pump.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import msgspec

from sluice import telemetry
from sluice.protocol import GenerateRequest, RequestDelta

if TYPE_CHECKING:
    from sluice.gateway.quotas.service import Reservation

Endpoint = Literal["chat", "text"]  # chat.completion(s), or the legacy text_completion(s)


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """What every answer and chunk of one request repeats (its choices and usage vary). Kept with a
    streamed response's log, so a replica that takes the stream over writes the same envelope."""

    id: str
    created: int
    model: str
    service_tier: str
    endpoint: Endpoint
    include_usage: bool = False  # a stream's last chunk carries the usage (stream_options.include_usage)
    choices: int = 1  # n: the answer's choices, each its own request (generation/choices.py)


@dataclass(slots=True, eq=False)
class RequestState:
    """One accepted request (module docstring: who changes what)."""

    request: GenerateRequest
    envelope: Envelope
    tenant_name: str  # for records and metrics (never a key)
    stream: bool = False
    # False for the choices after the first of an n > 1 answer: the request and its prompt are
    # billed once, with choice 0 (OpenAI's usage), so the others' quota holds and usage records
    # count their completion tokens alone.
    bills_request: bool = True
    reservation: Reservation | None = None
    # ---- output, changed only by take_output / resume_after / reset_output
    output_token_ids: list[int] = field(default_factory=list)
    # tokens counted without ids (an upstream that sends none, or whose usage says more)
    num_tokens_without_ids: int = 0
    num_logged_tokens: int = 0  # of output_token_ids, those a stream's log holds (with its events)
    text_chars: int = 0  # characters of output text so far (text offsets of completion logprobs)
    token_times: list[float] = field(default_factory=list)  # engine-side, one per output token
    prompt_tokens: int = 0  # as the engine counted it (0: none reported yet)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache, by the attempt that first output
    first_token_time: float | None = None  # gateway clock: the first output reached this process
    engine_first_scheduled: float | None = None
    engine_first_token: float | None = None
    # ---- where it ran, changed by the dispatcher
    queued_at: float | None = None  # when it entered this process's scheduler (unix s)
    worker: str = ""
    dispatch_time: float | None = None  # its first dispatch (a resumed job keeps it)
    attempts: int = 0
    route: str = ""  # why routing chose its (last) worker (gateway/dispatch/routing.py)
    route_cached_tokens: int = 0  # of its prompt, the tokens routing expected that worker to hold
    # Set at admission (generation/service.py): its TTFT predicted at the best worker (None: not predicted).
    predicted_ttft_s: float | None = None
    # ---- its end
    finish_reason: str | None = None
    error: str | None = None
    error_status: int | None = None  # an upstream's 4xx refusal (RequestDelta.error_status)

    @classmethod
    def of(cls, request: GenerateRequest, service_tier: str, *, endpoint: Endpoint = "chat",
           tenant_name: str = "", stream: bool = False) -> RequestState:
        """The state of a request made elsewhere (a batch line, a test), with the envelope its answer has."""
        envelope = Envelope(id=request.request_id, created=int(time.time()), model=request.model,
                            service_tier=service_tier, endpoint=endpoint)
        return cls(request=request, envelope=envelope, tenant_name=tenant_name or request.tenant_id, stream=stream)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output_tokens(self) -> int:
        """Delivered so far (and charged to its tenant's fair-share counter)."""
        return len(self.output_token_ids) + self.num_tokens_without_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens or len(self.request.prompt_token_ids)

    @property
    def billed_prompt_tokens(self) -> int:
        """The prompt tokens its quota hold and usage record count (see `bills_request`)."""
        return self.num_prompt_tokens if self.bills_request else 0

    @property
    def resumable(self) -> bool:
        """Every token delivered is known by id, so another engine can go on after them."""
        return self.num_tokens_without_ids == 0

    @property
    def has_output(self) -> bool:
        return self.first_token_time is not None

    @property
    def ran(self) -> bool:
        """An engine scheduled it (its prompt was computed), whether or not it produced output."""
        return self.num_output_tokens > 0 or self.engine_first_scheduled is not None

    def take_output(self, delta: RequestDelta) -> int:
        """Folds one delta from its worker in; returns how many output tokens it added."""
        before = self.num_output_tokens
        self.output_token_ids.extend(delta.token_ids)
        self.num_tokens_without_ids = max(self.num_tokens_without_ids,
                                          delta.num_output_tokens - len(self.output_token_ids))
        self.token_times.extend(delta.token_times)
        self.text_chars += len(delta.text)
        self.prompt_tokens = delta.num_prompt_tokens or self.prompt_tokens
        # The first output, from whichever attempt made it, stands for the request: TTFT is the
        # first token ever, and a resumed attempt's cache hit on its own resumed tokens is not one.
        if self.first_token_time is None:
            self.cached_tokens = delta.num_cached_tokens or self.cached_tokens
            self.engine_first_scheduled = delta.first_scheduled_time or self.engine_first_scheduled
            if delta.token_ids or delta.text:  # text alone from an upstream that sends no ids
                self.first_token_time = time.time()
                self.engine_first_token = delta.first_token_time
        if delta.finish_reason is not None:
            self.finish_reason = str(delta.finish_reason)
            self.error = delta.error
            self.error_status = delta.error_status
        return max(0, self.num_output_tokens - before)

    def resume_after(self, token_ids: Sequence[int]) -> None:
        """It goes on after `token_ids`, delivered by an earlier attempt (worker failover) or by a
        replica that was lost (a stream taken over): another engine recomputes prompt + these."""
        resume = tuple(token_ids)
        if resume != self.request.resume_token_ids:
            self.request = msgspec.structs.replace(self.request, resume_token_ids=resume)

    def reset_output(self) -> None:
        """It runs again from scratch: nothing of it was delivered."""
        self.output_token_ids.clear()
        self.num_tokens_without_ids = 0
        self.num_logged_tokens = 0
        self.text_chars = 0
        self.token_times.clear()
        self.prompt_tokens = self.cached_tokens = 0
        self.first_token_time = self.engine_first_token = self.engine_first_scheduled = None

    def unlogged_tokens(self) -> list[int]:
        """The output ids a stream's log does not hold yet (`logged()` once they went with an event)."""
        return self.output_token_ids[self.num_logged_tokens:]

    def logged(self) -> None:
        """The output ids so far are in the stream's log: called after the event went in, so an
        event that could not be logged leaves them for the next."""
        self.num_logged_tokens = len(self.output_token_ids)

    def record(self, finish_time: float | None = None) -> telemetry.RequestRecord:
        """Its telemetry record (the one builder, for streams, whole answers and batch lines)."""
        request = self.request
        return telemetry.make_record(
            request_id=request.request_id, tenant=self.tenant_name, model=request.model,
            priority_class=request.priority.label, worker=self.worker, arrival=request.arrival_time,
            dispatch_time=self.dispatch_time, first_token_time=self.first_token_time,
            finish_time=time.time() if finish_time is None else finish_time, token_times=self.token_times,
            prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_output_tokens,
            cached_tokens=self.cached_tokens, finish_reason=self.finish_reason or "abort",
            engine_first_scheduled=self.engine_first_scheduled, engine_first_token=self.engine_first_token,
            batch_id=request.batch_id, route=self.route, route_cached_tokens=self.route_cached_tokens,
            ttft_target_s=request.ttft_target_s, itl_target_s=request.itl_target_s,
            predicted_ttft_s=self.predicted_ttft_s,
        )


T = TypeVar("T")


class RequestTable(Generic[T]):
    """What this process runs for clients, by request id: one entry per request, added once, removed
    once at its end (a second add of a live id is refused)."""

    def __init__(self) -> None:
        self._by_id: dict[str, T] = {}

    def add(self, request_id: str, entry: T) -> None:
        if request_id in self._by_id:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._by_id[request_id] = entry

    def remove(self, request_id: str, entry: Any) -> None:
        if self._by_id.get(request_id) is entry:
            del self._by_id[request_id]

    def get(self, request_id: str) -> T | None:
        return self._by_id.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._by_id.values()))
