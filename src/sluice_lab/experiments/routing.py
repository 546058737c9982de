"""`sluice bench routing`: least_loaded vs round_robin vs cache_aware routing, one run (issue #33).

Real worker processes (`sluice worker`, one torch thread each) serve one gateway dispatcher in this
process; requests are enqueued on the dispatcher directly (the fair scheduler, the room rule and
routing are the product's; HTTP and Kafka are left out: they do not change where a request goes).

The load: `--tenants` tenants, each with its own system context of 1-2K tokens, and one hot tenant
sending half of all requests. Each arrival (Poisson, `--rate` per second overall) either continues
one of its tenant's idle conversations (its prompt extends the previous turn: that turn's prompt, its
answer and a new user message) or starts a new one. The defaults are chat's lengths: 64-token user
messages and 128-token answers (the runs before 2026-12-06 13:35 used 32 and 16, which leave a
conversation's turns almost nothing to lose by going elsewhere: `--user-tokens 32 --output-tokens
16 --rate 0.8 --duration-s 120 --backlog-s 60` repeats them). Policies run in interleaved rounds on the same
workers; each round and policy has its own cache salts, so no arm is helped by another's cache.
Each arm starts with one uncounted request per tenant (`--warmup`, on by default), so it measures
the steady state of a long run (every tenant's context cached somewhere) rather than cold starts.

Then (`--backlog-s`, on by default) every tenant, the hot one included, keeps `--backlog-depth`
requests in flight for that long: the gateway's queue holds every tenant all the time, which is
where fair sharing decides and locality could bend it.

Reported per policy, over the arrivals: TTFT p50/p99, prefill tokens saved (cached prompt tokens),
output throughput, Jain's index of served / offered output tokens over the equally weighted
tenants, and each worker's share of the work two ways: prompt tokens computed + output tokens, and
the CPU seconds its process used (one thread each: its busy time, the closer measure: a decoded
token costs the engine far more than a prefilled one). Over the backlogged phase: Jain's index of
the tokens each tenant was served (prompt + output, what the fair scheduler charges) and the
output tokens per second (the cluster's capacity; over the arrivals, output throughput can only be
the offered load), each two ways: by the requests that ended inside the phase, whole, and pro
rata, each request's output counted as it was decoded inside the phase (`Arm.backlog_tokens`; the
pro-rata figures from 2026-12-06 17:20 on).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.errors import CLIError
from sluice.gateway.dispatch.dispatcher import Dispatcher
from sluice.gateway.dispatch.jobs import Job
from sluice.gateway.dispatch.routing import Router
from sluice.gateway.generation.state import RequestState
from sluice.protocol import GenerateRequest, Priority, RequestDelta, SamplingParams
from sluice.settings import DispatchSettings, GatewaySettings, ModelSpec, RoutingSettings, Settings
from sluice.telemetry import percentile

POLICIES = ("least_loaded", "round_robin", "cache_aware")
SECRET = "bench-routing-worker-secret-0123456789"
SRC = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class Turn:
    phase: str  # "arrivals" (Poisson) or "backlog" (every tenant keeps requests queued)
    tenant: str
    hot: bool
    conversation: int
    arrival: float
    prompt_tokens: int
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""
    route: str = ""
    error: str | None = None


@dataclass(slots=True, eq=False)
class Conversation:
    prompt: tuple[int, ...]  # what the next turn extends
    turns: int = 0
    busy: bool = False


@dataclass(slots=True)
class Arm:
    policy: str
    round: int
    turns: list[Turn] = field(default_factory=list)
    offered: dict[str, int] = field(default_factory=dict)  # output tokens asked per tenant
    backlog_window: tuple[float, float] | None = None  # (start, end) of the backlogged phase
    worker_cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per worker, this arm

    def backlog_tokens(self, turn: Turn, *, pro_rata: bool) -> tuple[float, float]:
        """(prompt, output) tokens a backlogged-phase request, without error, was served inside the
        window. Whole requests (`pro_rata=False`): all of both for a request that ended inside it.
        Pro rata: its prompt if its first token came inside the window, and the share of its output
        decoded inside it (first token to finish, evenly). With a few requests per tenant in the
        window, crediting each whole at its end swings a tenant's service by a request; pro rata
        measures the service given during the window."""
        if self.backlog_window is None or turn.phase != "backlog" or turn.error is not None or turn.finish is None:
            return 0.0, 0.0
        begin, end = self.backlog_window
        if not pro_rata:
            inside_whole = begin <= turn.finish <= end
            return (float(turn.prompt_tokens), float(turn.output_tokens)) if inside_whole else (0.0, 0.0)
        if turn.first_token is None:
            return 0.0, 0.0
        prompt = float(turn.prompt_tokens) if begin <= turn.first_token <= end else 0.0
        inside = min(turn.finish, end) - max(turn.first_token, begin)
        decoding = turn.finish - turn.first_token
        output = turn.output_tokens * inside / decoding if inside > 0 and decoding > 0 else 0.0
        return prompt, output


def _spawn_workers(args: argparse.Namespace, port: int, logdir: Path) -> list[subprocess.Popen[bytes]]:
    processes = []
    for i in range(args.workers):
        log = open(logdir / f"worker-{i}.log", "wb")  # noqa: SIM115
        env = dict(os.environ, OMP_NUM_THREADS="1", SLUICE_GATEWAY_WORKER_SECRET=SECRET,
                   PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, "-m", "sluice.cli", "worker", "--model", str(args.model), "--served-model-name", "m",
               "--gateway", f"127.0.0.1:{port}", "--worker-id", f"w{i}", "--heartbeat-interval", "0.5",
               "--max-num-seqs", str(args.max_num_seqs), *args.worker_arg]
        processes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    return processes


async def _run_arm(dispatcher: Dispatcher, arm: Arm, args: argparse.Namespace, contexts: dict[str, tuple[int, ...]],
                   seed: int, worker_cpu: Callable[[], dict[str, float]]) -> None:
    # Two streams: the arrivals (times, tenants) are the same for every policy of a round; the
    # content choices (continue which conversation, the user's tokens) may differ with timing.
    arrivals, rng = random.Random(seed), random.Random(seed + 1)
    dispatcher.router = Router(RoutingSettings(policy=arm.policy))  # type: ignore[arg-type]
    tenants = list(contexts)
    hot = tenants[0]
    conversations: dict[str, list[Conversation]] = {t: [] for t in tenants}
    done = asyncio.Event()
    pending = 0
    salt_of = {t: f"{t}/{arm.policy}/{arm.round}" for t in tenants}
    start = time.time()
    ids = 0

    backlog_until = 0.0

    def submit(tenant: str, phase: str = "arrivals", measured: bool = True) -> None:
        nonlocal pending, ids
        convs = conversations[tenant]
        idle = [c for c in convs if not c.busy and c.turns < args.max_turns]
        user = tuple(rng.randrange(*args.token_range) for _ in range(args.user_tokens))
        if idle and rng.random() < args.continue_prob:
            conv = rng.choice(idle)
        else:
            conv = Conversation(prompt=contexts[tenant])
            convs.append(conv)
        conv.busy = True
        prompt = conv.prompt + user
        ids += 1
        request = GenerateRequest(
            request_id=f"{arm.policy}-{arm.round}-{ids}", tenant_id=tenant, model="m", priority=Priority.STANDARD,
            prompt_token_ids=prompt, cache_salt=salt_of[tenant], arrival_time=time.time(),
            sampling=SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True))
        turn = Turn(phase=phase, tenant=tenant, hot=tenant == hot,
                    conversation=next(i for i, c in enumerate(convs) if c is conv),
                    arrival=request.arrival_time, prompt_tokens=len(prompt))
        if measured:
            arm.turns.append(turn)
        if measured and phase == "arrivals":
            arm.offered[tenant] = arm.offered.get(tenant, 0) + args.output_tokens
        state = RequestState.of(request, "default")
        output: list[int] = []
        pending += 1

        def sink(delta: RequestDelta) -> None:
            nonlocal pending
            if delta.token_ids and turn.first_token is None:
                turn.first_token = time.time()
            output.extend(delta.token_ids)
            if delta.finish_reason is None:
                return
            turn.finish, turn.output_tokens = time.time(), len(output)
            turn.cached_tokens, turn.worker, turn.route = state.cached_tokens, state.worker, state.route
            turn.error = delta.error
            conv.prompt, conv.busy = prompt + tuple(output), False
            conv.turns += 1
            pending -= 1
            if phase == "backlog" and time.time() < backlog_until:
                submit(tenant, "backlog")  # closed loop: the tenant stays backlogged
            elif pending == 0:
                done.set()

        dispatcher.enqueue(Job(state=state, sink=sink))

    if args.warmup:
        # Steady state: each tenant's context is cached somewhere (placed by this arm's policy)
        # before the measured arrivals; these requests are not counted.
        warm = [(tenant, conversations[tenant]) for tenant in tenants]
        for tenant, _ in warm:
            submit(tenant, measured=False)
        if pending:
            done.clear()
            await asyncio.wait_for(done.wait(), args.drain_timeout_s)
        for _, convs in warm:
            convs.clear()
        start = time.time()
    cpu_before = worker_cpu()
    while time.time() - start < args.duration_s:
        await asyncio.sleep(arrivals.expovariate(args.rate))
        tenant = hot if arrivals.random() < 0.5 else arrivals.choice(tenants[1:])
        submit(tenant)
    if pending:
        done.clear()
        await asyncio.wait_for(done.wait(), args.drain_timeout_s)
    arm.worker_cpu_s = {w: cpu - cpu_before.get(w, 0.0) for w, cpu in worker_cpu().items()}
    if args.backlog_s > 0:
        # Fairness: every tenant, equally weighted, keeps --backlog-depth requests in flight (a new
        # turn as soon as one ends), so the gateway's queue always holds every tenant.
        begin = time.time()
        backlog_until = begin + args.backlog_s
        done.clear()
        for _ in range(args.backlog_depth):
            for tenant in tenants:
                submit(tenant, "backlog")
        await asyncio.sleep(args.backlog_s)
        arm.backlog_window = (begin, backlog_until)
        if pending:
            await asyncio.wait_for(done.wait(), args.drain_timeout_s)


def jain(values: list[float]) -> float | None:
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def _arrivals_span(arm: Arm) -> float:
    """Seconds from the arm's first arrival to the last finish of its arrivals phase (the
    backlogged phase after it has its own window)."""
    turns = [t for t in arm.turns if t.phase == "arrivals"]
    finishes = [t.finish for t in turns if t.finish]
    return max(finishes) - min(t.arrival for t in turns) if finishes else 0.0


def _backlog_output_rate(arms: list[Arm], *, pro_rata: bool) -> float | None:
    """Output tokens per second of the backlogged phases (`Arm.backlog_tokens`): the cluster's
    throughput when every tenant is backlogged, its capacity. Over the arrivals it can only be
    the offered load."""
    tokens, seconds = 0.0, 0.0
    for arm in arms:
        if arm.backlog_window is None:
            continue
        begin, end = arm.backlog_window
        seconds += end - begin
        tokens += sum(arm.backlog_tokens(t, pro_rata=pro_rata)[1] for t in arm.turns)
    return tokens / seconds if seconds else None


def _backlog_service(arms: list[Arm], *, pro_rata: bool) -> dict[str, float]:
    """Tokens served per tenant (prompt + output, what the fair scheduler charges) inside the
    backlogged phases' windows (`Arm.backlog_tokens`); every tenant of the phase is listed."""
    service: dict[str, float] = {}
    for arm in arms:
        if arm.backlog_window is None:
            continue
        for t in arm.turns:
            if t.phase == "backlog":
                service[t.tenant] = service.get(t.tenant, 0.0) + sum(arm.backlog_tokens(t, pro_rata=pro_rata))
    return {tenant: round(n, 1) for tenant, n in service.items()}


