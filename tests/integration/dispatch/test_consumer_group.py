"""Class topics shared by gateway replicas through the consumer group, on the real embedded broker:
the group splits the partitions; a member killed with SIGKILL (another process) loses its
partitions to the survivor, which replays exactly its unfinished records; a member whose partitions
were revoked never commits an offset of them, even once it gets some back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from sluice.gateway.queueing.consumer import ClassConsumer, RecordRef
from sluice.gateway.queueing.kafka import RequestLog, ensure_topics, group_base, topic_name
from sluice.protocol import GenerateRequest, Priority, SamplingParams
from sluice.settings import KafkaSettings

from .conftest import REPO, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = 4
N = 40


def group_settings(bootstrap_servers: str) -> KafkaSettings:
    # Tansu takes a short session (Apache Kafka would want 6 s): the tests rebalance in seconds.
    return KafkaSettings(bootstrap_servers=bootstrap_servers, topic_prefix=f"g{uuid.uuid4().hex[:8]}",
                         consumer_group=f"grp-{uuid.uuid4().hex[:6]}", partitions=PARTITIONS,
                         session_timeout_ms=1500, heartbeat_interval_ms=500)


def line(n: int) -> GenerateRequest:
    # One tenant per request: the keys spread the records over every partition.
    return GenerateRequest(request_id=f"r{n}", tenant_id=f"tenant-{n}", model="demo", priority=Priority.BATCH,
                           prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=2),
                           cache_salt="s", arrival_time=0.0)


async def append_all(settings: KafkaSettings, requests: list[GenerateRequest]) -> None:
    log = RequestLog(settings)
    await log.start()
    try:
        for request in requests:
            await log.append(request)
    finally:
        await log.stop()


async def committed(settings: KafkaSettings) -> dict[int, int | None]:
    """The group's committed offsets, read by a client that does not join the group."""
    reader = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers,
                              group_id=f"{group_base(settings)}.{Priority.BATCH.label}", enable_auto_commit=False)
    await reader.start()
    try:
        topic = topic_name(settings, Priority.BATCH)
        return {p: await reader.committed(TopicPartition(topic, p)) for p in range(PARTITIONS)}
    finally:
        await reader.stop()


def partitions(consumer: ClassConsumer) -> set[int]:
    return {tp.partition for tp in consumer.owned}


# A replica in its own process: reads its partitions, finishes the even-numbered requests, and once
# nothing new arrived for a second (its commits went out) prints what it read, then waits to be killed.
MEMBER = textwrap.dedent("""
    import asyncio, json, sys, msgspec
    from sluice.gateway.queueing.consumer import ClassConsumer
    from sluice.protocol import Priority
    from sluice.settings import KafkaSettings

    async def main():
        settings = msgspec.json.decode(sys.argv[1], type=KafkaSettings)
        got = {}

        async def on_request(request, ref):
            got[request.request_id] = (ref.partition.partition, ref.offset)
            if int(request.request_id[1:]) % 2 == 0:
                consumer.finish(ref)

        consumer = ClassConsumer(settings, Priority.BATCH, on_request, group_assigned=True)
        await consumer.start()
        print(json.dumps({"started": True}), flush=True)
        reported, seen = None, -1
        while True:
            await asyncio.sleep(1.0)
            state = (sorted(tp.partition for tp in consumer.owned), len(got))
            if state != reported and len(got) == seen and consumer.num_unfinished == len(
                    [r for r in got if int(r[1:]) % 2]):
                print(json.dumps({"partitions": state[0], "got": got}), flush=True)
                reported = state
            seen = len(got)

    asyncio.run(main())
""")


