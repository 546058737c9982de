"""Kafka for the gateway: class topics, the durable request log and its consumers.

Every accepted request is written to `{prefix}.requests.{class}` (msgspec msgpack, keyed by
tenant, acks=all) before the client hears "accepted". The gateway's own consumers read those
topics back into the in-memory fair scheduler; an offset is committed only once the request is
finished, tracked per partition by `PartitionWatermark` (commit the lowest unfinished offset), so
a restarted gateway replays exactly the unfinished requests (and maybe a few finished ones whose
commit had not gone out yet: callers de-duplicate by request id).

One consumer (and consumer group) per class: a flood in the batch topic is paused on its own
consumer and never delays fetching the interactive topic. Only the plain Kafka protocol and
aiokafka's public API are used, so the embedded Tansu broker and Apache Kafka behave the same
(see KAFKA-NOTES.md).
The consumers that read the topics back live in `queueing/consumer.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from sluice.protocol import GenerateRequest, Priority
from sluice.settings import KafkaSettings

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0  # stopping a Kafka client (a last commit, leaving the group) takes at most this
ACCEPTOR_HEADER = "sluice-acceptor"  # the replica that accepted (and wrote) a request
# The fetch wait of the topics whose records are all dispatched when accepted (`dispatched_at_acceptance`).
DISPATCHED_FETCH_WAIT_MS = 250

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GenerateRequest)


async def stop_client(client: AIOKafkaConsumer | AIOKafkaProducer) -> None:
    """Stops an aiokafka client within `STOP_TIMEOUT_S`, whatever state the broker is in.

    After a broker outage aiokafka's consumer `stop()` can raise the CancelledError of its own
    coordinator task: that is not this task being cancelled, so it is logged, not propagated
    (propagating it aborts the gateway's shutdown)."""
    try:
        await asyncio.wait_for(client.stop(), STOP_TIMEOUT_S)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
        log.warning("stopping the Kafka %s was cut short", type(client).__name__)
    except Exception as exc:
        log.warning("stopping the Kafka %s failed (%r)", type(client).__name__, exc)


class QueueUnavailable(Exception):
    """The broker did not take the request in time; the message says what happened."""


def topic_name(settings: KafkaSettings, priority: Priority) -> str:
    return f"{settings.topic_prefix}.requests.{priority.label}"


def dispatched_at_acceptance(priority: Priority) -> bool:
    """Whether every record of this class's topic is a stream or whole response, dispatched by the
    replica that accepted it (batch lines are all of the batch class): its consumer only finishes
    or holds them (gateway/streams/holder.py), so they need not be fetched soon after their write."""
    return priority is not Priority.BATCH


def fetch_wait_ms(settings: KafkaSettings, priority: Priority) -> int:
    """How long a fetch of this class's topic may wait at the broker. Tansu parks every fetch for
    the whole wait, so each consumer fetches about 1000/wait times a second, loaded or idle, and
    each fetch costs the broker and the gateway CPU on the gateway's core; `kafka.fetch_max_wait_ms`
    bounds the admission of batch lines, which only the batch topic holds."""
    if dispatched_at_acceptance(priority):
        return max(settings.fetch_max_wait_ms, DISPATCHED_FETCH_WAIT_MS)
    return settings.fetch_max_wait_ms


def group_base(settings: KafkaSettings) -> str:
    """The gateways' consumer group (each class topic's group adds `.<class>`): the configured
    `consumer_group`, else `<topic_prefix>-gateway`, so deployments with their own topics on one
    Kafka cluster never share a group (a rebalance waits for every member of its group)."""
    return settings.consumer_group or f"{settings.topic_prefix}-gateway"


def encode_request(request: GenerateRequest) -> bytes:
    return _encoder.encode(request)


def decode_request(data: bytes) -> GenerateRequest:
    return _decoder.decode(data)


async def ensure_topics(settings: KafkaSettings, timeout_s: float = 10.0) -> list[str]:
    """Create the class topics that are missing (their names are returned). Existing topics are
    left as they are.

    Missing topics are found by listing, not by catching TopicAlreadyExists: Tansu answers
    success for an existing topic.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers,
                                request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        existing = set(await asyncio.wait_for(admin.list_topics(), timeout_s))
        wanted = [topic_name(settings, p) for p in Priority]
        missing = [
            NewTopic(name, num_partitions=settings.partitions,
                     replication_factor=settings.replication_factor,
                     topic_configs={"retention.ms": str(settings.retention_ms)})
            for name in wanted if name not in existing
        ]
        if missing:
            await asyncio.wait_for(admin.create_topics(missing), timeout_s)
            log.info("created topics %s", ", ".join(t.name for t in missing))
        return [t.name for t in missing]
    except (TimeoutError, KafkaError, OSError) as exc:
        raise QueueUnavailable(
            f"cannot reach the Kafka broker at {settings.bootstrap_servers} to create topics ({exc!r})"
        ) from exc
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


class RequestLog:
    """The producer side: `append()` returns once the broker acknowledged the request (acks=all)."""

    def __init__(self, settings: KafkaSettings, produce_timeout_s: float = 5.0,
                 on_recreated: Callable[[], None] | None = None, *, acceptor: str = "") -> None:
        self._settings = settings
        self._timeout = produce_timeout_s
        self._on_recreated = on_recreated  # told when a lost topic was created again before a write
        # Written into each record's ACCEPTOR_HEADER: whoever consumes a streaming record can tell
        # one its own process dispatched at acceptance from another replica's.
        self._headers = [(ACCEPTOR_HEADER, acceptor.encode())] if acceptor else None
        self._producer: AIOKafkaProducer | None = None
        self._present: frozenset[str] = frozenset()  # the broker's topics at the last lookup
        # The producer's live broker connections when that lookup ended (see `_topic_exists`).
        self._looked_up_on: tuple[object, ...] | None = None
        self._checking = asyncio.Lock()
        self.lookups = 0  # topic lookups made (appends that found the connections unchanged make none)

    async def start(self) -> None:
        s = self._settings
        self._producer = AIOKafkaProducer(
            bootstrap_servers=s.bootstrap_servers,
            acks="all",
            enable_idempotence=s.enable_idempotence,
            max_request_size=s.max_request_bytes,
            request_timeout_ms=int(self._timeout * 1000),
            linger_ms=0,
        )
        try:
            await asyncio.wait_for(self._producer.start(), self._timeout * 2)
        except (TimeoutError, KafkaError, OSError) as exc:
            with contextlib.suppress(Exception):
                await self._producer.stop()
            self._producer = None
            raise QueueUnavailable(
                f"cannot connect to the Kafka broker at {s.bootstrap_servers} ({exc!r})") from exc

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await stop_client(producer)

    async def ping(self, timeout_s: float = 1.0) -> bool:
        """Whether the broker answers a metadata request now (for readiness)."""
        if self._producer is None:
            return False
        try:
            await asyncio.wait_for(self._producer.client.fetch_all_metadata(), timeout_s)
        except (TimeoutError, KafkaError, OSError):
            return False
        return True

    async def append(self, request: GenerateRequest) -> None:
        if self._producer is None:
            raise QueueUnavailable("the request queue is not started")
        producer = self._producer
        topic = topic_name(self._settings, request.priority)
        # Yield once first: a stream's job was handed to the dispatcher just before this append
        # (KafkaBackend.submit), so its worker or upstream gets the request before the producer
        # spends its CPU on this one; the client hears nothing until the ack either way.
        await asyncio.sleep(0)
        value, key = encode_request(request), request.tenant_id.encode()
        headers = self._headers
        if request.traceparent is not None:  # W3C trace context for tools that read Kafka headers
            headers = [*(headers or ()), ("traceparent", request.traceparent.encode())]
        try:
            # Bounded: with the broker gone, aiokafka would otherwise retry for a long time. A
            # timeout scope, not wait_for: wait_for runs each call in a task of its own, two
            # tasks and loop hops per request (Python 3.11).
            async with asyncio.timeout(self._timeout):
                await self._topic_exists(topic)
            before = self._live_connections()
            async with asyncio.timeout(self._timeout):
                await producer.send_and_wait(topic, value, key=key, headers=headers)
            # The producer reconnected while writing (aiokafka retries a broken send on a new
            # connection, silently): the broker that acknowledged may be a restarted one that lost
            # the topic and kept nothing. Look again; write again into a recreated topic.
            if before is not None and self._live_connections() != before:
                async with asyncio.timeout(self._timeout):
                    recreated = await self._topic_exists(topic)
                if recreated:
                    async with asyncio.timeout(self._timeout):
                        await producer.send_and_wait(topic, value, key=key, headers=headers)
        except TimeoutError:
            raise QueueUnavailable(
                f"the request queue (Kafka at {self._settings.bootstrap_servers}) did not acknowledge "
                f"within {self._timeout:g}s; try again later"
            ) from None
        except KafkaError as exc:
            raise QueueUnavailable(
                f"the request queue rejected the request ({exc!r}); try again later") from exc

    def _live_connections(self) -> tuple[object, ...] | None:
        """The producer's open broker connections, in order (None: this aiokafka does not show them).

        A TCP connection does not survive its broker's restart: while every connection open at the
        last topic lookup is still open, and no new one was made, the producer talks to the same
        broker processes that lookup saw. aiokafka offers no public signal of a reconnect (0.14:
        `AIOKafkaClient` has `ready(node_id)`, which opens a connection and does not tell whether it
        is a new one, and nothing that lists them), so this, the one place that does, reads its
        client's private connection table; without one every append looks the topics up."""
        assert self._producer is not None  # append() checked; internal invariant
        conns = getattr(self._producer.client, "_conns", None)
        if not isinstance(conns, dict):
            return None
        return tuple(conn for conn in conns.values() if conn.connected())

    async def _topic_exists(self, topic: str) -> bool:
        """Never produce into a topic the broker does not have: Tansu (memory storage) restarted
        acknowledges a record sent to a topic it lost, and keeps nothing of it. So the broker's
        topics are looked up (one metadata request) whenever the producer's connections changed
        since the last lookup (a broker may have restarted: `_live_connections`), and the class
        topics are created when this one is missing; True when it was. With the connections
        unchanged an append costs no lookup (one was ~0.5 ms against Tansu, about what the produce
        itself takes, and 10 % of the gateway's CPU per streamed request). Appends that wait while
        a lookup is in flight share it. Listing all topics, not describing ours: a metadata request
        naming a missing topic makes Tansu create it (with its default partition count)."""
        known = self._looked_up_on
        if topic in self._present and known is not None and self._live_connections() == known:
            return False
        async with self._checking:
            current = self._live_connections()
            if topic in self._present and current is not None and current == self._looked_up_on:
                return False  # looked up meanwhile, by an append that waited with this one
            assert self._producer is not None  # append() checked; internal invariant
            self.lookups += 1
            present = set((await self._producer.client.fetch_all_metadata()).topics())
            missing = topic not in present
            if missing:
                log.warning("topic %s is missing on the broker (restarted?); creating the class topics", topic)
                created = await ensure_topics(self._settings, self._timeout)
                present |= {topic_name(self._settings, p) for p in Priority}
                if created and self._on_recreated is not None:
                    self._on_recreated()
            self._present = frozenset(present)
            self._looked_up_on = self._live_connections()
            return missing