def summarise(arms: list[Arm], workers: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in POLICIES:
        mine = [a for a in arms if a.policy == policy]
        if not mine:
            continue
        turns = [t for a in mine for t in a.turns
                 if t.phase == "arrivals" and t.error is None and t.finish is not None]
        ttfts = [t.first_token - t.arrival for t in turns if t.first_token is not None]
        span = sum(_arrivals_span(a) for a in mine)
        output = sum(t.output_tokens for t in turns)
        prompt = sum(t.prompt_tokens for t in turns)
        saved = sum(t.cached_tokens for t in turns)
        served: dict[str, int] = {}
        offered: dict[str, int] = {}
        for a in mine:
            for tenant, n in a.offered.items():
                offered[tenant] = offered.get(tenant, 0) + n
        for t in turns:
            served[t.tenant] = served.get(t.tenant, 0) + t.output_tokens
        hot = {t.tenant for t in turns if t.hot}
        normal = [served.get(t, 0) / offered[t] for t in offered if t not in hot]
        work = {w: 0 for w in workers}
        for t in turns:
            work[t.worker] = work.get(t.worker, 0) + (t.prompt_tokens - t.cached_tokens) + t.output_tokens
        total_work = sum(work.values()) or 1
        routes: dict[str, int] = {}
        for t in turns:
            routes[t.route] = routes.get(t.route, 0) + 1
        cpu = {w: sum(a.worker_cpu_s.get(w, 0.0) for a in mine) for w in workers}
        total_cpu = sum(cpu.values()) or 1.0
        backlogged = _backlog_service(mine, pro_rata=False)
        backlogged_pro_rata = _backlog_service(mine, pro_rata=True)
        out[policy] = {
            "requests": len(turns), "errors": sum(1 for a in mine for t in a.turns if t.error),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "hot_ttft_p50_s": percentile([t.first_token - t.arrival for t in turns if t.hot and t.first_token], 50),
            "prompt_tokens": prompt, "prefill_tokens_saved": saved,
            "cache_hit_rate": saved / prompt if prompt else None,
            "output_tokens": output, "output_tokens_per_s": output / span if span else None,
            "jain_served_over_offered": jain(normal),
            "worker_share": {w: round(n / total_work, 4) for w, n in sorted(work.items())},
            "max_share_over_even": max(work.values()) / total_work * len(workers),
            "worker_cpu_share": {w: round(c / total_cpu, 4) for w, c in sorted(cpu.items())},
            "max_cpu_share_over_even": max(cpu.values()) / total_cpu * len(workers),
            "routes": routes,
            "backlog_requests": sum(1 for a in mine for t in a.turns if t.phase == "backlog" and t.finish),
            "backlog_output_tokens_per_s": _backlog_output_rate(mine, pro_rata=False),
            "backlog_service_by_tenant": backlogged,
            "jain_backlogged": jain(list(backlogged.values())),
            "backlog_output_tokens_per_s_pro_rata": _backlog_output_rate(mine, pro_rata=True),
            "backlog_service_pro_rata_by_tenant": backlogged_pro_rata,
            "jain_backlogged_pro_rata": jain(list(backlogged_pro_rata.values())),
        }
    base, cache = out.get("least_loaded"), out.get("cache_aware")
    if base and cache:
        def ratio(key: str) -> float | None:
            a, b = base[key], cache[key]
            return a / b if a and b else None

        def gain(key: str) -> float | None:
            a, b = base[key], cache[key]
            return b / a if a and b else None

        out["cache_aware_vs_least_loaded"] = {
            "ttft_p50_ratio": ratio("ttft_p50_s"), "ttft_p99_ratio": ratio("ttft_p99_s"),
            "throughput_ratio": gain("output_tokens_per_s"),
            "backlog_throughput_ratio": gain("backlog_output_tokens_per_s"),
            "backlog_throughput_pro_rata_ratio": gain("backlog_output_tokens_per_s_pro_rata"),
        }
    return out


async def run_routing(args: argparse.Namespace) -> dict[str, Any]:
    import json

    rng = random.Random(args.seed)
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    args.token_range = (min(1000, vocab // 4), vocab)  # ordinary tokens, away from the special ones
    contexts = {}
    for i in range(args.tenants + 1):
        length = rng.randint(args.context_min, args.context_max)
        contexts[f"tenant-{i:02d}" if i else "hot"] = tuple(rng.randrange(*args.token_range) for _ in range(length))
    settings = Settings(gateway=GatewaySettings(worker_port=0, worker_secret=SECRET),
                        dispatch=DispatchSettings(max_worker_waiting=2, heartbeat_interval_s=0.5,
                                                  heartbeat_timeout_s=30.0, local_workers=0),
                        models=(ModelSpec(name="m", path=str(args.model)),))
    dispatcher = Dispatcher(settings, lambda job, delta: None)
    await dispatcher.start("127.0.0.1", 0)
    logdir = Path(args.logs)
    logdir.mkdir(parents=True, exist_ok=True)
    processes = _spawn_workers(args, dispatcher.port, logdir)
    try:
        deadline = time.monotonic() + 300
        while len(dispatcher.workers) < args.workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                raise CLIError(f"the workers did not register; see {logdir}")
            await asyncio.sleep(0.2)
        workers = sorted(dispatcher.workers)
        arms: list[Arm] = []
        cpu_before = _children_cpu(processes)
        for rnd in range(args.rounds):
            order = POLICIES[rnd % 3:] + POLICIES[:rnd % 3]  # interleaved: each policy leads a round in turn
            for policy in order:
                arm = Arm(policy, rnd)
                print(f"round {rnd + 1}/{args.rounds}: {policy} ...", flush=True)
                await _run_arm(dispatcher, arm, args, contexts, args.seed * 1000 + rnd,
                               lambda: {f"w{i}": _children_cpu([p]) for i, p in enumerate(processes)})
                arms.append(arm)
        cpu = _children_cpu(processes) - cpu_before
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        await dispatcher.stop()
    summary = summarise(arms, workers)
    total_output = sum(t.output_tokens for a in arms for t in a.turns)
    return {
        "bench": "routing", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, shared with other jobs",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "handler"},
        "summary": summary,
        "worker_cpu_s": cpu, "output_tokens_per_worker_cpu_s": total_output / cpu if cpu else None,
        "turns": [{"policy": a.policy, "round": a.round, **{k: getattr(t, k) for k in Turn.__slots__}}
                  for a in arms for t in a.turns],
    }


def _children_cpu(processes: list[subprocess.Popen[bytes]]) -> float:
    """CPU seconds (user + system) the worker processes used so far, from /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for p in processes:
        try:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def plot(result: dict[str, Any], path: str) -> None:
    from sluice_lab.experiments.plots import new_figure, save

    summary = result["summary"]
    policies = [p for p in POLICIES if p in summary]
    fig, axes = new_figure(1, 3, (14, 4))
    for policy in policies:
        ttfts = sorted(t["first_token"] - t["arrival"] for t in result["turns"]
                       if t["policy"] == policy and t["phase"] == "arrivals" and t["first_token"] is not None)
        if ttfts:
            axes[0].plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=policy)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("TTFT (s)")
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend()
    axes[1].bar(policies, [summary[p]["prefill_tokens_saved"] for p in policies])
    axes[1].set_title("prefill tokens saved")
    workers = sorted({w for p in policies for w in summary[p]["worker_share"]})
    width = 0.8 / max(1, len(workers))
    for i, worker in enumerate(workers):
        axes[2].bar([j + i * width for j in range(len(policies))],
                    [summary[p]["worker_share"].get(worker, 0) for p in policies], width, label=worker)
    axes[2].set_xticks([j + width * (len(workers) - 1) / 2 for j in range(len(policies))], policies)
    axes[2].set_title("share of the work per worker")
    axes[2].legend()
    save(fig, path)


def run_routing_command(args: argparse.Namespace) -> int:
    import json

    from sluice_lab.experiments.common import resolve_model

    args.model = resolve_model(args.model)
    if args.workers < 2:
        raise CLIError("--workers must be at least 2 (routing chooses between workers)")
    if args.rate <= 0 or args.duration_s <= 0:
        raise CLIError("--rate and --duration-s must be positive")
    if args.backlog_s < 0 or args.backlog_depth < 1:
        raise CLIError("--backlog-s must be 0 or more and --backlog-depth at least 1")
    if not 1 <= args.context_min <= args.context_max:
        raise CLIError("--context-min must be at least 1 and at most --context-max")
    result = asyncio.run(run_routing(args))
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    plot(result, args.plot)
    for policy, row in result["summary"].items():
        print(policy, json.dumps({k: v for k, v in row.items() if k != "routes"}))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the demo model; the issue's runs: SmolLM2)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (one torch thread each)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=20, help="equally weighted tenants (plus one hot tenant)")
    parser.add_argument("--context-min", type=int, default=1024, help="shortest system context, tokens")
    parser.add_argument("--context-max", type=int, default=2048, help="longest system context, tokens")
    parser.add_argument("--user-tokens", type=int, default=64, help="tokens of each new user message")
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens of each answer (ignore_eos)")
    parser.add_argument("--max-turns", type=int, default=4, help="turns of a conversation")
    parser.add_argument("--continue-prob", type=float, default=0.7,
                        help="chance an arrival continues an idle conversation of its tenant")
    parser.add_argument("--rate", type=float, default=0.4, help="requests per second (Poisson), all tenants")
    parser.add_argument("--duration-s", type=float, default=180.0, help="arrival window per policy and round")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the three policies")
    parser.add_argument("--backlog-s", type=float, default=90.0,
                        help="after each arm's arrivals, seconds during which every tenant keeps "
                             "--backlog-depth requests in flight (Jain's index of backlogged tenants); 0 = off")
    parser.add_argument("--backlog-depth", type=int, default=2, help="requests each backlogged tenant keeps in flight")
    parser.add_argument("--drain-timeout-s", type=float, default=600.0)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="before each arm's arrivals, one uncounted request per tenant (its context "
                             "cached somewhere, placed by the arm's policy): the steady state of a long run")
    parser.add_argument("--worker-arg", action="append", default=[], help="extra `sluice worker` argument")
    parser.add_argument("--logs", default="routing-logs", help="worker logs directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", default="routing.json", help="JSON path")
    parser.add_argument("--plot", default="routing.png", help="PNG plot path")
