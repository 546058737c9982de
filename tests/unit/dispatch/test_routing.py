"""Routing's ranking of candidate workers: policies, predicted cost and the hot-prefix guard (torch-free).

The candidates here are plain records with the fields routing reads (load, KV use, cache index);
the real links are exercised by tests/integration/dispatch/test_routing_workers.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import pytest

from sluice.gateway.dispatch.cache_index import CacheIndex
from sluice.gateway.dispatch.routing import (
    LOCALITY_WAIT_S,
    REASON_CACHE,
    REASON_LEAST_LOADED,
    REASON_LOAD,
    REASON_ROUND_ROBIN,
    REASON_SPREAD,
    REASON_TTFT,
    PromptBlocks,
    Router,
)
from sluice.gateway.dispatch.ttft import WorkerLoad
from sluice.prefix_hash import prefix_block_hashes
from sluice.protocol import GenerateRequest, KvEvents, Priority, SamplingParams
from sluice.settings import RoutingSettings

pytestmark = pytest.mark.unit

PROMPT = tuple(range(1, 1601))  # 100 blocks of 16


@dataclass
class Candidate:
    worker_id: str
    load: float = 0.0
    kv_use: float = 0.0
    cache: CacheIndex = field(default_factory=lambda: CacheIndex(10_000))
    ttft_load: WorkerLoad | None = None  # not predictable unless a test gives one


def request(salt: str = "tenant-a", prompt: tuple[int, ...] = PROMPT, max_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(request_id="r", tenant_id=salt, model="m", priority=Priority.STANDARD,
                           prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens), cache_salt=salt,
                           arrival_time=time.time())


def holding(worker: Candidate, salt: str, tokens: tuple[int, ...], block_size: int = 16) -> Candidate:
    worker.cache.apply(KvEvents(block_size=block_size, stored=tuple(prefix_block_hashes(salt, tokens, block_size))))
    return worker


def router(policy: str = "cache_aware", **kw: object) -> Router:
    return Router(RoutingSettings(policy=policy, **kw))  # type: ignore[arg-type]


def test_cache_aware_sends_a_request_to_the_worker_holding_its_prefix() -> None:
    idle, warm = Candidate("idle"), holding(Candidate("warm", load=0.25), "tenant-a", PROMPT[:1201])
    decision = router().route([idle, warm], PromptBlocks(request()))
    assert decision is not None
    assert decision.worker is warm and decision.reason == REASON_CACHE
    assert decision.cached_tokens == 1200


def test_another_tenants_identical_prompt_is_not_a_hit() -> None:
    idle, warm = Candidate("idle"), holding(Candidate("warm", load=0.25), "tenant-b", PROMPT)
    decision = router().route([idle, warm], PromptBlocks(request("tenant-a")))
    assert decision is not None
    assert decision.worker is idle and decision.reason == REASON_LOAD and decision.cached_tokens == 0


def test_a_hot_prefix_spreads_once_its_worker_is_loaded_past_the_margin() -> None:
    idle = Candidate("idle", load=0.1)
    hot = holding(Candidate("hot", load=0.7), "tenant-a", PROMPT)
    ranked = router(spread_margin=0.5).rank([hot, idle], PromptBlocks(request()))
    assert [d.worker for d in ranked] == [idle, hot]
    assert ranked[0].reason == REASON_SPREAD
    # Within the margin the cache wins.
    hot.load = 0.5
    assert router(spread_margin=0.5).route([hot, idle], PromptBlocks(request())).worker is hot  # type: ignore[union-attr]


def test_cost_weighs_uncached_tokens_against_load() -> None:
    # 400 cached tokens do not pay for a full worker (load 1.0 = 2048 tokens) when the margin allows it.
    partial = holding(Candidate("partial", load=0.4), "tenant-a", PROMPT[:400])
    idle = Candidate("idle")
    decision = router(spread_margin=1.0, load_cost_tokens=2048).route([partial, idle], PromptBlocks(request()))
    assert decision is not None and decision.worker is idle


def test_ties_go_to_the_worker_sent_the_fewest_requests_recently() -> None:
    """On a quiet cluster every load reads 0: a hot prefix held by both workers alternates between
    them rather than piling onto the first; a conversation's longer cached tail still wins."""
    a = holding(Candidate("a"), "tenant-a", PROMPT[:1600])
    b = holding(Candidate("b"), "tenant-a", PROMPT[:1600])
    routing = router()
    chosen = []
    for _ in range(4):
        blocks = PromptBlocks(request())
        decision = routing.route([a, b], blocks)
        assert decision is not None and decision.reason == REASON_CACHE
        routing.note_sent(decision.worker, blocks)
        chosen.append(decision.worker.worker_id)
    assert chosen == ["a", "b", "a", "b"]
    longer = (*PROMPT, *range(5000, 5048))  # the next turn: 48 more tokens, cached on b only
    holding(b, "tenant-a", longer)
    blocks = PromptBlocks(request(prompt=(*longer, 7)))
    decision = routing.route([a, b], blocks)
    assert decision is not None and decision.worker is b


