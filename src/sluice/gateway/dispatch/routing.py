"""Routing: which of the workers that may serve a request it goes to (docs/routing.md).

The fair scheduler (dispatch/fair.py) decides which request goes next; routing decides where. The
dispatcher hands `Router.rank` the candidate workers (serving the model, not draining) and sends
the job to the first in the ranking with room (dispatch/slots.py's room rule); the chosen
`Decision` says why, in the request's record (`route`).

Policies (`routing.policy`):
- `least_loaded`: fewest running and waiting requests per slot (`WorkerLink.load`);
- `round_robin`: each candidate in turn;
- `cache_aware`: the lowest predicted cost. A worker's cost is the prompt tokens it would have to
  prefill (those not in its prefix cache: the gateway hashes the prompt with the engine's function,
  sluice/prefix_hash.py, and looks the hashes up in the worker's index, dispatch/cache_index.py)
  plus its pressure, `load + KV use`, times `load_cost_tokens`. A guard spreads a hot prefix: a
  worker whose load exceeds the least loaded one's by more than `spread_margin` is ranked after
  every worker within the margin, so a cached prefix never drives its worker into overload (the
  "death spiral" of cache-only routing); once the prefix is cached on both, load decides. So is a
  worker this router sent more than `1 + balance_margin` times the candidates' mean of recent work
  (and more than `BALANCE_FLOOR` times the work the request would bring another worker over that
  mean, so moving it narrows the gap and does not turn it round), for a request whose leading block
  is hot there (`HOT_LEAD_SHARE` of the worker's recent work or more): on a quiet cluster, where
  loads read 0 between requests, a hot tenant would otherwise keep one worker doing most of the
  work, and moving a cold tenant's request instead would prefill its whole context again for
  nothing. A request's work is what it asks of the worker it goes to, in decode tokens: its
  `max_tokens` plus `PREFILL_TOKEN_WORK` per prompt token not cached there (`request_work`), so a
  long answer or a cold prompt weighs more than a short cached turn.
  Costs within `TIE_TOKENS` of the cheapest are a tie, broken by the work this router sent each
  worker recently (each request weighing half as much every `RECENT_HALF_LIFE_S`): a hot tenant's new
  conversations alternate between the workers that hold its prefix instead of all landing on the
  first.

Predicted TTFT (every policy): a request with a TTFT target goes to a worker predicted to meet it
(dispatch/ttft.py: the worker's reported step cost and prefill backlog, and, under cache_aware,
the prompt tokens it holds). The policy's ranking is kept among the workers predicted to meet it
and among the rest; a worker that cannot be predicted (an upstream, a cold cost model) ranks with
those that meet it (nothing says it would miss). When that moved another worker to the front, the
record's route is `ttft`.

`Router.rank(candidates, request)` is the one seam: another predictor can replace `_cost` and keep
the rest.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.gateway.dispatch.ttft import predict_ttft
from sluice.prefix_hash import prefix_block_hashes
from sluice.protocol import GenerateRequest
from sluice.settings import RoutingSettings

if TYPE_CHECKING:
    from sluice.gateway.dispatch.links.base import WorkerLink

# Why a request went where it went (the record's `route`).
REASON_LEAST_LOADED = "least_loaded"
REASON_ROUND_ROBIN = "round_robin"
REASON_CACHE = "cache"  # cache_aware: the cheapest worker holds part of the prompt
REASON_LOAD = "load"  # cache_aware: no cached prefix made a difference; the least pressure won
REASON_SPREAD = "spread"  # cache_aware: the worker holding the prefix was loaded past the margin
REASON_TTFT = "ttft"  # the policy's first choice was predicted to miss the TTFT target; this one not

# cache_aware: costs (prefill tokens) this close to the cheapest tie; the tie goes to the worker sent
# the least work recently. Below a turn's growth (a user message and an answer, three blocks or
# more), so a conversation's next turn still goes where its last one is cached.
TIE_TOKENS = 32
RECENT_HALF_LIFE_S = 20.0
# A request's work on a worker, in decode tokens: its max_tokens plus this per prompt token the
# worker must prefill. Fitted on the routing bench's CPU workers (each worker's CPU seconds against
# its requests' output and uncached prompt tokens: 0.07-0.1); on a GPU a prefill token is cheaper
# still against a decode token, so this errs towards counting cold prompts as heavy.
PREFILL_TOKEN_WORK = 1 / 12
# cache_aware's balance guard leaves a worker alone until it was sent more than this many times the
# work the request would ask of the cheapest other candidate over the candidates' mean: with two
# workers, until the gap between them exceeds that work, so moving the request narrows the gap and
# does not turn it round (a cold prompt, prefilled whole on the other worker, weighs more than a
# turn whose prefix both hold). A lone conversation on a quiet cluster moves once it sends turns
# faster than about every 20 s. At 2 requests (before work was weighed) a hot tenant kept to two
# of three workers (bench routing, run 12: one did 1.35x its share of the CPU).
BALANCE_FLOOR = 0.5
# ... and only for a request whose leading block (its tenant's system prompt, salted) was this share
# of the worker's recent work or more: the hot prefix is what moves. It is prefilled once on the
# other worker and from there near-ties share it, while a cold tenant's request, whose context only
# this worker holds, stays (moving it would prefill that context again for one request).
HOT_LEAD_SHARE = 1 / 3
LEAD_TOKENS = 16  # a prompt's leading block, for the hot-prefix test
RECENT_LEADS_CAP = 4096  # (worker, leading block) work counters kept; the faintest are dropped past it
# cache_aware: a job whose first-ranked worker holds at least LOCALITY_MIN_TOKENS more of its prompt
# than another candidate does not go to that other one for LOCALITY_WAIT_S after it was first held
# back for it (`Router.in_reach`).
LOCALITY_MIN_TOKENS = 256
LOCALITY_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Decision:
    """One candidate as routing sees it: why it ranks where it does, and the prompt tokens it holds
    (cache_aware only; 0 under the policies that do not look)."""

    worker: WorkerLink
    reason: str
    cached_tokens: int = 0
    cost: float = 0.0
    predicted_ttft_s: float | None = None  # None: not predicted (no target, or not predictable)


@dataclass(slots=True)
class PromptBlocks:
    """A request's prompt block hashes per block size, computed once per request (a queued job is
    looked at in every dispatch round)."""

    request: GenerateRequest
    by_block_size: dict[int, list[bytes]] = field(default_factory=dict)
    _lead: bytes | None = field(default=None, init=False, repr=False)

    @property
    def lead(self) -> bytes:
        """The hash of the prompt's first `LEAD_TOKENS` tokens, salted: its tenant's system prompt,
        whatever the workers' block size (a prompt shorter than that is its own lead)."""
        if self._lead is None:
            request = self.request
            tokens = (request.prompt_token_ids + request.resume_token_ids)[:LEAD_TOKENS]
            self._lead = prefix_block_hashes(request.cache_salt, tokens, len(tokens) or 1, 1)[0]
        return self._lead

    def hashes(self, block_size: int) -> list[bytes]:
        hashes = self.by_block_size.get(block_size)
        if hashes is None:
            request = self.request
            # A resumed request is recomputed from prompt + resumed tokens: those are its prefix.
            tokens = request.prompt_token_ids + request.resume_token_ids
            hashes = prefix_block_hashes(request.cache_salt, tokens, block_size)
            self.by_block_size[block_size] = hashes
        return hashes


