"""The Redis invalidation bus: a change reaches the other subscriber; a subscriber whose
connection is cut drops everything (it may have missed changes) and receives again once back."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from sluice.gateway.cluster.invalidation import Change, RedisBus

pytestmark = pytest.mark.integration


async def until(received: list[Change], change: Change) -> None:
    async with asyncio.timeout(5):
        while change not in received:
            await asyncio.sleep(0.01)


async def test_changes_reach_the_other_replica_and_a_cut_subscription_drops_everything(
    redis: Redis, redis_url: str, prefix: str
) -> None:
    name = f"{prefix}-sub"
    publisher_client = Redis.from_url(redis_url)
    subscriber_client = Redis.from_url(redis_url, client_name=name)
    publisher = RedisBus(publisher_client, f"{prefix}:invalidate")
    subscriber = RedisBus(subscriber_client, f"{prefix}:invalidate")
    mine: list[Change] = []
    received: list[Change] = []
    publisher.subscribe(mine.append)
    subscriber.subscribe(received.append)
    await publisher.start()
    await subscriber.start()
    try:
        await publisher.publish(Change("key", "key_1"))
        assert Change("key", "key_1") in mine  # applied here at once, before any round trip
        await until(received, Change("key", "key_1"))

        clients = await redis.client_list()
        (victim,) = [c for c in clients if c.get("name") == name and "SUBSCRIBE" in c.get("cmd", "").upper()]
        await redis.client_kill_filter(_id=victim["id"])
        await until(received, Change("everything"))
        received.clear()
        async with asyncio.timeout(5):  # resubscribed: changes arrive again
            while Change("tenant", "ten_1") not in received:
                await publisher.publish(Change("tenant", "ten_1"))
                await asyncio.sleep(0.1)
        assert Change("everything") in received  # dropped again on resubscribing
    finally:
        await subscriber.stop()
        await publisher.stop()
        await subscriber_client.aclose()
        await publisher_client.aclose()