def test_a_worker_sent_past_its_share_is_passed_over_while_loads_read_zero() -> None:
    """The balance guard: a hot prefix held by one worker stays there until that worker was sent
    more than (1 + balance_margin) times the mean of recent work, and more than BALANCE_FLOOR times
    the work the request would ask of the other worker over it; then it spreads."""
    hot, other = holding(Candidate("hot"), "tenant-a", PROMPT), Candidate("other")
    routing = router(balance_margin=0.2)
    # A cached turn is 16 + 16/12 = 17.3 work; other would prefill all 1600: 16 + 1600/12 = 149.3,
    # so hot is passed over once it is more than half that (74.7) past the mean.
    for _ in range(9):  # 8 sent at the last: 69.3 past the mean
        blocks = PromptBlocks(request())
        decision = routing.route([hot, other], blocks)
        assert decision is not None and decision.worker is hot and decision.reason == REASON_CACHE
        routing.note_sent(hot, blocks)
    decision = routing.route([hot, other], PromptBlocks(request()))  # 9 sent: 78 past the mean
    assert decision is not None and decision.worker is other and decision.reason == REASON_SPREAD
    many = router(balance_margin=100.0)  # a margin nothing reaches: the cache always wins
    for _ in range(20):
        many.note_sent(hot, PromptBlocks(request()))
    assert many.route([hot, other], PromptBlocks(request())).worker is hot  # type: ignore[union-attr]


def test_the_guard_weighs_requests_by_the_work_they_ask() -> None:
    """Recent work, not requests: one long answer outweighs two short ones, a cold prompt (prefilled
    whole) outweighs a cached one, and a request moves only where it narrows the gap."""
    a = holding(Candidate("a"), "tenant-a", PROMPT)
    b = holding(Candidate("b"), "tenant-a", PROMPT)
    routing = router()
    routing.note_sent(a, PromptBlocks(request(max_tokens=512)))
    for _ in range(2):
        routing.note_sent(b, PromptBlocks(request()))  # max_tokens 16 each, cached: 32 in all
    tie = routing.route([a, b], PromptBlocks(request()))
    assert tie is not None and tie.worker is b  # the tie goes to the worker sent less work
    cold, warm = Candidate("cold"), holding(Candidate("warm"), "tenant-a", PROMPT)
    weighed = router()
    weighed.note_sent(cold, PromptBlocks(request()))  # 1600 tokens to prefill: 16 + 1600/12
    for _ in range(3):
        weighed.note_sent(warm, PromptBlocks(request()))  # cached: 16 each
    assert weighed.route([cold, warm], PromptBlocks(request())).worker is warm  # type: ignore[union-attr]
    share = router()
    hot = holding(Candidate("hot"), "tenant-a", PROMPT)
    for _ in range(5):
        share.note_sent(hot, PromptBlocks(request()))  # 86.7 in all: 43.3 past the mean of two
    # Moved to a worker that must prefill all of it (149.3), it would turn the gap round: it stays;
    # to one holding half of it (16 + 800/12 = 82.7), it narrows the gap: it moves.
    far = share.route([hot, Candidate("cold")], PromptBlocks(request()))
    assert far is not None and far.worker is hot and far.reason == REASON_CACHE
    half = holding(Candidate("half"), "tenant-a", PROMPT[:800])
    near = share.route([hot, half], PromptBlocks(request()))
    assert near is not None and near.worker is half and near.reason == REASON_SPREAD