async def test_a_killed_replicas_partitions_move_and_only_its_unfinished_records_are_replayed(
        bootstrap_servers: str, tmp_path: Path) -> None:
    import msgspec

    settings = group_settings(bootstrap_servers)
    await ensure_topics(settings)
    mine: list[tuple[GenerateRequest, RecordRef]] = []

    async def on_request(request: GenerateRequest, ref: RecordRef) -> None:
        mine.append((request, ref))
        survivor.finish(ref)  # the survivor finishes everything it reads at once

    survivor = ClassConsumer(settings, Priority.BATCH, on_request, group_assigned=True)
    await survivor.start()
    member = subprocess.Popen([sys.executable, "-c", MEMBER, msgspec.json.encode(settings).decode()],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=open(tmp_path / "member.log", "wb"),  # noqa: SIM115
                              text=True, start_new_session=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    try:
        await wait_for(lambda: len(partitions(survivor)) == PARTITIONS // 2, 60, "the group to split the partitions")
        await append_all(settings, [line(n) for n in range(N)])
        report: dict[str, object] = {}
        while not report.get("got"):
            text = await asyncio.wait_for(asyncio.to_thread(member.stdout.readline), 60)  # type: ignore[union-attr]
            assert text, "the member process ended"
            report = json.loads(text)
        theirs = {rid: tuple(at) for rid, at in report["got"].items()}  # type: ignore[union-attr]
        await wait_for(lambda: len(mine) + len(theirs) >= N, 30, "every record to be read once")
        assert set(report["partitions"]) | partitions(survivor) == set(range(PARTITIONS))  # type: ignore[arg-type]
        assert not set(report["partitions"]) & partitions(survivor)  # type: ignore[arg-type]
        assert {r.request_id for r, _ in mine} | set(theirs) == {f"r{n}" for n in range(N)}
        assert not {r.request_id for r, _ in mine} & set(theirs)

        before = len(mine)
        killed_at = time.monotonic()
        os.killpg(member.pid, signal.SIGKILL)
        member.wait(10)
        await wait_for(lambda: len(partitions(survivor)) == PARTITIONS, 60, "the survivor to get every partition")
        moved_after = time.monotonic() - killed_at
        unfinished = {rid for rid in theirs if int(rid[1:]) % 2}
        await wait_for(lambda: unfinished <= {r.request_id for r, _ in mine[before:]}, 30,
                       "the dead member's unfinished records to be replayed")
        await asyncio.sleep(1.0)  # nothing more should arrive
        replayed = {r.request_id for r, _ in mine[before:]}
        assert len(replayed) == len(mine) - before  # each once
        # Beyond the unfinished ones, only finished records above an unfinished offset of the same
        # partition (the commit could not pass it): none of the survivor's own records.
        low: dict[int, int] = {}
        for rid in unfinished:
            partition, offset = theirs[rid]
            low[partition] = min(low.get(partition, offset), offset)
        for rid in replayed - unfinished:
            assert rid in theirs, f"{rid} was the survivor's own record"
            partition, offset = theirs[rid]
            assert offset > low[partition]
        print(f"partitions of the killed replica moved after {moved_after:.1f}s (session 1.5 s)")
    finally:
        if member.poll() is None:
            os.killpg(member.pid, signal.SIGKILL)
            member.wait(10)
        await survivor.stop()


async def test_a_revoked_partition_is_never_committed_by_its_old_owner(bootstrap_servers: str) -> None:
    settings = group_settings(bootstrap_servers)
    await ensure_topics(settings)
    first_got: list[tuple[GenerateRequest, RecordRef]] = []
    second_got: list[tuple[GenerateRequest, RecordRef]] = []

    async def first_reads(request: GenerateRequest, ref: RecordRef) -> None:
        first_got.append((request, ref))  # held, not finished

    async def second_reads(request: GenerateRequest, ref: RecordRef) -> None:
        second_got.append((request, ref))

    first = ClassConsumer(settings, Priority.BATCH, first_reads, group_assigned=True)
    second = ClassConsumer(settings, Priority.BATCH, second_reads, group_assigned=True)
    await first.start()
    try:
        await wait_for(lambda: len(first.owned) == PARTITIONS, 60, "the first member to join")
        await append_all(settings, [line(n) for n in range(N)])
        await wait_for(lambda: len(first_got) == N, 30, "the first member to read every record")
        held = list(first_got)
        await second.start()
        await wait_for(lambda: len(first.owned) + len(second.owned) == PARTITIONS and first.owned
                       and second.owned, 60, "the group to rebalance")
        for _, ref in held:  # finishing what it read before the rebalance: a revoked assignment's refs
            assert not first.current(ref)
            first.finish(ref)
        await asyncio.sleep(0.5)  # several commit intervals
        assert set((await committed(settings)).values()) == {None}  # nothing was committed
        # The new owner replays every record of its partitions (none was committed); the old owner
        # reads its partitions again from the start too, as records of its new assignment.
        theirs = {r.request_id for r, ref in held if ref.partition in second.owned}
        await wait_for(lambda: theirs <= {r.request_id for r, _ in second_got}, 30, "the new owner to replay")
        again = {r.request_id for r, ref in held if ref.partition in first.owned}
        await wait_for(lambda: len(first_got) == N + len(again), 30, "the old owner to read its partitions again")
        for _, ref in first_got[N:]:
            assert first.current(ref)
            first.finish(ref)
        await wait_for(lambda: first.num_unfinished == 0, 10, "the old owner to finish")
        ends: dict[int, int] = {}
        for _, ref in first_got[N:]:
            ends[ref.partition.partition] = max(ends.get(ref.partition.partition, 0), ref.offset + 1)
        deadline = time.monotonic() + 10
        while True:
            offsets = await committed(settings)
            mine = {p: o for p, o in offsets.items() if p in {tp.partition for tp in first.owned}}
            if mine == ends or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert mine == ends  # its own partitions, by refs of the assignment it holds now
        assert all(offsets[tp.partition] is None for tp in second.owned)  # never the other's
    finally:
        await second.stop()
        await first.stop()


async def test_a_revoked_partition_s_watermark_is_committed_before_it_moves(bootstrap_servers: str) -> None:
    """Finished offsets not yet committed when a rebalance starts are committed by the old owner
    while it still owns the partition, so the new owner replays nothing it finished."""
    settings = group_settings(bootstrap_servers)
    await ensure_topics(settings)
    got: list[tuple[GenerateRequest, RecordRef]] = []

    async def reads(request: GenerateRequest, ref: RecordRef) -> None:
        got.append((request, ref))

    async def ignore(request: GenerateRequest, ref: RecordRef) -> None:
        return None

    # After one commit its commit loop sleeps for the rest of the test: later finishes stay pending.
    first = ClassConsumer(settings, Priority.BATCH, reads, group_assigned=True, commit_interval_s=3600)
    second = ClassConsumer(settings, Priority.BATCH, ignore, group_assigned=True)
    await first.start()
    try:
        await wait_for(lambda: len(first.owned) == PARTITIONS, 60, "the first member to join")
        await append_all(settings, [line(n) for n in range(N)])
        await wait_for(lambda: len(got) == N, 30, "every record to be read")
        first.finish(got[0][1])
        deadline = time.monotonic() + 10
        while (await committed(settings))[got[0][1].partition.partition] is None:
            assert time.monotonic() < deadline, "the first commit did not go out"
            await asyncio.sleep(0.1)
        for _, ref in got[1:]:
            first.finish(ref)  # pending: the commit loop sleeps
        ends: dict[int, int] = {}
        for _, ref in got:
            ends[ref.partition.partition] = max(ends.get(ref.partition.partition, 0), ref.offset + 1)
        await second.start()
        await wait_for(lambda: bool(first.owned) and bool(second.owned), 60, "the group to rebalance")
        assert await committed(settings) == ends  # every partition's watermark, committed at revocation
    finally:
        await second.stop()
        await first.stop()
