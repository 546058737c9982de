"""What the resumable-stream log adds per token (docs/streams.md), in-process and in Redis.

`--streams` concurrent streams each append `--tokens` SSE frames of a realistic size, one every
`--itl-ms` (a decode step), as the pump of a streamed response does. Two figures per store:

- **on the stream path**: the time `StreamLog.append` itself takes (it never waits: the Redis
  store only queues the frame for its flusher); this is what a token's delivery to its own
  client is delayed by.
- **to durable** (Redis only): from `append` to the pipelined XADD batch holding it being
  acknowledged by Redis, i.e. until a follower on another replica could read it.

    PYTHONPATH=. python bench/stream_log.py --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time

from redis.asyncio import Redis

from sluice.gateway.streams.local_log import LocalStreamLog
from sluice.gateway.streams.log import StreamLog
from sluice.gateway.streams.redis_log import RedisStreamLog
from sluice.telemetry import percentile

FRAME = (
    b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.chunk",'
    b'"created":1764600000,"model":"demo","service_tier":"default","choices":[{"index":0,'
    b'"delta":{"content":" river"},"logprobs":null,"finish_reason":null}]}\n\n'
)


async def _stream(log: StreamLog, index: int, tokens: int, itl_s: float, costs: list[float]) -> None:
    rid = f"chatcmpl-bench{index}-{secrets.token_hex(4)}"
    await log.create(rid, "bench-tenant", None)
    for _ in range(tokens):
        start = time.perf_counter()
        log.append(rid, FRAME)
        costs.append(time.perf_counter() - start)
        await asyncio.sleep(itl_s)
    log.end(rid)


async def measure(log: StreamLog, streams: int, tokens: int, itl_s: float) -> list[float]:
    costs: list[float] = []
    await log.start()
    try:
        await asyncio.gather(*(_stream(log, i, tokens, itl_s, costs) for i in range(streams)))
    finally:
        await log.stop()
    return costs


def _us(values: list[float]) -> dict[str, float]:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    if p50 is None or p99 is None:
        return {"n": 0}
    return {"p50_us": round(p50 * 1e6, 1), "p99_us": round(p99 * 1e6, 1), "n": len(values)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="", help="also measure the Redis store (redis://HOST:PORT/DB)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    args = parser.parse_args()
    if args.streams < 1 or args.tokens < 1 or args.itl_ms < 0:
        parser.error("--streams and --tokens must be at least 1, --itl-ms at least 0")
    itl_s = args.itl_ms / 1000
    result: dict[str, object] = {"streams": args.streams, "tokens": args.tokens, "itl_ms": args.itl_ms}
    result["in_process_append"] = _us(await measure(LocalStreamLog(), args.streams, args.tokens, itl_s))
    if args.redis_url:
        prefix = f"sluice-bench-{secrets.token_hex(4)}"
        client = Redis.from_url(args.redis_url)
        try:
            log = RedisStreamLog(client, prefix=prefix, retention_s=30)
            result["redis_append"] = _us(await measure(log, args.streams, args.tokens, itl_s))
            result["redis_to_durable"] = _us(list(log.flush_latency_s))
            keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