def test_the_share_guard_moves_the_hot_prefix_not_a_cold_tenants_context() -> None:
    """Past its share, a worker is passed over only for requests whose leading block is hot there
    (HOT_LEAD_SHARE of its recent work): a cold tenant whose context only that worker holds
    stays, and is not prefilled again elsewhere."""
    home = holding(holding(Candidate("home"), "hot", PROMPT), "cold", PROMPT)
    other = Candidate("other")
    routing = router(balance_margin=0.2)
    for _ in range(12):
        routing.note_sent(home, PromptBlocks(request("hot")))
    routing.note_sent(home, PromptBlocks(request("cold")))
    cold = routing.route([home, other], PromptBlocks(request("cold")))  # 1 of 13 recent: not hot
    assert cold is not None and cold.worker is home and cold.reason == REASON_CACHE
    hot = routing.route([home, other], PromptBlocks(request("hot")))  # 12 of 13: hot, it moves
    assert hot is not None and hot.worker is other and hot.reason == REASON_SPREAD


def test_a_job_waits_for_room_where_its_prefix_is_for_a_bounded_time() -> None:
    """Router.in_reach: under cache_aware the workers holding far less of the prompt are out of
    reach until LOCALITY_WAIT_S after the job was first held back; the other policies, and a job
    whose first choice holds nothing, reach every candidate."""
    home = holding(Candidate("home", load=1.0), "tenant-a", PROMPT)
    near = holding(Candidate("near", load=1.0), "tenant-a", PROMPT[:1500])  # 100 tokens fewer: in reach
    cold = Candidate("cold", load=0.75)
    routing = router(load_cost_tokens=0)
    ranking = routing.rank([cold, near, home], PromptBlocks(request()))
    assert [d.worker for d in ranking] == [home, near, cold]
    assert [d.worker for d in routing.in_reach(ranking, None, 100.0)] == [home, near]
    assert [d.worker for d in routing.in_reach(ranking, 99.0, 100.0)] == [home, near]
    assert routing.in_reach(ranking, 100.0 - LOCALITY_WAIT_S, 100.0) == ranking  # waited long enough
    plain = router("least_loaded").rank([cold, home], PromptBlocks(request()))
    assert router("least_loaded").in_reach(plain, None, 100.0) == plain
    stranger = routing.rank([cold, home], PromptBlocks(request("tenant-b")))
    assert routing.in_reach(stranger, None, 100.0) == stranger


def test_least_loaded_and_round_robin() -> None:
    a, b = Candidate("a", load=0.5), Candidate("b", load=0.1)
    blocks = PromptBlocks(request())
    ranked = router("least_loaded").rank([a, b], blocks)
    assert [d.worker for d in ranked] == [b, a] and ranked[0].reason == REASON_LEAST_LOADED
    router("least_loaded").note_sent(b, blocks)
    assert not blocks.by_block_size and len(b.cache) == 0  # least_loaded never hashes a prompt
    rr = router("round_robin")
    firsts = [rr.route([a, b], PromptBlocks(request())).worker.worker_id for _ in range(4)]  # type: ignore[union-attr]
    assert firsts == ["a", "b", "a", "b"]
    assert rr.route([a, b], PromptBlocks(request())).reason == REASON_ROUND_ROBIN  # type: ignore[union-attr]


def test_a_sent_prompt_counts_as_cached_until_the_events_say_otherwise() -> None:
    r = router()
    a, b = Candidate("a"), Candidate("b")
    blocks = PromptBlocks(request())
    first = r.route([a, b], blocks)
    assert first is not None
    r.note_sent(first.worker, blocks)
    again = r.route([a, b], PromptBlocks(request()))
    assert again is not None and again.worker is first.worker and again.reason == REASON_CACHE


