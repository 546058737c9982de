"""Messages exchanged between the gateway and the workers (and written to Kafka).

msgspec structs only: no torch, no pickle. The gateway converts HTTP bodies to these at the
edge; the engine consumes `SamplingParams` directly. Wire format: msgpack, one length-prefixed
frame per message (see `encode_frame` / `FrameDecoder`).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import math
import struct
from pathlib import Path
from typing import Literal

import msgspec

_log = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    """Lower value = more urgent. Ordered so `min()` picks the most urgent class."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str) -> Priority:
        try:
            return cls[value.upper()]
        except KeyError:
            raise ValueError(
                f"unknown priority class {value!r}; expected interactive, standard or batch"
            ) from None


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


MAX_STRUCTURED_SPEC_CHARS = 256 * 1024  # a schema, regex, choice list or grammar; the grammar module bounds more
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias (OpenAI's own limit)


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What a request's output must match, enforced token by token by the engine's grammar.

    `kind` and `spec`:
    - "json": a JSON Schema as JSON text (`{"type": "object"}` is OpenAI's `json_object`);
    - "regex": the whole output matches the regular expression;
    - "choice": a JSON array of strings; the output is exactly one of them;
    - "grammar": a context-free grammar, in the syntax of the grammar library the engine uses;
    - "tagged": JSON `{"begin": str, "schema": <JSON Schema>, "end": str, "repeat": bool}`: `begin`,
      one JSON value matching `schema`, `end`; once, or one or more times when `repeat` (a model
      family's tool-call format).
    """

    kind: Literal["json", "regex", "choice", "grammar", "tagged"]
    spec: str


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Per-request sampling settings. `validate()` raises ValueError with a message fit for a 400."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    structured: StructuredOutput | None = None
    # (token id, bias in [-100, 100]) added to the logits before sampling and before a grammar's mask
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        def finite(name: str, value: float) -> None:
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            finite(name, getattr(self, name))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be between 0 and 1, got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be between -2 and 2, got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if len(self.stop) > 16:
            raise ValueError(f"at most 16 stop sequences are allowed, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop sequences must be non-empty strings")
        if any(len(s) > 256 for s in self.stop):
            raise ValueError("each stop sequence must be at most 256 characters")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be between 0 and 20, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.structured is not None and len(self.structured.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(f"a structured output's spec must be at most {MAX_STRUCTURED_SPEC_CHARS} characters")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {token_id}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias}")


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, tag="generate"):
    """One accepted request, as written to Kafka and sent to a worker."""

    request_id: str
    tenant_id: str
    model: str
    priority: Priority
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str  # per tenant: equal prompts of two tenants never share KV blocks
    arrival_time: float  # unix seconds at the gateway
    batch_id: str | None = None  # set for lines of a Batch API job
    custom_id: str | None = None
    # The tenant's fair-share weight at admission: the gateway's scheduler divides served tokens
    # by it (a replayed request keeps the weight it was accepted with).
    tenant_weight: float = 1.0
    # Output tokens already produced (and delivered) by an earlier attempt: the engine recomputes
    # prompt + these and generates after them, as its preemption does (worker failover, replica
    # takeover). `sampling.max_tokens` stays the whole budget, these included.
    resume_token_ids: tuple[int, ...] = ()
    # W3C trace context of the request's span at the gateway (sluice/tracing.py): the worker's and
    # an upstream's spans are its children. None while tracing is off.
    traceparent: str | None = None
    # The tool-call format of the answer ("hermes", "llama3_json", "mistral") when the request gave
    # tools: the gateway parses the output with it (a batch line's too). The engine ignores it.
    tool_format: str | None = None
    # Latency targets in seconds (sluice/objectives.py: class, tenant, header); None: best effort.
    # The engine keeps a decoding request's steps within `itl_target_s` (workers/step_budget.py).
    ttft_target_s: float | None = None
    itl_target_s: float | None = None


class AbortRequest(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class PositionLogprobs(msgspec.Struct, frozen=True, array_like=True):
    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


class RequestDelta(msgspec.Struct, frozen=True, kw_only=True, tag="delta"):
    """What one engine step produced for one request."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[PositionLogprobs, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    # An upstream server refused the request as invalid (its HTTP 4xx): the client gets this status
    # with `error` (the server's own message) instead of a 500 "please retry" (issue #35).
    error_status: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # Engine-side timestamps (unix seconds): TTFT and every ITL are computed from these.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: tuple[float, ...] = ()


# The step-cost model's features and their scales (a coefficient is seconds per feature / scale):
# the units of `WorkerCapacity.step_cost`, shared by the engine's model (workers/step_budget.py)
# and the gateway's TTFT prediction (gateway/dispatch/ttft.py).
STEP_COST_FEATURES = ("fixed", "prefill_tokens", "decode_rows", "context_tokens", "verify_rows", "prefill_pairs")
STEP_COST_SCALES = (1.0, 1_000.0, 100.0, 100_000.0, 100.0, 1_000_000.0)


class WorkerCapacity(msgspec.Struct, frozen=True, kw_only=True, tag="capacity"):
    """A worker's load, sent on registration, on every change and as a heartbeat."""

    worker_id: str
    num_running: int
    num_waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    max_num_seqs: int
    sent_at: float
    # GenerateRequests the worker has received so far on this connection: the gateway subtracts
    # it from what it sent to know how many are still in flight to the worker's waiting queue.
    num_received: int = 0
    num_preemptions: int = 0  # engine preemptions since the worker started (cumulative)
    num_draft_tokens: int = 0  # speculative draft tokens verified since the worker started (cumulative)
    num_accepted_draft_tokens: int = 0  # of those, kept (cumulative)
    # The engine's step-time model (workers/step_budget.py): seconds per scaled unit of each of its
    # FEATURES; empty while it has not seen enough steps. For the gateway's TTFT prediction.
    step_cost: tuple[float, ...] = ()
    # Its recent relative prediction error of step time: (median, p95); None before any.
    step_cost_error: tuple[float, float] | None = None
    # Prompt tokens still to prefill, waiting and running, by class (index = Priority value);
    # empty from an older worker. With `step_cost`, the gateway's TTFT prediction (dispatch/ttft.py).
    prefill_backlog: tuple[int, ...] = ()
    max_num_batched_tokens: int = 0  # the engine's token budget per step (0: not reported)
    decode_context_tokens: int = 0  # KV tokens the decoding streams read per step (0: none, or an older worker)


class KvEvents(msgspec.Struct, frozen=True, kw_only=True, tag="kv_events"):
    """Worker → gateway, once per engine step that changed its prefix cache: the chained, salted
    hashes (sluice/prefix_hash.py) of the blocks it cached and evicted. Sent only to a gateway whose
    challenge asked for them (`WorkerChallenge.kv_events`): an older gateway never sees the kind.

    A gateway indexes them per connection (gateway/dispatch/cache_index.py): a new connection
    starts from an empty entry, so a restarted or reconnected worker is treated as empty."""

    block_size: int  # tokens per block: the gateway hashes a prompt with it
    stored: tuple[bytes, ...] = ()
    evicted: tuple[bytes, ...] = ()
    cleared: bool = False  # the worker forgot its whole cache before these (e.g. new weights)


class ServedModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker serves under one model name: the gateway checks it against its own view."""

    name: str
    max_model_len: int
    tokenizer: str = ""  # tokenizer_identity() of the model directory; "" = unknown


class WorkerChallenge(msgspec.Struct, frozen=True, tag="challenge"):
    """Gateway → worker, the first frame of every connection: the nonce the worker's proof covers."""

    nonce: bytes
    # The gateway reads `KvEvents` (an older worker ignores the field, an older gateway omits it).
    kv_events: bool = False


class WorkerRegister(msgspec.Struct, frozen=True, kw_only=True, tag="register"):
    """Worker → gateway, the answer to the challenge. Nothing is sent to a worker before it is accepted."""

    worker_id: str
    models: tuple[ServedModelInfo, ...]
    device: str
    pid: int
    capacity: WorkerCapacity
    proof: str = ""  # worker_proof(secret, challenge nonce, worker_id): the secret never crosses the wire


class WorkerRejected(msgspec.Struct, frozen=True, tag="rejected"):
    """Gateway → worker, just before it closes a connection it did not accept (the reason, no secrets)."""

    reason: str


Message = (GenerateRequest | AbortRequest | RequestDelta | WorkerCapacity | WorkerRegister | WorkerChallenge
           | WorkerRejected | KvEvents)


def worker_proof(secret: str, nonce: bytes, worker_id: str) -> str:
    """HMAC-SHA256 of the challenge nonce and the worker id under the shared worker secret (hex)."""
    message = nonce + b"\0" + worker_id.encode("utf-8")
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def proof_matches(secret: str, nonce: bytes, worker_id: str, proof: str) -> bool:
    """Constant-time check of a worker's proof."""
    return hmac.compare_digest(worker_proof(secret, nonce, worker_id).encode(), proof.encode("utf-8"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def tokenizer_identity(model_dir: str | Path) -> str:
    """SHA-256 over a model directory's tokenizer files (name and bytes), "" when it has none.

    Gateway and worker compute it from their own copy of the model: equal values mean the token ids
    the gateway produces are the ones the worker's model was trained on.
    """
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            found = True
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest() if found else ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 64 * 1024 * 1024


def encode_frame(message: Message) -> bytes:
    body = _encoder.encode(message)
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Incrementally splits a byte stream into messages; a frame over `max_frame_bytes` is an error.

    The gateway reads an unauthenticated peer with a small limit, so a stranger cannot make it
    buffer a 64 MiB frame; `max_frame_bytes` is raised once the worker is accepted.

    `skip_undecodable` (set by the gateway once a worker is accepted): a whole frame that does not
    decode to a known message (a kind from a newer worker, a malformed body) is logged and skipped;
    the length prefix keeps the stream in step, so the connection goes on.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self.max_frame_bytes = max_frame_bytes
        self.skip_undecodable = False
        self.num_skipped = 0

    def feed(self, data: bytes) -> list[Message]:
        self._buffer.extend(data)
        messages: list[Message] = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > self.max_frame_bytes:
                raise ValueError(f"frame of {length} bytes exceeds the {self.max_frame_bytes}-byte limit")
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            body = bytes(self._buffer[_HEADER.size:end])
            del self._buffer[:end]
            try:
                messages.append(_decoder.decode(body))
            except msgspec.DecodeError as exc:  # ValidationError (an unknown kind, a bad field) included
                if not self.skip_undecodable:
                    raise
                self.num_skipped += 1
                _log.warning("skipped an undecodable frame of %d bytes (%s)", length, exc)
        return messages


READ_CHUNK_BYTES = 1 << 16  # what one socket read asks for


async def read_opening(reader: asyncio.StreamReader, decoder: FrameDecoder) -> list[Message]:
    """Reads until the peer's first whole frame: the messages decoded by then ([] if it closed first).

    Both ends open a connection with it: the worker waits for the gateway's `WorkerChallenge`, the
    gateway for the worker's `WorkerRegister`. A read may carry more than one frame, so the caller
    gets them all and checks the first.
    """
    while True:
        data = await reader.read(READ_CHUNK_BYTES)
        if not data:
            return []
        messages = decoder.feed(data)
        if messages:
            return messages
