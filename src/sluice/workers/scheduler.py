"""Token-budget scheduler: decides which tokens of which requests the runner computes each step.

Pure Python (no torch). One engine step is `schedule() -> SchedulerOutput`, the runner's
`execute(SchedulerOutput) -> RunnerOutput`, then `update(SchedulerOutput, RunnerOutput)`. Three
policies share one mechanism so their trade-offs can be measured on identical load:

- chunked: decode-first, stall-free. Running decodes, then prefill chunks of running requests,
  then chunks of newly admitted requests fill what is left of the budget.
- prefill_first: if the head of the waiting queue can be admitted, the step prefills whole prompts
  only (no decodes); otherwise it decodes every running request (vLLM v0 / TGI without chunking).
- static: a batch is admitted only when nothing runs; it then decodes until every member finishes.

Chunk policy (chunked only): `fixed` lets prefill chunks fill what the decodes leave of the budget;
`adaptive` first caps that at what workers/chunk_budget.py allows: the largest prefill whose
predicted step time keeps the ITL targets of the decoding requests (an online cost model, in
workers/step_budget.py, that the engine feeds with each step's measured time via
`observe_step_time`), within `min_prefill_chunk` and the TTFT targets of prompts still to prefill.

Speculation (config.num_speculative_tokens > 0, any policy): a running request scheduled for just
its last token also gets prompt-lookup draft tokens (workers/speculative.py) within the budget and
the blocks already free (never preempting for a guess); `update` keeps the drafts that equal the
tokens sampled before them.

Shared prefixes (chunked, prefix caching on): a waiting request whose next blocks a running
request is still prefilling (the same tokens under the same cache salt: a tenant's requests with
one system prompt arriving together) is not admitted beside it, where it would compute them again;
it keeps its place in the queue until they are cached and are a hit, and the requests behind it
are admitted meanwhile (its wait holds back nobody else, another tenant least of all; past
max_num_seqs such requests in one step, admission stops looking). Only a run of at least
MIN_SHARED_PREFILL_TOKENS makes it wait: a few shared tokens are not worth a step.

Ranks: a request's rank is (priority, arrival_time, arrival_seq); smaller is served first and
preempted last. Running requests are kept sorted by rank, so the preemption victim is always the
tail of the list (lowest priority, latest arrival). Preemption is by recompute: the victim's blocks
are freed and it returns to the waiting queue with its original rank.
"""

from __future__ import annotations

import logging
from bisect import bisect_left, insort
from collections.abc import Callable
from itertools import pairwise

from sluice.grammar.compiler import TokenRefused
from sluice.protocol import Priority
from sluice.workers.block_manager import BlockManager
from sluice.workers.chunk_budget import AdaptiveChunkBudget
from sluice.workers.config import SchedulerConfig
from sluice.workers.request import Request, RequestStatus
from sluice.workers.scheduler_output import (
    RunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
    SchedulerStats,
    StepBuilder,
)
from sluice.workers.speculative import NgramIndex, PromptLookup
from sluice.workers.step_budget import StepCostModel, StepShape
from sluice.workers.waiting_queue import WaitingQueue

log = logging.getLogger(__name__)

MIN_SHARED_PREFILL_TOKENS = 64

__all__ = ["RunnerOutput", "ScheduledChunk", "Scheduler", "SchedulerOutput", "SchedulerStats"]