def test_the_gateway_hashes_as_the_engine_does() -> None:
    """The engine's block manager and the gateway share one function (sluice/prefix_hash.py)."""
    from sluice.workers.block_manager import BlockManager
    from sluice.workers.request import Request

    manager = BlockManager(num_blocks=64, block_size=16)
    manager.record_events = True
    engine_request = Request("e", list(PROMPT[:100]), SamplingParams(), cache_salt="tenant-a",
                             arrival_time=time.time())
    assert manager.allocate(engine_request, 100)
    engine_request.num_computed_tokens = 100
    manager.cache_computed_blocks(engine_request)
    stored, evicted, cleared = manager.take_events()
    assert stored == prefix_block_hashes("tenant-a", PROMPT[:100], 16, 6) and not evicted and not cleared
    assert manager.take_events() == ([], [], False)  # handed over once


# ---- predicted TTFT (dispatch/ttft.py) ----------------------------------------------------------

# 10 ms per step and 0.1 s per 1000 prefill tokens, steps of 2048 tokens.
COST = (0.010, 0.1, 0.0, 0.0, 0.0, 0.0)


def backlogged(tokens: int) -> WorkerLoad:
    return WorkerLoad(step_cost=COST, prefill_backlog=(0, tokens, 0), decode_rows=0, step_tokens=2048)


def with_target(target_s: float | None) -> GenerateRequest:
    return msgspec.structs.replace(request(), ttft_target_s=target_s)


def test_a_worker_predicted_to_meet_the_ttft_target_goes_before_the_cache_hit() -> None:
    # The warm worker holds the prompt but has 20k tokens to prefill first: ~1.1 s; the idle one ~0.17 s.
    warm = holding(Candidate("warm", ttft_load=backlogged(20_000)), "tenant-a", PROMPT)
    idle = Candidate("idle", load=0.25, ttft_load=backlogged(0))
    ranked = router().rank([warm, idle], PromptBlocks(with_target(0.5)))
    assert [d.worker for d in ranked] == [idle, warm]
    assert ranked[0].reason == REASON_TTFT
    assert ranked[0].predicted_ttft_s == pytest.approx(0.17)
    assert ranked[1].predicted_ttft_s is not None and ranked[1].predicted_ttft_s > 0.5
    # A looser target both meet: the cache-aware order stands.
    ranked = router().rank([warm, idle], PromptBlocks(with_target(5.0)))
    assert [d.worker for d in ranked] == [warm, idle] and ranked[0].reason == REASON_CACHE
    # No target: no prediction at all.
    ranked = router().rank([warm, idle], PromptBlocks(with_target(None)))
    assert ranked[0].worker is warm and ranked[0].predicted_ttft_s is None


def test_ttft_preference_applies_under_least_loaded_too_and_unknown_workers_count_as_in_time() -> None:
    busy = Candidate("busy", load=0.1, ttft_load=backlogged(50_000))
    unknown = Candidate("upstream", load=0.9)  # no step cost reported
    ranked = router("least_loaded").rank([busy, unknown], PromptBlocks(with_target(1.0)))
    assert [d.worker for d in ranked] == [unknown, busy] and ranked[0].reason == REASON_TTFT
    assert ranked[0].predicted_ttft_s is None


def test_best_prediction_is_the_lowest_and_none_when_a_worker_is_unknown() -> None:
    near, far = Candidate("near", ttft_load=backlogged(0)), Candidate("far", ttft_load=backlogged(20_000))
    blocks = PromptBlocks(with_target(0.5))
    assert router().best_prediction([near, far], blocks) == pytest.approx(0.17)
    # The gateway's queue ahead of it (spread over the workers) counts.
    assert router().best_prediction([near, far], blocks, queued_ahead=2048) == pytest.approx(0.3848)
    assert router().best_prediction([near, Candidate("upstream")], blocks) is None
    assert router().best_prediction([], blocks) is None
