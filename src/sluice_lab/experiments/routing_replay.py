"""`sluice bench routing-replay`: a routing bench run's arrivals replayed through the product's
`Router` against modelled workers, in seconds rather than half an hour (issue #33).

Real: the router (policy, cost, both guards, its cache index fed by what it sent) and the arrivals
(each measured turn's time, tenant, conversation and prompt length, from a `sluice bench routing`
JSON). Modelled: the workers, as processor-sharing servers of work (`request_work`: `max_tokens`
plus `PREFILL_TOKEN_WORK` per prompt token not cached there), serving the run's measured work per
worker CPU second, with load = requests in flight / `max_num_seqs` and prefix caches that never
evict; and the prompts, rebuilt so that a turn extends its conversation's last one after its
tenant's context. Left out: heartbeat lag, KV events and eviction, the fair scheduler and the room
rule (every arrival is routed at once; none waits).

Reported per policy: each worker's share of the modelled work over the even share (the bench's
CPU share) and the prompt tokens prefilled. It compares settings quickly; the bench measures them.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from sluice.errors import CLIError
from sluice.gateway.dispatch.cache_index import CacheIndex
from sluice.gateway.dispatch.routing import PREFILL_TOKEN_WORK, PromptBlocks, Router, cached_tokens, request_work
from sluice.gateway.dispatch.ttft import WorkerLoad
from sluice.protocol import GenerateRequest, Priority, SamplingParams
from sluice.settings import RoutingSettings
from sluice.telemetry import percentile

POLICIES = ("least_loaded", "round_robin", "cache_aware")
BLOCK_SIZE = 16
BIG_PREFILL_TOKENS = 512  # a prefill this long is a context prefilled again, not a turn's tail
VOCAB = 49_000
CONTEXT = -1  # the Prompts stream of a tenant's context
WARM_CONVERSATION = -2  # the warm-up request's


@dataclass(slots=True)
class ModelWorker:
    """The fields routing reads of a worker, and the work it has left (processor sharing)."""

    worker_id: str
    max_num_seqs: int
    cache: CacheIndex = field(default_factory=lambda: CacheIndex(10_000_000))
    kv_use: float = 0.0
    ttft_load: WorkerLoad | None = None  # not predictable: no TTFT targets in the replay
    remaining: list[float] = field(default_factory=list)  # work left of each request in flight

    @property
    def load(self) -> float:
        return len(self.remaining) / self.max_num_seqs

    def serve(self, seconds: float, work_per_s: float) -> None:
        """`seconds` of serving, shared evenly by the requests in flight."""
        while self.remaining and seconds > 0:
            share = work_per_s / len(self.remaining)
            soonest = min(self.remaining)
            step = min(seconds, soonest / share)
            self.remaining = [left - step * share for left in self.remaining if left - step * share > 1e-9]
            seconds -= step


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds after the first measured arrival
    tenant: str
    conversation: int
    prompt_tokens: int
    context_tokens: int  # its tenant's context, which every conversation of the tenant starts with
    max_tokens: int
    measured: bool = True  # False: the warm-up request placing a tenant's context


def arrivals_of(result: dict[str, Any]) -> list[Arrival]:
    """A bench run's measured arrivals (the cache_aware arm's; every arm got the same times), each
    tenant's context placed first by one unmeasured request, as the bench's warm-up does."""
    turns = [t for t in result.get("turns", []) if t.get("policy") == "cache_aware" and t.get("phase") == "arrivals"]
    if not turns:
        raise CLIError("the result holds no measured cache_aware arrivals (is it a `sluice bench routing` JSON?)")
    start = min(t["arrival"] for t in turns)
    user_tokens = int(result.get("config", {}).get("user_tokens", 64))
    context = _context_lengths(turns, user_tokens)
    warm = [Arrival(-60.0 + i, tenant, WARM_CONVERSATION, n + user_tokens, n, 1, measured=False)
            for i, (tenant, n) in enumerate(sorted(context.items()))]
    measured = [Arrival(t["arrival"] - start, t["tenant"], int(t["conversation"]), int(t["prompt_tokens"]),
                        context[t["tenant"]], max(1, int(t["output_tokens"]))) for t in turns]
    return warm + sorted(measured, key=lambda a: a.at)


def _context_lengths(turns: list[dict[str, Any]], user_tokens: int) -> dict[str, int]:
    """Each tenant's context: its shortest prompt (a first turn) less the user's message."""
    shortest: dict[str, int] = {}
    for t in turns:
        shortest[t["tenant"]] = min(shortest.get(t["tenant"], t["prompt_tokens"]), t["prompt_tokens"])
    return {tenant: max(1, n - user_tokens) for tenant, n in shortest.items()}


def work_per_second(result: dict[str, Any]) -> float:
    """The run's work served per worker CPU second (every phase, every arm)."""
    turns = result.get("turns", [])
    cpu = float(result.get("worker_cpu_s") or 0.0)
    work = sum(t["output_tokens"] + PREFILL_TOKEN_WORK * (t["prompt_tokens"] - t["cached_tokens"]) for t in turns)
    if cpu <= 0 or work <= 0:
        raise CLIError("the result has no worker CPU seconds or served tokens to size the workers by")
    return work / cpu


