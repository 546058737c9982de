"""Replica takeover of streamed generations (docs/streams.md, "Replica takeover").

With shared state (Redis), the replica whose consumer reads a streamed request's Kafka record
(its partition's owner, the acceptor itself included) *holds* the record, uncommitted, until the
stream's log has ended: `StreamHolder` checks every held stream once a second, all of them in one
script call per `CHECK_BATCH`. An ended stream (or one whose log is gone, or a record that was
never a stream: a non-streamed request has no log) finishes its record. If the holder dies, the
consumer group's rebalance replays the unfinished record to the partition's next owner, which
holds it in turn.

A held stream whose generator (`gen` in P:sm:ID: the acceptor, or the replica that took it over
last) has let its lease in P:replicas run out while its log has no end marker is an *orphan*: the
holder claims it with one script (`CLAIM`) that checks all of that again and files itself as the
generator, so exactly one replica continues a stream, and never one that ended. It then reads
the log's typed checkpoints (the stream's `Envelope`, each event's `Mark`: token ids, text
characters, finish reason, kind) and hands the stream to its `Resumer` (streams/resumer.py),
which dispatches the request again with `resume_token_ids` and pumps the rest into the same
log. A stream is taken over at most `MAX_TAKEOVERS` times: a request that keeps losing its
replica ends with an error event instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.gateway.generation.state import Envelope
from sluice.gateway.queueing.consumer import RecordRef
from sluice.gateway.streams.log import EventKind, Mark, decode_envelope, decode_mark, unpack_tokens
from sluice.gateway.streams.redis_log import READ_BATCH, RedisStreamLog
from sluice.protocol import GenerateRequest

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often held streams are checked (the takeover's stall adds up to this)
CHECK_BATCH = 500  # streams per script call
GONE_AFTER_S = 10.0  # a held record whose stream has no owner yet is released only once held this long
MAX_TAKEOVERS = 3  # a stream whose generating replica was lost this often ends with an error

# Answers of CHECK and CLAIM, per stream.
GONE, ENDED, ALIVE, ORPHAN, CLAIMED = 0, 1, 2, 3, 4

_STATE = r"""
local P = ARGV[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- 0 gone (no log: expired, dropped, or never a stream), 1 ended, 2 its generator's lease is
-- live, 3 orphan (not ended, its generator's lease ran out or was given up)
local function state(id, now)
  local meta = P .. ':sm:' .. id
  local gen = redis.call('HGET', meta, 'gen')
  if not gen and redis.call('EXISTS', meta) == 0 then return 0 end
  local last = redis.call('XREVRANGE', P .. ':sl:' .. id, '+', '-', 'COUNT', 1)
  if #last > 0 and last[1][2][1] == 'e' then return 1 end
  if gen then
    local deadline = redis.call('ZSCORE', P .. ':replicas', gen)
    if deadline and tonumber(deadline) > now then return 2 end
  end
  return 3
end
"""

# ARGV: prefix, then response ids. Returns one state per id.
CHECK = _STATE + r"""
local now = now_ms()
local out = {}
for i = 2, #ARGV do out[#out + 1] = state(ARGV[i], now) end
return out
"""

# ARGV: prefix, response id, the claiming replica. Returns {4, takeovers so far} when the claim
# succeeded (the claimer is the stream's generator now), else {state, 0}.
CLAIM = _STATE + r"""
local id, me = ARGV[2], ARGV[3]
local s = state(id, now_ms())
if s ~= 3 then return {s, 0} end
local meta = P .. ':sm:' .. id
local n = redis.call('HINCRBY', meta, 'takeovers', 1)
redis.call('HSET', meta, 'gen', me)
return {4, n}
"""

TAKEOVER_FAILED = b"data: " + msgspec.json.encode({
    "error": {
        "message": "The stream was stopped: the gateway replicas generating it were lost and it could not be "
                   "continued.",
        "type": "server_error",
        "param": None,
        "code": "stream_interrupted",
    }
}) + b"\n\n"


@dataclass(slots=True)
class Claimed:
    """A stream this replica now generates: what its log holds, for the resumer."""

    response_id: str
    tenant: str
    key: str | None  # the Redis key of its Idempotency-Key (its TTL is renewed with the stream's)
    takeovers: int
    next_seq: int  # of the next event
    grace_s: float | None = None  # its disconnect grace as its POST chose it (None: not filed)
    envelope: Envelope | None = None  # as its acceptor filed it
    token_ids: list[int] = field(default_factory=list)  # sent so far, in order
    chars: int = 0  # characters of output text sent so far
    finish: str | None = None  # the finish reason a logged chunk carried
    usage_sent: bool = False  # the usage chunk was logged
    final: bool = False  # [DONE] or an error event was logged: nothing was to follow
    whole: bool = True  # False: the log has a gap (trimmed, or events Redis never got)
    ended: bool = False  # its end marker was written after all (late, by the lost replica)

    def take(self, mark: Mark) -> None:
        """One logged event's checkpoint, in order."""
        self.token_ids.extend(unpack_tokens(mark.tokens))
        self.chars += mark.chars
        self.finish = mark.finish or self.finish
        self.usage_sent = self.usage_sent or mark.kind == EventKind.USAGE
        self.final = self.final or mark.final


class Resumer(Protocol):
    def can_continue(self, request: GenerateRequest) -> bool:
        """Whether this replica could run the request now (its model's tokenizer and a worker
        for it): a replica just started claims nothing before its workers have linked."""
        ...

    async def __call__(self, request: GenerateRequest, claimed: Claimed) -> None:
        """Continues a claimed stream (or ends its log); raising ends its log with an error."""
        ...


class StreamHolder:
    """The Kafka records of streamed requests held by this replica until their logs end."""

    def __init__(self, client: Redis, stream_log: RedisStreamLog, *, prefix: str, replica: str,
                 finish: Callable[[RecordRef], None], current: Callable[[RecordRef], bool],
                 check_s: float = CHECK_S, gone_after_s: float = GONE_AFTER_S) -> None:
        self._redis: Any = client
        self._log = stream_log
        self._prefix = prefix
        self.replica = replica
        self._finish = finish
        self._current = current  # whether this replica still answers for a record
        self.check_s = check_s
        self.gone_after_s = gone_after_s
        self._check = client.register_script(CHECK)
        self._claim = client.register_script(CLAIM)
        self._held: dict[str, tuple[GenerateRequest, RecordRef]] = {}
        self._held_since: dict[str, float] = {}  # monotonic time each was first held
        self._claiming: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.resumer: Resumer | None = None  # the app's (streams/resumer.py, `bind`); None: no takeover
        self.taken_over = 0  # streams this replica claimed

    def bind(self, resumer: Resumer) -> None:
        """The app's resumer: orphaned streams are continued from now on. The holder is made with
        the Kafka backend, before the app whose services the resumer uses (gateway/app.py)."""
        self.resumer = resumer

    @property
    def held(self) -> int:
        return len(self._held)

    def hold(self, request: GenerateRequest, ref: RecordRef) -> None:
        older = self._held.get(request.request_id)
        self._held[request.request_id] = (request, ref)
        self._held_since.setdefault(request.request_id, time.monotonic())
        if older is not None:  # read again (its partition came back): the newer record counts
            self._finish(older[1])

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Held records stay unfinished: the partitions' next owners replay and hold them."""
        tasks = [t for t in (self._task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.check_s)
            try:
                await self.check()
            except (RedisError, OSError) as exc:
                if not failing:
                    log.warning("takeover: checking held streams failed (%s); retrying every %gs", exc, self.check_s)
                failing = True
            except Exception:
                log.exception("takeover: checking held streams failed")
            else:
                failing = False

    async def check(self) -> None:
        """One pass over the held streams: finish the ended, claim the orphaned."""
        for rid, (_, ref) in list(self._held.items()):
            if not self._current(ref):  # its partition was revoked: the new owner replays it
                del self._held[rid]
                self._held_since.pop(rid, None)
        ids = [rid for rid in self._held if rid not in self._claiming]
        for start in range(0, len(ids), CHECK_BATCH):
            chunk = ids[start : start + CHECK_BATCH]
            states = await self._check(args=[self._prefix, *chunk])
            now = time.monotonic()
            for rid, state in zip(chunk, states, strict=True):
                if state == ENDED or (state == GONE and now - self._held_since.get(rid, now) >= self.gone_after_s):
                    # GONE at first may be a stream whose acceptor files it right after the
                    # Kafka ack (gateway/api/openai.py): only a lasting GONE is no stream.
                    self._release(rid)
                elif (state == ORPHAN and self.resumer is not None and rid not in self._claiming
                      and self.resumer.can_continue(self._held[rid][0])):
                    self._claiming.add(rid)
                    task = asyncio.get_running_loop().create_task(self._take(rid))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    async def claim(self, rid: str) -> tuple[int, int]:
        """(CLAIMED, takeovers so far) when this replica now generates the stream, else (its
        state, 0): one script, so of replicas racing for an orphan exactly one wins."""
        state, takeovers = await self._claim(args=[self._prefix, rid, self.replica])
        return int(state), int(takeovers)

    def _release(self, rid: str) -> None:
        self._held_since.pop(rid, None)
        held = self._held.pop(rid, None)
        if held is not None:
            self._finish(held[1])

    async def _take(self, rid: str) -> None:
        try:
            held = self._held.get(rid)
            if held is None:
                return
            request = held[0]
            state, takeovers = await self.claim(rid)
            if state != CLAIMED:
                if state == ENDED:
                    self._release(rid)
                return  # another replica claimed it first (or its generator renewed its lease)
            self.taken_over += 1
            claimed = await self.read(rid, takeovers)
            log.warning("stream %s: its replica was lost; taking it over at event %d after %d tokens (takeover %d)",
                        rid, claimed.next_seq, len(claimed.token_ids), takeovers)
            resumer = self.resumer
            try:
                if resumer is None:
                    raise RuntimeError("no resumer")
                await resumer(request, claimed)
            except Exception:
                log.exception("stream %s: could not be continued; its log ends with an error", rid)
                self.end_with(claimed, TAKEOVER_FAILED)
        except (RedisError, OSError) as exc:
            log.warning("stream %s: taking it over failed (%s); tried again at the next check", rid, exc)
        finally:
            self._claiming.discard(rid)

    def end_with(self, claimed: Claimed, frame: bytes | None) -> None:
        """Ends a claimed stream's log here (after `frame`, an error event, when given)."""
        self._log.adopt(claimed.response_id, claimed.tenant, claimed.next_seq, claimed.key)
        if frame is not None:
            self._log.append(claimed.response_id, frame, Mark(EventKind.ERROR))
        self._log.end(claimed.response_id)

    async def read(self, rid: str, takeovers: int) -> Claimed:
        """What the log of a claimed stream holds (nobody writes it but this replica now)."""
        meta = await self._redis.hgetall(f"{self._prefix}:sm:{rid}")
        key = meta.get(b"key")
        grace = meta.get(b"grace")
        envelope = meta.get(b"env")
        claimed = Claimed(rid, meta.get(b"tenant", b"").decode(), key.decode() if key else None, takeovers, 0,
                          float(grace) if grace else None,
                          envelope=decode_envelope(envelope) if envelope else None)
        name, after = f"{self._prefix}:sl:{rid}", "-"
        while True:
            entries = await self._redis.xrange(name, min=after, count=READ_BATCH)
            for entry_id, fields in entries:
                seq = int(entry_id.split(b"-", 1)[1]) - 1
                if seq != claimed.next_seq:
                    claimed.whole = False
                if b"e" in fields:
                    claimed.ended = True
                    return claimed
                packed = fields.get(b"m")
                if packed:
                    claimed.take(decode_mark(packed))
                claimed.next_seq = seq + 1
            if len(entries) < READ_BATCH:
                return claimed
            after = "(" + entries[-1][0].decode()

