"""`sluice bench gateway-overhead`: what the gateway, the queues and the network add to TTFT.

Per request: client-seen TTFT (the load generator: send -> first SSE chunk) minus worker-seen
TTFT (the gateway's record: dispatch to the worker -> the engine's first token), joined by
request id (= the response `id`). The difference is HTTP handling, authentication, quotas,
tokenisation, the durable Kafka enqueue, the scheduler, dispatch and streaming the token back.
Components from the same joined data:
  http_in_s     client send -> gateway arrival stamp
  admission_s   gateway arrival -> dispatch (Kafka enqueue + consume + scheduler queue)
  delivery_s    engine first token -> first chunk at the client
Separately, the latency Kafka adds to admission is measured directly against the stack's own
broker: produce with acks=all (what the gateway waits for before accepting a request), and
produce -> consume.

The worker's engine gets `max_num_seqs` above the concurrency and the per-worker waiting cap is
lifted, so requests are not held for capacity and queueing does not masquerade as overhead.
Requests are short (small prompt, a few output tokens) so the run measures the serving path,
not the model.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from sluice.telemetry import RequestRecord, percentile, read_records
from sluice_lab.experiments.common import ratio, resolve_model
from sluice_lab.experiments.stack import Stack, start_stack
from sluice_lab.loadgen.client import ClientResult
from sluice_lab.loadgen.prompts import LengthDist
from sluice_lab.loadgen.runner import run_scenario
from sluice_lab.loadgen.scenario import Arrival, Scenario, Slo, Tenant, Workload


def _pct(values: list[float], name: str) -> dict[str, float | None]:
    return {f"{name}_p50_s": percentile(values, 50), f"{name}_p99_s": percentile(values, 99)}


def join(results: list[ClientResult], records: list[RequestRecord]) -> list[dict[str, float]]:
    by_id = {r.request_id: r for r in records}
    rows = []
    for result in results:
        record = by_id.get(result.request_id)
        if not result.ok or result.first_token is None or record is None or record.engine_ttft_s is None:
            continue
        client_ttft = result.first_token - result.sent
        row = {"client_ttft": client_ttft, "worker_ttft": record.engine_ttft_s,
               "overhead": client_ttft - record.engine_ttft_s,
               "http_in": record.arrival - result.sent}
        if record.queue_wait_s is not None:
            row["admission"] = record.queue_wait_s
        if record.engine_first_token is not None:
            row["delivery"] = result.first_token - record.engine_first_token
        rows.append(row)
    return rows


def level_summary(concurrency: int, results: list[ClientResult], rows: list[dict[str, float]],
                  wall_s: float) -> dict[str, Any]:
    errors = sum(1 for r in results if not r.ok)
    out: dict[str, Any] = {"concurrency": concurrency, "requests": len(results), "errors": errors,
                           "joined": len(rows), "wall_s": wall_s}
    for name in ("overhead", "client_ttft", "worker_ttft", "http_in", "admission", "delivery"):
        out.update(_pct([row[name] for row in rows if name in row], name))
    return out


def _scenario(model: str, key: str, concurrency: int, requests: int) -> Scenario:
    workload = Workload(
        name=f"c{concurrency}", tenant=Tenant("bench-overhead", key),
        arrival=Arrival("closed", concurrency=concurrency), prompt_tokens=LengthDist("fixed", value=16),
        output_tokens=LengthDist("fixed", value=4), service_tier="priority")
    return Scenario(name=f"overhead-c{concurrency}", model=model, endpoint="chat", workloads=(workload,),
                    slo=Slo(), duration_s=3600.0, max_requests=requests)


async def kafka_latency(bootstrap: str, messages: int, payload_bytes: int = 1024) -> dict[str, Any]:
    """acks=all produce latency and produce->consume latency on a fresh topic of the broker."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    topic = f"bench-overhead-{int(time.time() * 1000)}"
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                group_id=f"{topic}-g")
    await producer.start()
    await consumer.start()
    acks: list[float] = []
    sent: dict[int, float] = {}
    end_to_end: list[float] = []
    try:
        body = b"x" * payload_bytes
        await producer.send_and_wait(topic, body, key=b"warmup")  # creates the topic
        for i in range(messages):
            start = time.time()
            sent[i] = start
            await producer.send_and_wait(topic, body, key=str(i).encode())
            acks.append(time.time() - start)
        deadline = time.time() + 30
        while len(end_to_end) < messages and time.time() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            now = time.time()
            for records in batch.values():
                for record in records:
                    key = record.key.decode() if record.key else ""
                    if key.isdigit() and int(key) in sent:
                        end_to_end.append(now - sent.pop(int(key)))
    finally:
        await consumer.stop()
        await producer.stop()
    return {"messages": messages, "payload_bytes": payload_bytes, **_pct(acks, "produce_ack"),
            **_pct(end_to_end, "produce_to_consume")}


def _broker_address(stack: Stack) -> str | None:
    match = re.search(r"embedded Kafka broker on (\S+)", stack.log_tail(200))
    return match.group(1) if match else None


