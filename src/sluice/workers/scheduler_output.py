"""Records exchanged at the scheduler's boundary, and the builder of one step's schedule.

`SchedulerOutput` goes to the runner, which answers with `RunnerOutput`; both are plain frozen
records (no torch). `StepBuilder` is the scheduler's scratch space while it builds one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.protocol import PositionLogprobs
from sluice.workers.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    start: int  # == request.num_computed_tokens before this step: position of the first token computed
    num_tokens: int  # tokens computed this step: input_token_ids(), drafts included
    block_ids: tuple[int, ...]  # the request's whole block table after allocation
    sample: bool  # the chunk reaches request.num_tokens: the runner samples a new token
    # Speculative tokens after the request's last one (workers/speculative.py), computed with it;
    # the runner also samples after each of them, and the scheduler keeps those it verifies.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.sample

    @property
    def num_sample_rows(self) -> int:
        """Rows the runner samples at: the chunk's last token and each draft (0 if it does not sample)."""
        return 1 + len(self.draft_token_ids) if self.sample else 0

    def input_token_ids(self) -> list[int]:
        """The token ids this step computes, at positions start .. start + num_tokens - 1."""
        end = self.start + self.num_tokens - len(self.draft_token_ids)
        return [*self.request.all_token_ids[self.start:end], *self.draft_token_ids]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # decodes first, then prefill chunks
    preempted_ids: tuple[str, ...]
    num_batched_tokens: int


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """Built by the runner from the chunks with sample=True: per request, the token sampled after
    its last token, then after each of its draft tokens (`ScheduledChunk.num_sample_rows` in all),
    and their logprobs where asked."""

    sampled_token_ids: dict[str, tuple[int, ...]]
    logprobs: dict[str, tuple[PositionLogprobs, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0  # total, resource and priority preemptions together
    num_priority_preemptions: int = 0  # of those, on behalf of a waiting higher-priority request
    prefix_queried_tokens: int = 0  # tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0  # of those, tokens served from cached blocks
    num_draft_tokens: int = 0  # speculative tokens computed
    num_accepted_draft_tokens: int = 0  # of those, kept (each saved a step of its request)
    num_itl_capped_steps: int = 0  # adaptive chunk policy: steps whose prefill was cut to hold an ITL target
    num_shared_prefix_waits: int = 0  # a waiting request passed over for a step: a running prefill computes its prefix


class StepBuilder:
    """Chunks of the step being built. A chunk can be withdrawn when its request is preempted."""

    __slots__ = ("budget", "decodes", "preempted", "prefills", "resource_preempted")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        # request_id -> (request, start, num_tokens, draft token ids); dicts keep scheduling order.
        self.decodes: dict[str, tuple[Request, int, int, tuple[int, ...]]] = {}
        self.prefills: dict[str, tuple[Request, int, int, tuple[int, ...]]] = {}
        self.preempted: dict[str, None] = {}
        self.resource_preempted = False  # a running request lacked blocks: admit nobody this step

    @property
    def num_scheduled(self) -> int:
        return len(self.decodes) + len(self.prefills)

    def has(self, request: Request) -> bool:
        return request.request_id in self.decodes or request.request_id in self.prefills

    def add(self, request: Request, num_tokens: int, now: float, drafts: tuple[int, ...] = ()) -> None:
        """Schedule `num_tokens` of the request's own tokens, then `drafts` (a decode's guesses)."""
        start = request.num_computed_tokens
        entry = (request, start, num_tokens + len(drafts), drafts)
        if num_tokens == 1 and request.is_decoding:
            self.decodes[request.request_id] = entry
        else:
            self.prefills[request.request_id] = entry
        self.budget -= num_tokens + len(drafts)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now

    def withdraw(self, request: Request) -> None:
        entry = self.decodes.pop(request.request_id, None) or self.prefills.pop(request.request_id, None)
        if entry is not None:
            self.budget += entry[2]

    def build(self) -> SchedulerOutput:
        chunks = tuple(
            ScheduledChunk(r, start, n, tuple(r.block_ids), start + n - len(drafts) == r.num_tokens, drafts)
            for entries in (self.decodes, self.prefills)
            for r, start, n, drafts in entries.values()
        )
        return SchedulerOutput(chunks, tuple(self.preempted), sum(c.num_tokens for c in chunks))
