"""`sluice bench chaos` (issue #16): mixed load on a cluster while replicas and workers are SIGKILLed.

On a running `sluice_lab.experiments.cluster.Cluster` (the scale-out tests' and benches' launcher):

1. an undisturbed greedy reference: every distinct prompt streamed once, one at a time, before
   anything is killed;
2. `streams` client threads, each streaming one greedy completion after another through
   `sluice.client.stream_chat` over every replica's URL (it re-attaches with Last-Event-ID through
   the next replica when a connection breaks), each event's arrival time kept;
3. `batches` Batch API batches of `batch_lines` lines (the same prompts), submitted at even times
   during the chaos (no kill lands while one is being submitted: a create cut midway cannot be
   retried without perhaps making a second batch), polled, and downloaded at the end;
4. every `kill_every_s` a SIGKILL of a random replica or worker (the kinds take turns, the target
   is random; a kill only takes one of a kind while another of that kind is up, so the cluster
   always has a replica and a worker), started again after `sluice serve`'s supervisor backoff
   (`restart_delay`: 1 s, then 2, 5, 10 s for a child killed again within a minute of its start)
   and waited for until it serves.

`run_chaos` returns the raw outcome; `chaos_report` turns it into figures and a table.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from sluice.client import StreamBroken, stream_chat
from sluice.gateway.launch.children import restart_delay
from sluice_lab.experiments.cluster import STARTUP_TIMEOUT_S, Cluster, Process

KINDS = ("replica", "worker")
_TERMINAL = {"completed", "failed", "expired", "cancelled"}


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    duration_s: float = 300.0  # of the chaos: kills and new streams stop after this
    kill_every_s: float = 8.0
    kinds: tuple[str, ...] = KINDS  # empty: nothing is killed (an undisturbed run of the same load)
    streams: int = 8  # concurrent streaming clients
    batches: int = 1
    batch_lines: int = 200  # per batch
    prompts: int = 8  # distinct prompts (each has one reference)
    max_tokens: int = 32
    seed: int = 0
    # Streams go to the first this many replicas only (0: to all), and replica kills spare those:
    # a cluster without replica takeover ends a SIGKILLed replica's streams (docs/streams.md), but
    # its batch lines move to the survivors, so this still kills replicas under load.
    stream_replicas: int = 0
    read_timeout_s: float = 30.0  # a connection silent this long counts as broken (stream_chat retries)
    max_attempts: int = 8  # connections per stream before it counts as failed
    batch_timeout_s: float = 600.0  # after the chaos, for the batches to finish

    def __post_init__(self) -> None:
        for name in ("duration_s", "kill_every_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"--kill takes a comma-separated list of {', '.join(KINDS)} (or none), "
                             f"got {','.join(self.kinds)}")
        for name in ("streams", "prompts", "max_tokens", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("batches", "batch_lines"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.stream_replicas < 0:
            raise ValueError(f"--stream-replicas must be 0 (all) or more, got {self.stream_replicas}")
        if self.batches and not self.batch_lines:
            raise ValueError("--batch-lines must be positive when --batches is")


def check_cluster_fits(config: ChaosConfig, replicas: int, workers: int) -> None:
    """One of a kind must stay up while another is killed."""
    for kind, count in (("replica", replicas), ("worker", workers)):
        if kind in config.kinds and count < 2:
            raise ValueError(f"killing {kind}s needs --{kind}s 2 or more (one stays up while another restarts), "
                             f"got {count}")
    if config.stream_replicas > replicas:
        raise ValueError(f"--stream-replicas {config.stream_replicas} is more than --replicas {replicas}")
    if "replica" in config.kinds and config.stream_replicas == replicas:
        raise ValueError("killing replicas with --stream-replicas equal to --replicas: no replica may be killed")


def prompts(config: ChaosConfig) -> list[str]:
    return [f"Chaos prompt {i}: tell me the story of the gateway that lost a replica." for i in range(config.prompts)]


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    # ignore_eos: every answer has exactly max_tokens tokens, so a truncated one is a divergence.
    return {"model": "demo", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


# ---- streams -------------------------------------------------------------------------------------

@dataclass
class StreamResult:
    client: int
    prompt: int
    started_s: float  # since the chaos began
    ended_s: float | None = None
    text: str = ""
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    stall_s: float | None = None  # the longest gap between two consecutive events
    connections: int = 0  # HTTP requests it took (1 = never reconnected)
    attaches: int = 0  # of which re-attaches after events had come (GET .../events with Last-Event-ID)


def stream_once(bases: list[str], key: str, prompt_index: int, prompt: str, config: ChaosConfig,
                client_index: int, t0: float) -> StreamResult:
    """One streamed completion through `stream_chat`, timed event by event."""
    result = StreamResult(client_index, prompt_index, time.monotonic() - t0)

    def count(request: httpx.Request) -> None:
        result.connections += 1
        result.attaches += request.method == "GET"

    parts: list[str] = []
    arrivals: list[float] = []
    sent = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(config.read_timeout_s, connect=5.0),
                      event_hooks={"request": [count]}) as http:
        try:
            for event in stream_chat(bases, key, chat_body(prompt, config.max_tokens), client=http,
                                     max_attempts=config.max_attempts):
                arrivals.append(time.monotonic())
                if event.is_error:
                    result.error = "error event: " + json.dumps(event.data.get("error"))[:300]
                    break
                for choice in event.data.get("choices", []):
                    parts.append((choice.get("delta") or {}).get("content") or "")
            else:
                result.ok = True
        except (StreamBroken, httpx.HTTPError) as exc:
            result.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    result.ended_s = time.monotonic() - t0
    result.text = "".join(parts)
    if arrivals:
        result.ttft_s = arrivals[0] - sent
        result.stall_s = max((b - a for a, b in itertools.pairwise(arrivals)), default=0.0)
    return result


def stream_client(index: int, cluster: Cluster, key: str, texts: list[str], config: ChaosConfig, t0: float,
                  stop: threading.Event, out: list[StreamResult], lock: threading.Lock) -> None:
    """One client: a stream after another until `stop`; its first try goes to replica index % N."""
    urls = [r.base_url for r in cluster.replicas][:config.stream_replicas or None]
    bases = urls[index % len(urls):] + urls[:index % len(urls)]
    rng = random.Random(config.seed * 1000 + index)
    while not stop.is_set():
        prompt = rng.randrange(len(texts))
        result = stream_once(bases, key, prompt, texts[prompt], config, index, t0)
        with lock:
            out.append(result)


# ---- kills ---------------------------------------------------------------------------------------

@dataclass
class Kill:
    at_s: float
    kind: str
    index: int
    pid: int
    restarted_at_s: float | None = None  # its new process started
    serving_at_s: float | None = None  # ready and linked again
    error: str = ""


@dataclass
class Killer:
    """Every `kill_every_s`, SIGKILLs one replica or worker that is up, and starts it again."""

    cluster: Cluster
    config: ChaosConfig
    t0: float
    kills: list[Kill] = field(default_factory=list)
    skipped: int = 0  # kill times with no kind having two up (the last victim still restarting)
    _down: set[tuple[str, int]] = field(default_factory=set)  # killed, not serving again yet
    _lock: threading.Lock = field(default_factory=threading.Lock)  # held: no kill now (a batch is created)
    _threads: list[threading.Thread] = field(default_factory=list)
    # The supervisor's backoff state per child: restarts so far, and when it was last started.
    _restarts: dict[tuple[str, int], int] = field(default_factory=dict)
    _started_at: dict[tuple[str, int], float] = field(default_factory=dict)

    def process(self, kind: str, index: int) -> Process:
        return self.cluster.replicas[index].process if kind == "replica" else self.cluster.workers[index]

    def up(self, kind: str) -> list[int]:
        count = len(self.cluster.replicas) if kind == "replica" else len(self.cluster.workers)
        return [i for i in range(count) if (kind, i) not in self._down and self.process(kind, i).alive]

    def killable(self, kind: str) -> list[int]:
        spared = self.config.stream_replicas if kind == "replica" else 0
        return [i for i in self.up(kind) if i >= spared]

    def up_replica_urls(self) -> list[str]:
        return [self.cluster.replicas[i].base_url for i in self.up("replica")]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            yield

    def run(self, stop: threading.Event) -> None:
        """Kills at kill_every_s, 2 * kill_every_s, ... while inside the chaos's duration."""
        rng = random.Random(self.config.seed)
        turn: list[str] = []
        n = 1
        while self.config.kinds and n * self.config.kill_every_s < self.config.duration_s:
            if stop.wait(max(0.0, self.t0 + n * self.config.kill_every_s - time.monotonic())):
                return
            n += 1
            if not turn:  # the kinds take turns, in a random order each round
                turn = rng.sample(self.config.kinds, len(self.config.kinds))
            first = turn.pop()
            with self._lock:
                # One of each kind stays up: when the turn's kind has a single one up, the other goes.
                for kind in [first, *(k for k in self.config.kinds if k != first)]:
                    if len(self.up(kind)) >= 2 and (candidates := self.killable(kind)):
                        break
                else:
                    self.skipped += 1
                    continue
                index = rng.choice(candidates)
                process = self.process(kind, index)
                kill = Kill(time.monotonic() - self.t0, kind, index, process.pid)
                self._down.add((kind, index))
                process.kill()
                self.kills.append(kill)
                # Started before the chaos: healthy, as a child up for a minute is to the supervisor.
                uptime = time.monotonic() - self._started_at.get((kind, index), -math.inf)
                delay, self._restarts[kind, index] = restart_delay(self._restarts.get((kind, index), 0), uptime)
            thread = threading.Thread(target=self._restart, args=(kill, delay), name=f"restart-{kind}-{index}")
            thread.start()
            self._threads.append(thread)

    def _restart(self, kill: Kill, delay_s: float) -> None:
        time.sleep(delay_s)
        self._started_at[kill.kind, kill.index] = time.monotonic()
        try:
            if kill.kind == "replica":
                kill.restarted_at_s = time.monotonic() - self.t0
                self.cluster.start_replica(kill.index)  # returns once it answers /ready
                self._wait(lambda: self._worker_pids(kill.index) >= {self.process("worker", i).pid
                                                                     for i in self.up("worker")})
            else:
                worker = self.process(kill.kind, kill.index)
                worker.start()
                kill.restarted_at_s = time.monotonic() - self.t0
                self._wait(lambda: all(worker.pid in self._worker_pids(i) for i in self.up("replica")))
            kill.serving_at_s = time.monotonic() - self.t0
        except Exception as exc:  # reported; the run's figures show what it cost
            kill.error = f"{type(exc).__name__}: {str(exc)[:500]}"
        finally:
            self._down.discard((kill.kind, kill.index))

    def _worker_pids(self, replica: int) -> set[int]:
        """The pids of the workers linked to this replica now (none while it does not answer)."""
        try:
            view = self.cluster.admin("GET", "/workers", replica=replica)
        except Exception:
            return set()
        return {int(w["pid"]) for w in view.get("workers", []) if w.get("pid") is not None}

    @staticmethod
    def _wait(predicate: Callable[[], bool], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not serving again within {timeout_s:.0f} s")
            time.sleep(0.25)

    def join_restarts(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


# ---- batches -------------------------------------------------------------------------------------

@dataclass
class BatchRun:
    batch_id: str
    submitted_s: float
    lines: dict[str, int]  # custom_id -> prompt index
    status: str = ""
    finished_s: float | None = None
    outputs: list[tuple[str, str | None]] = field(default_factory=list)  # (custom_id, text; None = error line)


def batch_jsonl(number: int, config: ChaosConfig, texts: list[str]) -> tuple[bytes, dict[str, int]]:
    lines, ids = [], {}
    for i in range(config.batch_lines):
        custom_id = f"b{number}-line-{i}"
        ids[custom_id] = i % len(texts)
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                 "body": chat_body(texts[ids[custom_id]], config.max_tokens)}))
    return ("\n".join(lines) + "\n").encode(), ids