class Prompts:
    """Token ids for each (tenant, conversation) so that a turn extends the previous one."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)
        self._streams: dict[tuple[str, int], list[int]] = {}

    def tokens(self, tenant: str, conversation: int, context: int, n: int) -> tuple[int, ...]:
        head = self._stream((tenant, CONTEXT), context)
        tail = self._stream((tenant, conversation), max(0, n - context))
        return tuple((head + tail)[:n])

    def _stream(self, key: tuple[str, int], n: int) -> list[int]:
        stream = self._streams.setdefault(key, [])
        while len(stream) < n:
            stream.append(self._random.randrange(1, VOCAB))
        return stream


def replay(arrivals: list[Arrival], *, policy: str, workers: int, max_num_seqs: int, work_per_s: float,
           seed: int = 0) -> dict[str, Any]:
    """One policy over the arrivals: where each went and what it cost (module docstring)."""
    clock = [arrivals[0].at]
    router = Router(RoutingSettings(policy=policy), clock=lambda: clock[0])  # type: ignore[arg-type]
    pool = [ModelWorker(f"w{i}", max_num_seqs) for i in range(workers)]
    prompts = Prompts(seed)
    work: dict[str, float] = {}
    sent: Counter[str] = Counter()
    hot: Counter[str] = Counter()
    prefilled: list[int] = []
    for arrival in arrivals:
        for worker in pool:
            worker.serve(arrival.at - clock[0], work_per_s)
        clock[0] = arrival.at
        tokens = prompts.tokens(arrival.tenant, arrival.conversation, arrival.context_tokens, arrival.prompt_tokens)
        request = GenerateRequest(request_id="r", tenant_id=arrival.tenant, model="m", priority=Priority.STANDARD,
                                  prompt_token_ids=tokens, sampling=SamplingParams(max_tokens=arrival.max_tokens),
                                  cache_salt=arrival.tenant, arrival_time=0.0)
        blocks = PromptBlocks(request)
        decision = router.route(pool, blocks)  # type: ignore[arg-type]
        assert decision is not None
        worker = cast(ModelWorker, decision.worker)  # one of the pool: routing ranks what it is given
        uncached = len(tokens) - cached_tokens(worker, blocks)  # type: ignore[arg-type]
        router.note_sent(worker, blocks)  # type: ignore[arg-type]
        if policy != "cache_aware":  # the router notes prompts only under cache_aware
            worker.cache.note_sent(BLOCK_SIZE, blocks.hashes(BLOCK_SIZE))
        units = request_work(request, uncached)
        worker.remaining.append(units)
        if arrival.measured:
            work[worker.worker_id] = work.get(worker.worker_id, 0.0) + units
            sent[worker.worker_id] += 1
            hot[worker.worker_id] += arrival.tenant == "hot"
            prefilled.append(uncached)
    total = sum(work.values()) or 1.0
    ids = [w.worker_id for w in pool]
    return {
        "policy": policy,
        "max_work_share_over_even": round(max(work.get(w, 0.0) for w in ids) / total * workers, 3),
        "requests_per_worker": {w: sent[w] for w in ids},
        "hot_requests_per_worker": {w: hot[w] for w in ids},
        "prefilled_tokens": sum(prefilled),
        "prefilled_p50": percentile([float(p) for p in prefilled], 50),
        "big_prefills": sum(p > BIG_PREFILL_TOKENS for p in prefilled),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("result", type=Path, help="a `sluice bench routing` JSON (its turns and CPU seconds)")
    parser.add_argument("--workers", type=int, default=None, help="workers to replay on (default: the run's)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="slots per worker (default: the run's)")
    parser.add_argument("--policy", action="append", choices=POLICIES, help="policies to replay (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="token ids of the rebuilt prompts")
    parser.add_argument("--json", dest="json_out", type=Path, default=None, help="write the summary here")


def run_replay_command(args: argparse.Namespace) -> int:
    try:
        result = json.loads(args.result.read_text())
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read {args.result}: {exc}") from exc
    if not isinstance(result, dict):
        raise CLIError(f"{args.result} is not a `sluice bench routing` JSON")
    try:
        config = result.get("config", {})
        workers = args.workers if args.workers is not None else int(config.get("workers", 2))
        slots = args.max_num_seqs if args.max_num_seqs is not None else int(config.get("max_num_seqs", 4))
        arrivals = arrivals_of(result)
        rate = work_per_second(result)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CLIError(f"{args.result} is not a `sluice bench routing` JSON: bad or missing {exc}") from exc
    if workers < 1 or slots < 1:
        raise CLIError("--workers and --max-num-seqs must be positive")
    rows = [replay(arrivals, policy=p, workers=workers, max_num_seqs=slots, work_per_s=rate, seed=args.seed)
            for p in (args.policy or POLICIES)]
    print(f"{args.result.name}: {sum(a.measured for a in arrivals)} arrivals on {workers} modelled workers "
          f"({rate:.1f} work/s each)")
    print(f"{'policy':<14} {'max share':>9} {'prefilled':>10} {'p50':>6} {'big':>4}  requests (hot)")
    for row in rows:
        hot = row["hot_requests_per_worker"]
        spread = " ".join(f"{w}:{n}({hot[w]})" for w, n in row["requests_per_worker"].items())
        print(f"{row['policy']:<14} {row['max_work_share_over_even']:>8.3f}x {row['prefilled_tokens']:>10} "
              f"{row['prefilled_p50']:>6.0f} {row['big_prefills']:>4}  {spread}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"bench": "routing-replay", "result": str(args.result),
                                             "workers": workers, "work_per_s": rate, "policies": rows}, indent=2))
    return 0