def measure_overhead(stack: Stack, levels: list[int], per_level: int | None,
                     kafka_messages: int = 100) -> dict[str, Any]:
    """Run every concurrency level against a started stack and summarise (see the module doc)."""
    summary: dict[str, Any] = {"levels": []}
    key = stack.create_tenant_key(f"bench-overhead-{int(time.time() * 1000)}", ceiling="interactive",
                                  default_class="interactive")
    # Warm-up: first requests pay for lazy imports, tokenizer loading and Kafka metadata.
    asyncio.run(run_scenario(_scenario(stack.model, key, 2, 6), stack.base_url, progress=False))
    for concurrency in levels:
        n = per_level or max(3 * concurrency, 20)
        run = asyncio.run(run_scenario(_scenario(stack.model, key, concurrency, n), stack.base_url,
                                       progress=False))
        time.sleep(1.0)  # records are written just after the stream ends
        rows = join(run.results, read_records(stack.record_log))
        summary["levels"].append(level_summary(concurrency, run.results, rows, run.wall_s))
    bootstrap = _broker_address(stack)
    summary["kafka"] = asyncio.run(kafka_latency(bootstrap, kafka_messages)) if bootstrap else {
        "error": "no embedded broker address in the serve log (external Kafka?)"}
    top = max(summary["levels"], key=lambda lvl: lvl["concurrency"])
    summary["target"] = {"overhead_p50_s_max": 0.003, "overhead_p99_s_max": 0.015, "at_concurrency": 200}
    summary["headline"] = {"concurrency": top["concurrency"], "overhead_p50_s": top["overhead_p50_s"],
                           "overhead_p99_s": top["overhead_p99_s"],
                           "overhead_share_of_client_ttft_p50": ratio(top["overhead_p50_s"],
                                                                      top["client_ttft_p50_s"])}
    return summary


def run_overhead(model_dir: Path, config_dir: str, levels: list[int], per_level: int | None,
                 workdir: Path) -> dict[str, Any]:
    # Engine capacity above the concurrency, and no cap on a worker's own waiting queue: requests
    # are never held for a free slot, so queueing does not masquerade as gateway overhead.
    max_seqs = max(levels) + 8
    env = {"SLUICE_ENGINE_MAX_NUM_SEQS": str(max_seqs),
           "SLUICE_ENGINE_MAX_NUM_BATCHED_TOKENS": str(max(512, 16 * max_seqs)),
           "SLUICE_DISPATCH_MAX_WORKER_WAITING": str(max_seqs)}
    with start_stack(config_dir, workdir, model_dir, env=env) as stack:
        summary = measure_overhead(stack, levels, per_level)
    summary["model"] = str(model_dir)
    return summary


def plot_overhead(summary: dict[str, Any], path: str | Path) -> None:
    from sluice_lab.experiments.plots import new_figure, save

    fig, (left, right) = new_figure(1, 2, figsize=(12, 4.8))
    levels = summary["levels"]
    xs = [str(lvl["concurrency"]) for lvl in levels]
    width = 0.25
    for i, (name, label) in enumerate((("overhead", "client - worker TTFT"), ("client_ttft", "client TTFT"),
                                       ("worker_ttft", "worker TTFT"))):
        left.bar([j + (i - 1) * width for j in range(len(xs))],
                 [(lvl[f"{name}_p50_s"] or 0) * 1000 for lvl in levels], width, label=f"{label} p50")
        left.scatter([j + (i - 1) * width for j in range(len(xs))],
                     [(lvl[f"{name}_p99_s"] or 0) * 1000 for lvl in levels], marker="_", s=200, color="black")
    left.set_xticks(range(len(xs)), xs)
    left.set(xlabel="concurrent streams", ylabel="ms (bars p50, dashes p99)", title="Gateway overhead")
    left.legend(fontsize=8)
    parts = ("http_in", "admission", "delivery")
    bottom = [0.0] * len(levels)
    for name in parts:
        values = [(lvl[f"{name}_p50_s"] or 0) * 1000 for lvl in levels]
        right.bar(xs, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set(xlabel="concurrent streams", ylabel="ms (p50)", title="Where the overhead goes (p50)")
    right.legend(fontsize=8)
    save(fig, path)


def run_gateway_overhead_command(args: argparse.Namespace) -> int:
    from sluice.errors import CLIError
    from sluice_lab.cli import write_json

    levels = [4] if args.quick else args.concurrency
    per_level = 8 if args.quick else args.requests_per_level
    if per_level is not None and per_level < 1:
        raise CLIError("--requests-per-level must be positive")
    with tempfile.TemporaryDirectory(prefix="sluice-overhead-") as tmp:
        summary = run_overhead(resolve_model(args.model), args.config_dir, levels, per_level, Path(tmp))
    write_json(args.json_out, summary)
    plot_overhead(summary, args.plot)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    for lvl in summary["levels"]:
        print(f"concurrency {lvl['concurrency']:>4}: overhead p50 {ms(lvl['overhead_p50_s'])}, "
              f"p99 {ms(lvl['overhead_p99_s'])} (client TTFT p50 {ms(lvl['client_ttft_p50_s'])}, worker "
              f"{ms(lvl['worker_ttft_p50_s'])}; admission p50 {ms(lvl['admission_p50_s'])}) "
              f"[{lvl['joined']}/{lvl['requests']} joined, {lvl['errors']} errors]")
    kafka = summary["kafka"]
    if "error" not in kafka:
        print(f"kafka: produce acks=all p50 {ms(kafka['produce_ack_p50_s'])} "
              f"p99 {ms(kafka['produce_ack_p99_s'])}; "
              f"produce->consume p50 {ms(kafka['produce_to_consume_p50_s'])}")
    print(f"wrote {args.json_out} and {args.plot}")
    return 0