def _request(urls: Callable[[], list[str]], key: str, method: str, path: str, timeout_s: float = 600.0,
             **kwargs: Any) -> httpx.Response:
    """An idempotent call through whichever replica is up, retried across them for up to
    `timeout_s` while replicas die and come back."""
    deadline = time.monotonic() + timeout_s
    while True:
        for base in urls() or []:
            try:
                response = httpx.request(method, base + path, headers={"authorization": f"Bearer {key}"},
                                         timeout=60, **kwargs)
                if response.status_code < 500:
                    response.raise_for_status()
                    return response
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{method} {path}: no replica answered within {timeout_s:.0f} s")
        time.sleep(0.5)


def submit_batch(number: int, killer: Killer, key: str, config: ChaosConfig, texts: list[str]) -> BatchRun:
    """Upload and create, with no kill meanwhile (a create cut midway cannot be retried safely)."""
    data, ids = batch_jsonl(number, config, texts)
    with killer.paused():
        urls = killer.up_replica_urls
        uploaded = _request(urls, key, "POST", "/v1/files", files={"file": (f"chaos-{number}.jsonl", data)},
                            data={"purpose": "batch"}).json()
        created = _request(urls, key, "POST", "/v1/batches", json={
            "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    return BatchRun(created["id"], time.monotonic() - killer.t0, ids)


def finish_batch(run: BatchRun, killer: Killer, key: str, timeout_s: float) -> None:
    """Polls until the batch ends (or `timeout_s`), then downloads its output and error files."""
    urls = killer.up_replica_urls
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = _request(urls, key, "GET", f"/v1/batches/{run.batch_id}").json()
        if state.get("status") in _TERMINAL:
            run.finished_s = time.monotonic() - killer.t0
            break
        time.sleep(2.0)
    run.status = str(state.get("status", ""))
    for file_field, is_error in (("output_file_id", False), ("error_file_id", True)):
        if not state.get(file_field):
            continue
        content = _request(urls, key, "GET", f"/v1/files/{state[file_field]}/content").text
        for line in content.splitlines():
            if not line.strip():
                continue
            obj = json.loads(line)
            text = None
            if not is_error and obj.get("response") and obj["response"].get("status_code") == 200:
                text = obj["response"]["body"]["choices"][0]["message"]["content"] or ""
            run.outputs.append((str(obj.get("custom_id")), text))


# ---- the run -------------------------------------------------------------------------------------

@dataclass
class ChaosOutcome:
    config: ChaosConfig
    replicas: int
    workers: int
    texts: list[str]
    references: list[str]
    streams: list[StreamResult]
    kills: list[Kill]
    kills_skipped: int
    batches: list[BatchRun]
    chaos_s: float  # from the start to the last stream's end
    load_average: tuple[float, float]  # 1-minute load average at the start and at the end


def reference_texts(cluster: Cluster, key: str, texts: list[str], config: ChaosConfig) -> list[str]:
    """Each prompt streamed once, alone, on the undisturbed cluster."""
    out = []
    for i, prompt in enumerate(texts):
        result = stream_once([cluster.replicas[0].base_url], key, i, prompt, config, -1, time.monotonic())
        if not result.ok:
            raise RuntimeError(f"the reference stream of prompt {i} failed on the undisturbed cluster: {result.error}")
        out.append(result.text)
    return out


def run_chaos(cluster: Cluster, stream_key: str, batch_key: str, config: ChaosConfig,
              say: Callable[[str], None] = print) -> ChaosOutcome:
    import os

    check_cluster_fits(config, len(cluster.replicas), len(cluster.workers))
    texts = prompts(config)
    references = reference_texts(cluster, stream_key, texts, config)
    say(f"chaos: {len(texts)} references streamed; {config.streams} streams, {config.batches} x "
        f"{config.batch_lines} batch lines, a {'/'.join(config.kinds)} SIGKILLed every {config.kill_every_s:g} s "
        f"for {config.duration_s:g} s")
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    killer = Killer(cluster, config, t0)
    stop = threading.Event()
    results: list[StreamResult] = []
    lock = threading.Lock()
    clients = [threading.Thread(target=stream_client, name=f"chaos-stream-{i}",
                                args=(i, cluster, stream_key, texts, config, t0, stop, results, lock))
               for i in range(config.streams)]
    kills = threading.Thread(target=killer.run, args=(stop,), name="chaos-killer")
    batches: list[BatchRun] = []
    try:
        for thread in clients:
            thread.start()
        kills.start()
        for number in range(config.batches):  # at 0, T/n, 2T/n, ...
            time.sleep(max(0.0, t0 + number * config.duration_s / config.batches - time.monotonic()))
            batches.append(submit_batch(number, killer, batch_key, config, texts))
        stop.wait(max(0.0, t0 + config.duration_s - time.monotonic()))
    finally:
        stop.set()
        kills.join()
        join_by = time.monotonic() + config.max_attempts * config.read_timeout_s + 60
        for thread in clients:  # each ends its stream under way, then stops
            thread.join(max(0.0, join_by - time.monotonic()))
        chaos_s = time.monotonic() - t0
        killer.join_restarts(300.0)
    say(f"chaos: {len(results)} streams in {chaos_s:.0f} s, {len(killer.kills)} kills; waiting for the batches")
    batch_deadline = time.monotonic() + config.batch_timeout_s
    for run in batches:
        finish_batch(run, killer, batch_key, max(1.0, batch_deadline - time.monotonic()))
    return ChaosOutcome(config, len(cluster.replicas), len(cluster.workers), texts, references, results,
                        killer.kills, killer.skipped, batches, chaos_s, (load_start, os.getloadavg()[0]))
