"""Engine-side state of one generation request (mutable, owned by the scheduler).

No torch here: the scheduler and block manager work on these objects and are tested on the CPU.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence

from sluice.grammar.compiler import Matcher
from sluice.protocol import FinishReason, GenerateRequest, Priority, SamplingParams
from sluice.workers.speculative import NgramIndex


class RequestStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5  # ended by the engine for this request alone (its grammar refused a sampled token)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One request inside the engine: its tokens, progress, KV blocks and timestamps.

    `num_computed_tokens` counts the tokens of `all_token_ids` whose KV is in the cache; it catches
    up to `num_tokens` chunk by chunk. `block_ids` is the request's block table (owned by the block
    manager). `block_hashes` caches the chained hashes of its full blocks (filled lazily).
    """

    __slots__ = (
        "_all_token_ids",
        "arrival_seq",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "cache_salt",
        "eos_token_ids",
        "first_scheduled_time",
        "first_token_time",
        "grammar",
        "itl_target_s",
        "ngram_index",
        "num_cached_tokens",
        "num_committed_blocks",
        "num_computed_tokens",
        "num_preemptions",
        "num_slow_gaps",
        "output_token_ids",
        "priority",
        "prompt_token_ids",
        "request_id",
        "sampling",
        "status",
        "token_times",
        "ttft_target_s",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        arrival_time: float,
        priority: int = Priority.STANDARD,
        cache_salt: str = "",
        eos_token_ids: Iterable[int] = (),
        resume_token_ids: Sequence[int] = (),
        itl_target_s: float | None = None,
        ttft_target_s: float | None = None,
    ) -> None:
        if not request_id:
            raise ValueError("request_id must be a non-empty string")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"request {request_id}: the prompt must contain at least one token")
        if isinstance(priority, bool) or int(priority) < 0:
            raise ValueError(f"request {request_id}: priority must be a non-negative integer")
        if itl_target_s is not None and not (math.isfinite(itl_target_s) and itl_target_s > 0):
            raise ValueError(f"request {request_id}: itl_target_s must be a positive number of seconds")
        if ttft_target_s is not None and not (math.isfinite(ttft_target_s) and ttft_target_s > 0):
            raise ValueError(f"request {request_id}: ttft_target_s must be a positive number of seconds")
        if not math.isfinite(arrival_time):
            raise ValueError(f"request {request_id}: arrival_time must be a finite number")
        sampling.validate()
        if len(resume_token_ids) >= sampling.max_tokens:
            raise ValueError(f"request {request_id}: {len(resume_token_ids)} resumed output tokens leave "
                             f"nothing to generate within max_tokens {sampling.max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling = sampling
        self.priority = int(priority)
        self.arrival_time = arrival_time
        self.arrival_seq = 0  # set by the scheduler: ties between equal arrival times
        self.cache_salt = cache_salt
        # Its inter-token latency target (sluice/objectives.py): while it decodes, the adaptive chunk
        # policy keeps each step within it (workers/step_budget.py). None: best effort.
        self.itl_target_s = itl_target_s
        # Gaps between its tokens longer than its ITL target so far, as the engine saw them (a
        # percentile objective forgives a share of them: workers/chunk_budget.py spends the rest).
        self.num_slow_gaps = 0
        self.ttft_target_s = ttft_target_s  # a prompt still to prefill may raise the budget to meet it
        self.eos_token_ids = frozenset(eos_token_ids)
        # A resumed request starts as a preempted one would: its earlier output is context to
        # recompute, counted in the output (max_tokens, usage) but never reported again.
        self.output_token_ids: list[int] = list(resume_token_ids)
        self._all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0  # leading blocks already offered to the prefix cache
        self.num_preemptions = 0
        self.ngram_index: NgramIndex | None = None  # speculation's index of its tokens (scheduler's)
        # Its structured output's matcher, following output_token_ids (set before it is scheduled;
        # None: unconstrained). Preemption keeps the output, so the matcher stays where it is.
        self.grammar: Matcher | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []

    @classmethod
    def from_generate(cls, message: GenerateRequest, eos_token_ids: Iterable[int] = ()) -> Request:
        """Build the engine-side request from the wire message."""
        return cls(
            message.request_id,
            message.prompt_token_ids,
            message.sampling,
            arrival_time=message.arrival_time,
            priority=int(message.priority),
            cache_salt=message.cache_salt,
            eos_token_ids=eos_token_ids,
            resume_token_ids=message.resume_token_ids,
            itl_target_s=message.itl_target_s,
            ttft_target_s=message.ttft_target_s,
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens. The list is shared: read it, never mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Only its last (sampled) token lacks K/V: its next chunk is a decode of one token."""
        return self.num_tokens - self.num_computed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def append_output(self, token_id: int, now: float) -> None:
        """Raises TokenRefused (appending nothing) when its grammar refuses `token_id`."""
        if self.grammar is not None:
            self.grammar.consume((token_id,))
        self._all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.itl_target_s is not None and now - self.token_times[-1] > self.itl_target_s:
            self.num_slow_gaps += 1
        self.token_times.append(now)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output after its first `num_output_tokens` tokens: a finished request whose
        last step produced tokens past its stop string."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            if self.grammar is not None:
                self.grammar.rollback(drop)
            del self._all_token_ids[-drop:], self.output_token_ids[-drop:], self.token_times[-drop:]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prio={self.priority}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_ids)})"
        )