class Router:
    """Ranks candidate workers by `routing.policy` (module docstring)."""

    def __init__(self, settings: RoutingSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock  # monotonic seconds (a replay of recorded arrivals passes its own)
        self._turn = itertools.count()
        self._recent = RecentWork()

    def rank(self, candidates: Sequence[WorkerLink], blocks: PromptBlocks, *, queued_ahead: int = 0) -> list[Decision]:
        """Every candidate, best first, each with why it ranks there. `queued_ahead`: prompt tokens
        the gateway holds that go before this request (its TTFT prediction, dispatch/ttft.py)."""
        ranked = self._rank_by_policy(candidates, blocks)
        target = blocks.request.ttft_target_s
        return ranked if target is None else self._prefer_in_time(ranked, blocks, target, queued_ahead)

    def _rank_by_policy(self, candidates: Sequence[WorkerLink], blocks: PromptBlocks) -> list[Decision]:
        policy = self.settings.policy
        if not candidates:
            return []
        if policy == "round_robin":
            start = next(self._turn) % len(candidates)
            ordered = sorted(candidates, key=lambda w: w.worker_id)
            ordered = ordered[start:] + ordered[:start]
            return [Decision(w, REASON_ROUND_ROBIN) for w in ordered]
        if policy == "least_loaded":  # no prompt hashing: today's cost exactly
            return [Decision(w, REASON_LEAST_LOADED) for w in sorted(candidates, key=lambda w: w.load)]
        return self._rank_by_cost(candidates, blocks)

    @staticmethod
    def _prefer_in_time(ranked: list[Decision], blocks: PromptBlocks, target_s: float,
                        queued_ahead: int) -> list[Decision]:
        """The policy's order, those predicted to meet `target_s` first (module docstring)."""
        request = blocks.request
        num_tokens = len(request.prompt_token_ids) + len(request.resume_token_ids)
        predicted: list[Decision] = []
        for decision in ranked:
            load = decision.worker.ttft_load
            if load is not None:
                seconds = predict_ttft(load, priority=request.priority, prompt_tokens=num_tokens,
                                       cached_tokens=decision.cached_tokens, queued_ahead=queued_ahead)
                decision = dataclasses.replace(decision, predicted_ttft_s=seconds)
            predicted.append(decision)

        def misses(d: Decision) -> bool:
            return d.predicted_ttft_s is not None and d.predicted_ttft_s > target_s

        reordered = sorted(predicted, key=misses)  # stable: the policy's order within each group
        if reordered and reordered[0] is not predicted[0]:
            reordered[0] = dataclasses.replace(reordered[0], reason=REASON_TTFT)
        return reordered

    def best_prediction(self, candidates: Sequence[WorkerLink], blocks: PromptBlocks, *,
                        queued_ahead: int = 0, sent_now: bool = True) -> float | None:
        """The lowest predicted TTFT of the request over `candidates` (None: none predictable):
        what admission compares with its target (gateway/generation/service.py); `sent_now` as
        in `predict_ttft`."""
        request = blocks.request
        num_tokens = len(request.prompt_token_ids) + len(request.resume_token_ids)
        best: float | None = None
        for worker in candidates:
            load = worker.ttft_load
            if load is None:
                return None  # a worker nothing is known about may serve it in time
            cached = cached_tokens(worker, blocks) if self.settings.policy == "cache_aware" else 0
            seconds = predict_ttft(load, priority=request.priority, prompt_tokens=num_tokens,
                                   cached_tokens=cached, queued_ahead=queued_ahead, sent_now=sent_now)
            best = seconds if best is None else min(best, seconds)
        return best

    def route(self, candidates: Sequence[WorkerLink], blocks: PromptBlocks) -> Decision | None:
        """The best candidate (room aside), or None when there is none."""
        ranked = self.rank(candidates, blocks)
        return ranked[0] if ranked else None

    def _rank_by_cost(self, candidates: Sequence[WorkerLink], blocks: PromptBlocks) -> list[Decision]:
        num_tokens = len(blocks.request.prompt_token_ids) + len(blocks.request.resume_token_ids)
        least_load = min(w.load for w in candidates)
        margin = self.settings.spread_margin
        now = self._clock()
        recent = {w.worker_id: self._recent.of_worker(w.worker_id, now) for w in candidates}
        mean_recent = sum(recent.values()) / len(candidates)
        over_share = mean_recent * (1.0 + self.settings.balance_margin)
        cached_on = [cached_tokens(w, blocks) for w in candidates]
        work_on = [request_work(blocks.request, num_tokens - cached) for cached in cached_on]
        # The two cheapest candidates for the request: for each worker, the cheapest other one is
        # what moving the request adds there.
        two_cheapest = heapq.nsmallest(2, range(len(candidates)), key=work_on.__getitem__)
        scored: list[tuple[bool, float, float, Decision]] = []
        for i, (worker, cached) in enumerate(zip(candidates, cached_on, strict=True)):
            cost = self._cost(worker, num_tokens, cached)
            sent = recent[worker.worker_id]
            other = next((j for j in two_cheapest if j != i), None)
            floor = math.inf if other is None else BALANCE_FLOOR * work_on[other]
            sent_past_share = (sent > over_share and sent - mean_recent > floor
                               and self._recent.of_lead(worker.worker_id, blocks.lead, now) >= HOT_LEAD_SHARE * sent)
            overloaded = worker.load > least_load + margin or sent_past_share
            scored.append((overloaded, cost, worker.load, Decision(worker, REASON_LOAD, cached, cost)))
        scored.sort(key=lambda s: (s[0], s[1], s[2]))
        first_over, cheapest = scored[0][0], scored[0][1]
        ties = next((i for i, s in enumerate(scored) if s[0] != first_over or s[1] > cheapest + TIE_TOKENS),
                    len(scored))
        if ties > 1:
            scored[:ties] = sorted(scored[:ties], key=lambda s: (recent[s[3].worker.worker_id], s[1]))
        best_cached = max(d.cached_tokens for *_, d in scored)
        ranked: list[Decision] = []
        for _, _, _, decision in scored:
            cached = decision.cached_tokens
            if cached and cached == best_cached:
                reason = REASON_CACHE
            elif any(over and d.cached_tokens > cached for over, *_, d in scored):
                reason = REASON_SPREAD  # a worker holding more of it is loaded or sent past its margin
            else:
                reason = REASON_LOAD
            ranked.append(Decision(decision.worker, reason, cached, decision.cost))
        return ranked

    def in_reach(self, ranking: list[Decision], held_since: float | None, now: float) -> list[Decision]:
        """The candidates a job may be sent to now, best first. Under cache_aware, while the
        first-ranked worker holds its prefix (it is within both guards, or it would not be first),
        those holding `LOCALITY_MIN_TOKENS` fewer of the prompt are left out until `LOCALITY_WAIT_S`
        after the job was first held back (`held_since`): a saturated cluster then waits for room
        where the prefix is cached instead of prefilling it again elsewhere, and the fair
        scheduler's next job, whose prefix the worker with room may hold, takes that room
        meanwhile. The job keeps its place in line (its tenant's counter does not move), so it is
        sent as soon as its worker has room."""
        if self.settings.policy != "cache_aware" or len(ranking) < 2 or ranking[0].reason != REASON_CACHE:
            return ranking
        if held_since is not None and now - held_since >= LOCALITY_WAIT_S:
            return ranking
        floor = ranking[0].cached_tokens - LOCALITY_MIN_TOKENS
        return [d for d in ranking if d.cached_tokens > floor]

    def _cost(self, worker: WorkerLink, num_tokens: int, cached_tokens: int) -> float:
        """Predicted cost in prefill tokens: what is not cached, plus the worker's pressure."""
        return (num_tokens - cached_tokens) + self.settings.load_cost_tokens * (worker.load + worker.kv_use)

    def note_sent(self, worker: WorkerLink, blocks: PromptBlocks) -> None:
        """The prompt went to `worker`: its index counts the blocks as coming (an engine's events
        confirm or evict them; an upstream's index has nothing else). Under cache_aware only: the
        other policies never hash a prompt."""
        if self.settings.policy != "cache_aware":
            return
        request = blocks.request
        num_tokens = len(request.prompt_token_ids) + len(request.resume_token_ids)
        work = request_work(request, num_tokens - cached_tokens(worker, blocks))
        self._recent.add(worker.worker_id, blocks.lead, work, self._clock())
        cache = worker.cache
        block_size = cache.block_size or self.settings.upstream_block_size
        cache.note_sent(block_size, blocks.hashes(block_size))


class RecentWork:
    """The work a router sent recently: per worker, and per worker and leading block (what is hot
    where), each request weighing half as much every `RECENT_HALF_LIFE_S`. One `add` moves both."""

    def __init__(self) -> None:
        self._by_worker: dict[str, tuple[float, float]] = {}  # worker id -> (decayed work, when)
        self._by_lead: dict[tuple[str, bytes], tuple[float, float]] = {}  # (worker id, lead) -> likewise

    def of_worker(self, worker_id: str, now: float) -> float:
        return _decayed(self._by_worker.get(worker_id), now)

    def of_lead(self, worker_id: str, lead: bytes, now: float) -> float:
        return _decayed(self._by_lead.get((worker_id, lead)), now)

    def add(self, worker_id: str, lead: bytes, work: float, now: float) -> None:
        self._by_worker[worker_id] = (self.of_worker(worker_id, now) + work, now)
        self._by_lead[worker_id, lead] = (self.of_lead(worker_id, lead, now) + work, now)
        if len(self._by_lead) > RECENT_LEADS_CAP:  # keep the hottest half
            by_heat = sorted(self._by_lead, key=lambda key: _decayed(self._by_lead[key], now))
            for stale in by_heat[:len(by_heat) // 2]:
                del self._by_lead[stale]


def _decayed(entry: tuple[float, float] | None, now: float) -> float:
    """A count noted at `entry[1]`, halved every `RECENT_HALF_LIFE_S` since."""
    if entry is None:
        return 0.0
    count, at = entry
    return count * math.exp2((at - now) / RECENT_HALF_LIFE_S)


def request_work(request: GenerateRequest, uncached_tokens: int) -> float:
    """What the request asks of a worker that must prefill `uncached_tokens` of its prompt, in decode
    tokens (`PREFILL_TOKEN_WORK`); a resumed request decodes only what is left of its budget."""
    decode = max(1, request.sampling.max_tokens - len(request.resume_token_ids))
    return decode + PREFILL_TOKEN_WORK * uncached_tokens


def cached_tokens(worker: WorkerLink, blocks: PromptBlocks) -> int:
    """The prompt tokens `worker`'s index says it holds (whole matched blocks)."""
    cache = worker.cache
    if not cache.block_size or not len(cache):
        return 0
    return cache.matched_blocks(blocks.hashes(cache.block_size)) * cache.block_size