def _rank(request: Request) -> tuple[int, float, int]:
    return (request.priority, request.arrival_time, request.arrival_seq)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cost_model: StepCostModel | None = None) -> None:
        self.config = config
        # The step-time model of the adaptive chunk policy; fitted online unless one is given (tests).
        self.cost_model = cost_model if cost_model is not None else StepCostModel()
        self._adaptive = (AdaptiveChunkBudget(config, self.cost_model)
                          if config.policy == "chunked" and config.chunk_policy == "adaptive" else None)
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.stats = SchedulerStats()
        self._requests: dict[str, Request] = {}  # every live (waiting or running) request
        self._waiting = WaitingQueue()
        self._running: list[Request] = []  # sorted by rank, most urgent first
        self._next_seq = 0
        self._finished_in_schedule: list[Request] = []  # ended by schedule(), reported by update()
        self._lookup = (PromptLookup(config.num_speculative_tokens, config.prompt_lookup_min,
                                     config.prompt_lookup_max)
                        if config.num_speculative_tokens else None)

    # ---- state ---------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def prompt_lookup(self) -> PromptLookup | None:
        """The draft proposer (None: speculation off); its `num_tokens` may be changed between steps."""
        return self._lookup

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def prefill_backlog(self) -> tuple[int, ...]:
        """Prompt tokens still to prefill, waiting and running, by class (index = Priority value):
        the queue a new request finds, for the gateway's TTFT prediction (prefix hits ignored)."""
        backlog = [0] * len(Priority)
        # A copy: a link attached from another thread asks for a capacity report while the engine
        # thread may add or retire requests (list() of a dict's values is one step under the GIL).
        for request in list(self._requests.values()):
            left = request.num_tokens - request.num_computed_tokens
            if left > 1:  # a decode step's one token is not prefill
                backlog[request.priority] += left
        return tuple(backlog)

    def decode_context(self) -> int:
        """KV tokens the decoding requests read in every step (each its whole context): with
        `num_running`, what the decodes add to a step, for the gateway's TTFT prediction."""
        return sum(r.num_tokens for r in list(self._requests.values()) if r.is_decoding)

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        cfg = self.config
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid} is already in the engine")
        if (request.status != RequestStatus.WAITING or request.block_ids or request.num_computed_tokens
                or request.first_scheduled_time is not None):
            raise ValueError(f"request {rid} was already scheduled once; submit a fresh request")
        # A resumed request's output so far is context like its prompt (it is recomputed).
        if request.num_tokens >= cfg.max_model_len:
            resumed = f" and {request.num_output_tokens} resumed output" if request.output_token_ids else ""
            kind = "prompt and resumed" if request.output_token_ids else "prompt"
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens}{resumed} tokens but this model accepts at "
                f"most {cfg.max_model_len - 1} {kind} tokens (context length {cfg.max_model_len}, "
                "including at least one generated token)"
            )
        blocks = -(-request.num_tokens // cfg.block_size)
        if blocks > cfg.num_kv_blocks:
            raise ValueError(
                f"the prompt needs {blocks} KV blocks but the pool has only {cfg.num_kv_blocks}"
            )
        request.arrival_seq = self._next_seq
        self._next_seq += 1
        self._requests[rid] = request
        self._waiting.push(request)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request in any state; its blocks are free when this returns."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._retire(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """End a request early (the engine matched a stop string). No-op if it already left."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a finished status, got {status.name}")
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._retire(request, status)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        # The rule: each request has num_computed_tokens catching up to num_tokens. A step gives a
        # request the chunk all_token_ids[num_computed_tokens : num_computed_tokens + n]; the sum of
        # n over the step is at most max_num_batched_tokens, at most max_num_seqs requests run,
        # and every computed token has a KV block. A decode is simply a chunk with n == 1 that
        # ends at num_tokens; a prefill is a longer chunk; a prefix-cache hit advances
        # num_computed_tokens at admission without spending budget. The chunk that reaches
        # num_tokens samples one new token. The policy only decides who gets budget first (the
        # non-chunked ones run a prompt longer than the whole budget alone, so it is not stuck).
        # A running request short of blocks preempts the lowest-ranked running request (maybe
        # itself); a waiting one may preempt only strictly lower priorities, and only if that
        # makes enough room.
        step = StepBuilder(self.config.max_num_batched_tokens)
        policy = self.config.policy
        if policy == "chunked":
            self._schedule_running(step, now, self._decode)
            capped = False
            if self._adaptive is not None:
                budget = self._adaptive.prefill_budget(step, self._running, self._waiting.head, now)
                capped, step.budget = budget < step.budget, budget
            self._schedule_running(step, now, self._prefill_chunk)
            if not step.resource_preempted:
                self._admit(step, now, whole=False)
            if capped and step.budget == 0:  # prefill filled the cap: the cap, not the budget, held it back
                self.stats.num_itl_capped_steps += 1
        elif policy == "prefill_first":
            if not self._admit(step, now, whole=True):
                self._schedule_running(step, now, self._whole)
        else:  # static
            if self._running:
                self._schedule_running(step, now, self._whole)
            else:
                self._admit(step, now, whole=True)
        self.stats.num_steps += 1
        return step.build()

    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """The measured duration of a step this scheduler planned: the cost model learns from it."""
        self.cost_model.observe(StepShape.of(output), seconds)

    def update(self, output: SchedulerOutput, runner_output: RunnerOutput, now: float) -> list[Request]:
        """Apply a step's results; return the requests that got a token or finished this step."""
        changed, self._finished_in_schedule = self._finished_in_schedule, []
        for chunk in output.chunks:
            request = chunk.request
            if not self._is_running(request):
                continue  # aborted or finished between schedule() and update()
            if request.num_computed_tokens != chunk.start:
                raise RuntimeError(
                    f"update() for request {request.request_id} does not match the last schedule()"
                )
            if not chunk.sample:
                request.num_computed_tokens = chunk.start + chunk.num_tokens
                self.block_manager.cache_computed_blocks(request)
                continue
            sampled = runner_output.sampled_token_ids.get(request.request_id)
            if sampled is None or len(sampled) != chunk.num_sample_rows:
                raise ValueError(f"the runner output has no sampled token for request {request.request_id}"
                                 if sampled is None else
                                 f"the runner sampled {len(sampled)} tokens for request "
                                 f"{request.request_id}, not {chunk.num_sample_rows}")
            status = self._append_verified(request, sampled, chunk.draft_token_ids, now)
            # The K/V of the last token and of every kept draft is valid; a rejected draft's slot is
            # written again before num_computed_tokens reaches it.
            request.num_computed_tokens = request.num_tokens - 1
            self.block_manager.cache_computed_blocks(request)
            if status is not None:
                del self._requests[request.request_id]
                self._retire(request, status)
            changed.append(request)
        return changed

    def _append_verified(self, request: Request, sampled: tuple[int, ...], drafts: tuple[int, ...],
                         now: float) -> RequestStatus | None:
        """Append sampled[0], then sampled[j] while drafts[j - 1] == sampled[j - 1] (the draft was
        the token the model picks, so what was sampled after it is valid). Stops at a stop token or
        the length limit; returns the finish status, if any. A token its grammar refuses ends the
        request alone with an error (FINISHED_ERROR), the tokens before it kept."""
        kept = 0
        position = request.num_tokens
        status: RequestStatus | None = None
        for token_id in sampled:
            try:
                request.append_output(token_id, now)
            except TokenRefused as exc:
                log.warning("request %s: %s; it is ended with an error", request.request_id, exc)
                status = RequestStatus.FINISHED_ERROR
                break
            status = self._stop_status(request, token_id)
            if status is not None or kept == len(drafts) or drafts[kept] != token_id:
                break
            kept += 1
        if self._lookup is not None and request.ngram_index is not None:
            self._lookup.record(request.ngram_index, position, sampled, len(drafts), kept)
        self.stats.num_draft_tokens += len(drafts)
        self.stats.num_accepted_draft_tokens += kept
        return status

    def _drafts(self, request: Request, budget: int) -> tuple[int, ...]:
        """Prompt-lookup guesses at the tokens after a decoding request's last one (may be empty)."""
        if self._lookup is None:
            return ()
        # A step yields at most 1 + len(drafts) tokens: stay within max_tokens and the context.
        limit = min(budget - 1, request.sampling.max_tokens - request.num_output_tokens - 1,
                    self.config.max_model_len - request.num_tokens - 1)
        if limit <= 0:
            return ()
        if request.ngram_index is None:
            request.ngram_index = NgramIndex()
        # The step's other rows: every running request decodes at least one (speculative.py's bar).
        drafts = self._lookup.propose(request.ngram_index, request.all_token_ids, limit,
                                      batch_rows=len(self._running))
        if drafts and request.grammar is not None:
            # A draft the grammar refuses can never equal the (masked) sampled token: do not compute it.
            drafts = drafts[:request.grammar.num_accepted(drafts)]
        if drafts and not self.block_manager.allocate(request, request.num_tokens + len(drafts)):
            return ()  # no free block for the guesses: never preempt for them
        return drafts

    # ---- policy building blocks ----------------------------------------------------------------

    @staticmethod
    def _decode(request: Request, step: StepBuilder) -> int:
        """chunked, first pass: one token for requests that only lack their last token."""
        return 1 if request.is_decoding else 0

    def _prefill_chunk(self, request: Request, step: StepBuilder) -> int:
        """chunked, second pass: the next prefill chunk, capped by the budget and the chunk size."""
        left = request.num_tokens - request.num_computed_tokens
        return min(left, step.budget, self.config.prefill_chunk) if left > 1 else 0

    @staticmethod
    def _whole(request: Request, step: StepBuilder) -> int:
        """Non-chunked policies compute everything left, alone if it exceeds the budget."""
        left = request.num_tokens - request.num_computed_tokens
        return left if left <= step.budget or step.num_scheduled == 0 else 0

    def _schedule_running(
        self, step: StepBuilder, now: float, want: Callable[[Request, StepBuilder], int]
    ) -> None:
        """Give running requests, most urgent first, the chunk `want` asks for."""
        running = self._running
        i = 0
        while i < len(running) and step.budget > 0:
            request = running[i]
            n = 0 if step.has(request) else want(request, step)
            if n > 0:
                if not self._allocate_or_preempt(step, request, request.num_computed_tokens + n):
                    return  # the request preempted itself: it was the tail, nothing follows it
                drafts = self._drafts(request, step.budget) if n == 1 and request.is_decoding else ()
                step.add(request, n, now, drafts)
            i += 1

    def _allocate_or_preempt(self, step: StepBuilder, request: Request, num_tokens: int) -> bool:
        """Blocks for a running request: preempt the tail (lowest, latest) until they fit.

        False when `request` itself had to go (preempted, or finished because it outgrew the pool).
        """
        while not self.block_manager.allocate(request, num_tokens):
            victim = self._running[-1]
            if victim is request and len(self._running) == 1:
                # Alone and still short: the pool can never hold this context. End it ("length");
                # the next update() reports it.
                self._end_in_schedule(request)
                return False
            self._preempt(victim, step)
            step.resource_preempted = True
            if victim is request:
                return False
        return True

    def _admit(self, step: StepBuilder, now: float, *, whole: bool) -> int:
        """Move waiting requests to running in rank order while budget, slots and blocks allow.

        Stops at the first request that does not fit (strict priority: nobody overtakes it).
        Returns the number admitted.
        """
        cfg = self.config
        bm = self.block_manager
        admitted = 0
        in_flight: set[bytes] | None = None  # blocks running prefills will publish (module docstring)
        held: list[Request] = []  # passed over for this step, for a prefix being computed
        while step.budget > 0:
            request = self._waiting.peek()
            if request is None or request.request_id in step.preempted:
                break
            hits = bm.find_cached_prefix(request)
            if not whole and cfg.enable_prefix_caching:
                if in_flight is None:
                    in_flight = {h for r in self._running if not r.is_decoding for h in bm.pending_hashes(r)}
                if bm.shares_blocks(request, len(hits), in_flight, -(-MIN_SHARED_PREFILL_TOKENS // cfg.block_size)):
                    self.stats.num_shared_prefix_waits += 1
                    held.append(self._waiting.pop())
                    if len(held) >= cfg.max_num_seqs:  # a step runs no more: stop looking past them
                        break
                    continue
            num_cached = len(hits) * cfg.block_size
            left = request.num_tokens - num_cached
            if whole:
                if left > step.budget and step.num_scheduled > 0:
                    break
                n = left
            else:
                n = min(left, step.budget, cfg.prefill_chunk)
            needed = -(-(num_cached + n) // cfg.block_size) - len(hits)
            if needed + len(hits) > bm.num_blocks:
                # A preempted request whose context has outgrown the whole pool: it can never run
                # again. End it ("length") instead of blocking the queue; update() reports it.
                self._end_in_schedule(request)  # its heap entry goes stale and is skipped
                continue
            num_preempted = len(step.preempted)
            if not self._make_room(step, request, needed, hits):
                break
            if len(step.preempted) != num_preempted:
                in_flight = None  # the preempted compute nothing more: gather again
            self._waiting.pop()
            if not bm.allocate(request, num_cached + n, hits):
                raise RuntimeError("block accounting error: admission checked room it did not get")
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:
                request.num_cached_tokens = num_cached
            if cfg.enable_prefix_caching:
                self.stats.prefix_queried_tokens += request.num_tokens
                self.stats.prefix_hit_tokens += num_cached
            request.status = RequestStatus.RUNNING
            insort(self._running, request, key=_rank)
            step.add(request, n, now)
            if in_flight is not None:
                in_flight.update(bm.pending_hashes(request))
            admitted += 1
        for request in held:  # back in their places, ahead of everyone they let by
            self._waiting.push(request)
        return admitted

    def _make_room(self, step: StepBuilder, request: Request, needed: int, hits: list[int]) -> bool:
        """Ensure a seq slot and `needed` new blocks for the waiting `request`.

        If short, preempt running requests of strictly lower priority (lowest, latest first), but
        only when that suffices: never preempt for nothing, never for equal priority.
        """
        bm = self.block_manager
        slots_short = len(self._running) + 1 - self.config.max_num_seqs
        blocks_short = needed - bm.num_allocatable(hits)
        if slots_short <= 0 and blocks_short <= 0:
            return True
        victims: list[Request] = []
        enough = False
        for candidate in reversed(self._running):
            if candidate.priority <= request.priority:
                break
            victims.append(candidate)
            if len(victims) >= slots_short and (
                blocks_short <= 0 or bm.num_reclaimable(victims, hits) >= blocks_short
            ):
                enough = True
                break
        if not enough:
            return False
        for victim in victims:
            self._preempt(victim, step)
            self.stats.num_priority_preemptions += 1
        return True

    def _end_in_schedule(self, request: Request) -> None:
        del self._requests[request.request_id]
        self._retire(request, RequestStatus.FINISHED_LENGTH)
        self._finished_in_schedule.append(request)

    def _preempt(self, victim: Request, step: StepBuilder) -> None:
        """Recompute-preemption: drop its KV, keep its tokens and its original rank."""
        step.withdraw(victim)
        self._remove_running(victim)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        step.preempted[victim.request_id] = None
        self._waiting.push(victim)

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        sampling = request.sampling
        if token_id in sampling.stop_token_ids or (
            not sampling.ignore_eos and token_id in request.eos_token_ids
        ):
            return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_done:
            return RequestStatus.FINISHED_STOPPED  # the structured output is complete
        if (
            request.num_output_tokens >= sampling.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- queues --------------------------------------------------------------------------------

    def _is_running(self, request: Request) -> bool:
        return (
            request.status == RequestStatus.RUNNING
            and self._requests.get(request.request_id) is request
        )

    def _retire(self, request: Request, status: RequestStatus) -> None:
        """Take a live request (already removed from `_requests`) out of its queue, free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self._remove_running(request)
        elif request.status == RequestStatus.WAITING:
            self._waiting.discard(request)
        self.block_manager.free(request)
        request.status = status

    def _remove_running(self, request: Request) -> None:
        running = self._running
        if running and running[-1] is request:  # the usual case: preempting the tail
            running.pop()
            return
        i = bisect_left(running, _rank(request), key=_rank)
        if i == len(running) or running[i] is not request:
            raise RuntimeError(f"request {request.request_id} is not in the running list")
        del running[i]

    # ---- checks --------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise RuntimeError if the scheduler's or block manager's bookkeeping is inconsistent."""
        running = self._running
        if len(running) > self.config.max_num_seqs:
            raise RuntimeError(f"{len(running)} running requests exceed max_num_seqs")
        if any(_rank(a) >= _rank(b) for a, b in pairwise(running)):
            raise RuntimeError("the running list is not sorted by rank")
        waiting = self._waiting.live()
        if len(waiting) != len(self._waiting) or len({id(r) for r in waiting}) != len(waiting):
            raise RuntimeError("the waiting count disagrees with the waiting queue")
        if len(waiting) + len(running) != len(self._requests):
            raise RuntimeError("live requests are neither waiting nor running")
        for request in running:
            if not self._is_running(request):
                raise RuntimeError(f"request {request.request_id} is in the running list but not running")
            if not 0 <= request.num_computed_tokens <= request.num_tokens:
                raise RuntimeError(f"request {request.request_id} computed more tokens than it has")
            if len(request.block_ids) * self.config.block_size < request.num_computed_tokens:
                raise RuntimeError(f"request {request.request_id} has computed tokens without blocks")
        for request in waiting:
            if request.block_ids or request.num_computed_tokens:
                raise RuntimeError(f"waiting request {request.request_id} still holds KV state")
        self.block_manager.check_invariants(running)
