"""Settings: TOML files in the config directory, overridden by SLUICE_* environment variables.

Files (all optional except where noted), in `$SLUICE_CONFIG_DIR` (default: ./config):
  sluice.toml   sections [gateway] [admin] [database] [kafka] [broker] [scheduler] [dispatch] [shared]
                [objectives] [engine]
  models.toml   [[models]] name, path, and how a missing directory is made: demo = true or fetch = "NAME"
  tenants.toml  [[tenants]] the seed tenants (see TenantSeed)
  upstreams.toml [[upstreams]] OpenAI-compatible servers the gateway dispatches to (see UpstreamSpec,
                docs/upstreams.md)

Environment overrides: SLUICE_<SECTION>_<KEY>=value, e.g. SLUICE_GATEWAY_PORT=8080,
SLUICE_DATABASE_URL=postgresql+asyncpg://..., SLUICE_KAFKA_BOOTSTRAP_SERVERS=kafka:9092,
SLUICE_SHARED_URL=redis://127.0.0.1:6379/0,
SLUICE_ADMIN_TOKEN=... . Values are read as TOML literals when they parse (numbers, booleans,
arrays), otherwise as strings. An override naming a known section but an unknown key is an error.
Every problem is reported as one ConfigError naming the file (or variable), the key and the fault.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from sluice.errors import ConfigError
from sluice.objectives import check_target

ClassName = Literal["interactive", "standard", "batch"]


# Every field's meaning is the docstring right below it (the attribute docstring convention, as
# Sphinx and pydantic read it): `sluice config reference` writes docs/configuration.md from them,
# and a test fails when one is missing or the page is stale.


class GatewaySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    """Address the HTTP API listens on (`0.0.0.0`: every interface)."""
    port: int = 8000
    """Port of the HTTP API."""
    worker_host: str = "127.0.0.1"
    """Address of the worker port: workers connect here to register and receive work (msgspec frames
    over TCP), `sluice serve`'s local workers included."""
    worker_port: int = 8100
    """The worker port; 0 = any free port."""
    worker_secret: str = ""
    """Shared by the gateway and its workers; a worker proves it knows it (HMAC of a challenge, the
    secret never crosses the wire). Empty: `sluice serve` generates one per start for its local
    workers, and only a loopback `worker_host` is allowed. Required (at least 16 characters) when
    `worker_host` is not loopback, and by `sluice gateway` and `sluice worker`."""
    worker_tls_cert: str = ""
    """PEM certificate (chain) of the worker port: the port speaks TLS when set."""
    worker_tls_key: str = ""
    """The PEM private key of `worker_tls_cert` (set both or neither)."""
    worker_tls_ca: str = ""
    """Worker side: verify the gateway's certificate against this CA file; setting it turns TLS on."""
    metrics_token: str = ""
    """`GET /metrics` needs `Authorization: Bearer <metrics_token>` (or the admin token); empty = the
    admin token only."""
    metrics_max_tenants: int = 100
    """Per-tenant Prometheus series (TTFT/ITL histograms, queue depth, admitted/rejected, tokens)
    for at most this many tenants per gateway process, the first seen; later tenants are counted
    under the label `tenant="other"`. Each tenant adds about 60 series per model and class it uses."""
    anonymous_tokenize: bool = False
    """Serve `POST /tokenize` and `/detokenize` without an Authorization header (as vLLM serves them,
    for `vllm bench serve`); off: a tenant key is needed and scopes them to its models."""
    # Cheap limits checked before any tokenization (400 without spending CPU on the prompt).
    max_prompt_chars: int = 1_048_576
    """Characters of a prompt, or of all messages' content together; more is refused with 400
    before any tokenization."""
    max_messages: int = 2048
    """Messages of one chat request (OpenAI's own limit); more is refused with 400 before any
    tokenization."""
    max_n: int = 8
    """Choices of one answer (`n`); more is refused with 400. Each choice is its own engine request
    (sharing the prompt's KV through the prefix cache), admitted against the quotas as one (the
    prompt's tokens counted once per answer)."""
    max_body_bytes: int = 8 * 2**20
    """Largest request body in bytes; a larger one gets 413."""
    swagger_ui: bool = False
    """Serve the Swagger UI at `/schema`. Its scripts load from a public CDN and run on the
    gateway's origin (the console's), so it is opt-in; `/schema/openapi.json` is always served."""
    max_file_storage_bytes: int = 2**30
    """Bytes of files (Batch API uploads and outputs together) a tenant may keep; an upload that
    would pass it gets 400 `file_storage_exceeded`."""
    request_timeout_s: float = 600.0
    """Deadline of an API request from its acceptance to its end, the wait for a worker included:
    past it the request is stopped and the client gets 504 `request_timeout` (batch lines are bounded
    by their completion window instead)."""
    stream_retention_s: float = 300.0
    """A streamed response's events are kept this long after the last one, for clients that attach
    again (`GET .../{id}/events`, or the POST re-sent with its Idempotency-Key; docs/streams.md)."""
    disconnect_grace_s: float = 30.0
    """A stream whose client went away keeps generating this long for a client to attach again,
    then is aborted; 0 = abort at once (a tenant's own grace, or a request's `X-Sluice-Disconnect:
    abort`, can shorten it)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM the gateway drains: new requests get 503, open ones run on for at most this long,
    then the rest are closed and the process exits 0 (docs/runbook.md)."""
    key_cache_ttl_s: float = 30.0
    """How long each gateway process caches an API key lookup (admin changes evict it at once, on
    every replica when the state is shared)."""
    record_log_path: str = ""
    """Append one JSON line per finished request to this file; empty = the `sluice.records` logger
    only (at INFO). With a file, the logger gets each record at DEBUG only (off the terminal)."""


class AdminSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    token: str = ""
    """The admin token (at least 16 characters). Set: the only admin token, never stored (generated
    ones are deleted); changing it ends every console session. Empty: the first start generates one,
    stores it hashed and shows it once."""
    demo_tenant: str = "demo-chat"
    """`sluice serve` keeps one expiring API key for this seed tenant (created once, shown once);
    empty = no demo key (production)."""
    demo_key_ttl_days: int = 7
    """Days a new demo key stays valid (at least 1)."""
    console_session_ttl_s: float = 8 * 3600.0
    """How long a sign-in to the web console (`/console`) lasts."""
    console_secure_cookie: bool = False
    """Mark the console's session cookie Secure (always done when the request came over https)."""
    max_failed_sign_ins: int = 10
    """Wrong admin tokens one source address may send per minute (console sign-in and `/admin`
    together) before it gets 429, the right token included, until the oldest leaves the minute."""


class DatabaseSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: str = "sqlite+aiosqlite:///./var/sluice.db"
    """SQLAlchemy URL of the gateway database: `sqlite+aiosqlite:///PATH` or
    `postgresql+asyncpg://USER:PASSWORD@HOST/DB` (plain `sqlite://` and `postgresql://` get those
    drivers). The gateway migrates it at start (docs/upgrading.md)."""
    echo: bool = False
    """Log every SQL statement (SQLAlchemy's `echo`)."""


class KafkaSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    bootstrap_servers: str = ""
    """Kafka's bootstrap servers, `HOST:PORT[,HOST:PORT...]`; empty = `sluice serve` starts the
    embedded broker (`sluice gateway` requires a value)."""
    enable_idempotence: bool = False
    """Idempotent producer: set it on Apache Kafka; the embedded broker (Tansu 0.6) rejects it."""
    topic_prefix: str = "sluice"
    """The class topics are `<topic_prefix>.requests.interactive`, `.standard` and `.batch`."""
    partitions: int = 4
    """Partitions of a class topic the gateway creates (existing topics are left as they are)."""
    replication_factor: int = 1
    """Replication factor of a class topic the gateway creates (3 on a real cluster)."""
    retention_ms: int = 7 * 24 * 3600 * 1000
    """Retention of a class topic the gateway creates, in milliseconds."""
    consumer_group: str = ""
    """The gateways' consumer group; empty = `<topic_prefix>-gateway`, so deployments (or test
    clusters) with their own topics on one Kafka cluster never share a group: a group's rebalance
    waits for every member, whatever topics it reads."""
    max_request_bytes: int = 4 * 2**20
    """Largest request record the producer writes and a fetch of one partition reads, in bytes."""
    produce_timeout_s: float = 5.0
    """A request the broker has not acknowledged by then gets a 503."""
    fetch_max_wait_ms: int = 100
    """How long a fetch of the batch topic may wait at the broker for new records (the interactive
    and standard topics wait 250 ms: their records are dispatched when accepted). Tansu parks a
    fetch for this long even when records arrive meanwhile, so it bounds the admission latency of
    batch-class work there (Kafka's default 500 ms measured ~200 ms produce to consume; 10 ms ~4 ms),
    and each consumer fetches about 1000/wait times a second, idle or not (10 ms: 13 % of a core
    for the gateway and the broker together with nothing to do)."""
    session_timeout_ms: int = 6000
    """A gateway replica that stops heartbeating (a SIGKILLed one) loses its partitions to the other
    replicas once its session times out. Apache Kafka refuses a session below its
    group.min.session.timeout.ms (6 s by default); Tansu 0.6 takes any, and moves a dead member's
    partitions after ~1.7-2x the session timeout (measured: 1.5 s -> 3 s, 6 s -> 10 s)."""
    heartbeat_interval_ms: int = 1000
    """The consumer's heartbeat; must be below `session_timeout_ms` (a third of it, usually)."""


class BrokerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    """Address the embedded broker of `sluice serve` listens on."""
    port: int = 0
    """Its port; 0 = a free port."""
    storage: str = "memory"
    """`memory` (records, topics and offsets live as long as the broker process) or `s3://BUCKET`
    (they survive a restart; `AWS_*` variables name the endpoint)."""


class SchedulerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    aging_s: float = 30.0
    """Anti-starvation between classes: a lower class is served first once its oldest request has
    waited this long."""
    min_share_standard: float = 0.05
    """The standard class gets at least this share of dispatches while it is backlogged."""
    min_share_batch: float = 0.02
    """The batch class gets at least this share of dispatches while it is backlogged."""
    priority_enabled: bool = True
    """False: one lane for all classes (the isolation experiment's control arm)."""
    max_backlog_per_class: int = 2000
    """Requests held in memory per class; above it the class topic's consumer is paused (Kafka holds
    the rest). Streams count toward it but are dispatched at acceptance all the same (the quotas'
    `max_queued` bounds them)."""


class DispatchSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_worker_waiting: int = 2
    """Keep each worker's own waiting queue this short, so priority and fairness are decided at the
    gateway (an upstream of kind `vllm`: its reported queue)."""
    heartbeat_interval_s: float = 1.0
    """Seconds between a worker's heartbeats (`sluice worker --heartbeat-interval` wins), and between
    probes of an upstream."""
    heartbeat_timeout_s: float = 5.0
    """A worker not heard from for this long is dropped; its unfinished requests go on elsewhere."""
    local_workers: int = 1
    """Worker processes per model that `sluice serve` starts (`--workers`); 0 = none."""
    announce_grace_s: float = 60.0
    """After start, every configured model is accepted for this long while workers (re)connect; then
    only models some worker announced (a model whose workers are all down keeps being accepted)."""


RoutingPolicy = Literal["least_loaded", "round_robin", "cache_aware"]


class RoutingSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which worker a dispatched request goes to (docs/routing.md). The fair scheduler decides which
    request goes next; routing decides where."""

    policy: RoutingPolicy = "least_loaded"
    """`least_loaded`: the worker with the fewest running and waiting requests per slot;
    `round_robin`: each worker in turn; `cache_aware`: the lowest predicted cost, the prompt tokens
    a worker would have to prefill (those not in its prefix cache, from its KV events) plus its load."""
    load_cost_tokens: int = 2048
    """cache_aware: a worker's load in prefill tokens: a worker whose running and waiting requests
    fill its `max_num_seqs` (load 1.0) costs this many tokens more than an idle one."""
    spread_margin: float = 0.5
    """cache_aware: a worker holding the prompt's prefix is passed over for the least loaded one when
    its load exceeds the least loaded's by more than this (a hot prefix spreads, no worker is driven
    into overload)."""
    balance_margin: float = 0.2
    """cache_aware: a worker this gateway sent more than (1 + this) times the candidates' mean of
    recent work (each request's max_tokens plus 1/12 per prompt token it must prefill there; a 20 s
    half-life; and more than half the request's work on the cheapest other worker over that mean,
    so moving it narrows the gap) is passed over like a loaded one for a request whose leading
    block is hot there (a third of its recent work or more): no worker does much more than its
    share while every load reads 0, and the hot prefix is what moves."""
    max_index_blocks: int = 1_000_000
    """Prefix-cache block hashes the gateway remembers per worker (90-110 MB per million); past it
    the least recently stored are forgotten."""
    upstream_block_size: int = 16
    """Block size of the approximate index kept for an upstream (it sends no KV events)."""

    def __post_init__(self) -> None:
        if self.load_cost_tokens < 0:
            raise ValueError(f"routing.load_cost_tokens must be 0 or more, got {self.load_cost_tokens}")
        if not self.spread_margin >= 0:
            raise ValueError(f"routing.spread_margin must be 0 or more, got {self.spread_margin}")
        if not self.balance_margin >= 0:
            raise ValueError(f"routing.balance_margin must be 0 or more, got {self.balance_margin}")
        if self.max_index_blocks < 1:
            raise ValueError(f"routing.max_index_blocks must be positive, got {self.max_index_blocks}")
        if self.upstream_block_size < 1:
            raise ValueError(f"routing.upstream_block_size must be positive, got {self.upstream_block_size}")


class SharedSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where gateway replicas share quota counters and cache invalidations (docs/scale-out.md)."""

    url: str = ""
    """Empty = in this process (one gateway); `redis://HOST[:PORT][/DB]` (`rediss://` for TLS) =
    Redis, shared by the replicas: quota counters, worker slots, fairness counters, stream logs and
    cache invalidations. Required by `sluice serve --replicas N` with N > 1."""
    lease_s: float = 10.0
    """A replica that stops renewing (killed, hung, cut off) has its holds released after this long."""
    prefix: str = "sluice"
    """Of every Redis key and channel: one per deployment (several deployments on one Redis). A
    gateway refuses to start under a prefix another deployment (another database) holds."""


class TracingSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """OpenTelemetry traces of requests across the gateway and the workers (docs/measuring.md)."""

    enabled: bool = False
    """Export spans over OTLP/HTTP; needs the OpenTelemetry SDK (`pip install 'sluice[tracing]'`).
    Gateways and workers read it (set it on both)."""
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """Where spans go: an OpenTelemetry Collector's (or Jaeger's, Tempo's) OTLP/HTTP traces URL."""
    sample_ratio: float = 1.0
    """Share of traces kept (0..1) for requests without a sampled `traceparent`; a client's sampled
    flag is followed."""


def _installed(*modules: str) -> bool:
    import importlib.util

    try:
        return all(importlib.util.find_spec(name) is not None for name in modules)
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_shared_url(url: str) -> None:
    """Raises ValueError unless `url` is empty or redis://HOST[:PORT][/DB] (rediss:// for TLS).
    The messages never repeat the URL: it may hold a password."""
    if not url:
        return
    from urllib.parse import urlsplit

    expected = "expected redis://HOST[:PORT][/DB] (empty = in-process)"
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"url must start with redis:// or rediss://; {expected}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"url has a port that is not 1..65535; {expected}") from None
    if not parts.hostname:
        raise ValueError(f"url names no host; {expected}")
    if port == 0:
        raise ValueError(f"url has a port that is not 1..65535; {expected}")
    database = parts.path.strip("/")
    if database and not database.isdigit():
        raise ValueError(f"url: the database after the host must be a number; {expected}")


class ObjectiveSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Latency objectives per class (docs/objectives.md); a tenant's own targets replace the
    interactive and standard ones for its requests. TOML has no null: a class keeps a target it has
    by default; a very large value makes it lax."""

    percentile: float = 95.0
    """The percentile at which the targets are met (SLO attainment is reported against it), in (0, 100]."""
    interactive_ttft_s: float | None = 3.0
    """Interactive class: time to first token target, seconds (the source articles' 3 s)."""
    interactive_itl_s: float | None = 0.3
    """Interactive class: inter-token latency target, seconds (the articles' 100-300 ms per token)."""
    standard_ttft_s: float | None = 10.0
    """Standard class: time to first token target, seconds."""
    standard_itl_s: float | None = 1.0
    """Standard class: inter-token latency target, seconds."""
    batch_ttft_s: float | None = None
    """Batch class: time to first token target, seconds; unset = none (throughput only)."""
    batch_itl_s: float | None = None
    """Batch class: inter-token latency target, seconds; unset = none (throughput only)."""


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    """The model name clients send and workers announce."""
    path: str
    """A local Hugging Face directory (`config.json`, `*.safetensors`, `tokenizer.json`): the gateway
    reads its tokenizer, workers its weights."""
    demo: bool = False
    """A tiny random-weight model, created by `sluice model make-demo` when absent; served by `sluice
    serve --demo` (or when no other model is listed)."""
    fetch: str | None = None
    """A known model (`smollm2`) that `sluice model fetch NAME` creates when absent; not with demo."""
    tool_parser: str | None = None
    """How the model writes tool calls: `hermes` (`<tool_call>` JSON; Hermes, Qwen), `llama3_json` or
    `mistral` (`[TOOL_CALLS]`). Unset: read from the chat template (hermes for a template without
    tool support, which gets the documented fallback system message)."""


class QuotaSeed(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    requests_per_minute: int | None = None
    """Requests admitted per sliding minute."""
    tokens_per_minute: int | None = None
    """Tokens per sliding minute: prompt + max_tokens reserved at admission, settled to the real
    count at the end."""
    tokens_per_day: int | None = None
    """Tokens per UTC day (the daily budget)."""
    max_concurrent: int | None = None
    """Requests queued or running at once."""
    max_queued: int | None = None
    """Requests queued (not yet running) at once."""
    max_prompt_tokens: int | None = None
    """Prompt tokens of one request (400 above it)."""
    max_output_tokens: int | None = None
    """`max_tokens` of one request (400 above it)."""


class TenantSeed(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    """Unique. Seeding is by name: a tenant that exists already is left as it is."""
    description: str = ""
    """Free text, shown in the console and the admin API."""
    priority_ceiling: ClassName = "standard"
    """The most urgent class the tenant's requests get (interactive > standard > batch)."""
    default_class: ClassName = "standard"
    """The class of a request that asks for none (capped by the ceiling)."""
    weight: float = 1.0
    """Fair-share weight inside a class (positive)."""
    allowed_models: tuple[str, ...] = ()
    """Models the tenant may use (names from models.toml); empty = every model."""
    quotas: QuotaSeed = msgspec.field(default_factory=QuotaSeed)
    """The tenant's limits (`[tenants.quotas]`); an omitted key is unlimited."""


UpstreamKind = Literal["openai", "vllm"]


class UpstreamSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An OpenAI-compatible server that serves some of the gateway's models (docs/upstreams.md).

    The gateway keeps the queue: it tokenizes with its own copy of the model (models.toml) and
    forwards token-id prompts to `/v1/completions` only while the upstream has room."""

    name: str
    """Unique, without spaces or `/`; the upstream shows as worker `upstream/NAME`."""
    base_url: str
    """The server's root, `http(s)://HOST[:PORT][/PREFIX]`; a trailing /v1 is dropped, credentials
    are refused (use `api_key_env`)."""
    api_key_env: str = ""
    """The API key is read from this environment variable at start (never from a file); empty = none."""
    models: tuple[str, ...]
    """Names from models.toml (their tokenizer and max length are the gateway's)."""
    served_names: dict[str, str] = msgspec.field(default_factory=dict)
    """Model name -> the upstream's name for it, where they differ."""
    max_concurrency: int = 64
    """Requests sent and not finished, at most (per gateway replica)."""
    kind: UpstreamKind = "openai"
    """`vllm`: also poll `GET /metrics` every second and forward only while its
    `vllm:num_requests_waiting` is under `dispatch.max_worker_waiting`; `openai`: the cap alone."""
    priority: bool = False
    """Pass the class to vLLM's `priority` field (a server run with `--scheduling-policy priority`)."""
    max_num_seqs: int = 0
    """Kind `vllm`: the server's batch size (its `--max-num-seqs`, which it does not publish). Jobs
    that its batch can take at once (this minus the jobs running there, none while its
    `vllm:kv_cache_usage_perc` is 95 % or more) do not count as waiting, so the server is fed as
    deep as its batch goes; 0 = unknown: only its short queue (`dispatch.max_worker_waiting`)."""
    request_timeout_s: float = 600.0
    """One request, connection to last byte."""
    connect_timeout_s: float = 5.0
    """Connecting to the server."""
    kv_events_endpoint: str = ""
    """Kind `vllm`: the ZMQ endpoint where the server publishes its KV events
    (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    "tcp://*:5557"}'`), e.g. `tcp://vllm-0:5557`: cache-aware routing then knows exactly what it
    caches. Empty: an approximate index from what this gateway sent there (docs/routing.md)."""
    kv_events_topic: str = ""
    """The topic the server publishes its KV events under (its `--kv-events-config` `topic`)."""


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    gateway: GatewaySettings = msgspec.field(default_factory=GatewaySettings)
    admin: AdminSettings = msgspec.field(default_factory=AdminSettings)
    database: DatabaseSettings = msgspec.field(default_factory=DatabaseSettings)
    kafka: KafkaSettings = msgspec.field(default_factory=KafkaSettings)
    broker: BrokerSettings = msgspec.field(default_factory=BrokerSettings)
    scheduler: SchedulerSettings = msgspec.field(default_factory=SchedulerSettings)
    dispatch: DispatchSettings = msgspec.field(default_factory=DispatchSettings)
    routing: RoutingSettings = msgspec.field(default_factory=RoutingSettings)
    shared: SharedSettings = msgspec.field(default_factory=SharedSettings)
    tracing: TracingSettings = msgspec.field(default_factory=TracingSettings)
    objectives: ObjectiveSettings = msgspec.field(default_factory=ObjectiveSettings)
    # Engine options for workers: keys of sluice.workers.config.EngineConfig (validated there).
    engine: dict[str, Any] = msgspec.field(default_factory=dict)
    models: tuple[ModelSpec, ...] = ()
    tenants: tuple[TenantSeed, ...] = ()
    upstreams: tuple[UpstreamSpec, ...] = ()
    config_dir: str = "config"


_SECTIONS = ("gateway", "admin", "database", "kafka", "broker", "scheduler", "dispatch", "routing", "shared",
             "tracing", "objectives", "engine")
_FILES = {"sluice.toml": None, "models.toml": "models", "tenants.toml": "tenants", "upstreams.toml": "upstreams"}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror}") from None


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _env_overrides(environ: dict[str, str]) -> dict[str, dict[str, tuple[str, Any]]]:
    """{section: {key: (variable name, value)}} from SLUICE_<SECTION>_<KEY> variables."""
    found: dict[str, dict[str, tuple[str, Any]]] = {}
    for name, raw in environ.items():
        if not name.startswith("SLUICE_"):
            continue
        rest = name[len("SLUICE_"):].lower()
        for section in _SECTIONS:
            if rest.startswith(section + "_"):
                key = rest[len(section) + 1:]
                found.setdefault(section, {})[key] = (name, _parse_env_value(raw))
                break
    return found


_SECTION_TYPES: dict[str, type[msgspec.Struct]] = {
    "gateway": GatewaySettings, "admin": AdminSettings, "database": DatabaseSettings,
    "kafka": KafkaSettings, "broker": BrokerSettings, "scheduler": SchedulerSettings,
    "dispatch": DispatchSettings, "routing": RoutingSettings, "shared": SharedSettings,
    "tracing": TracingSettings, "objectives": ObjectiveSettings,
}


def _check_keys(section: str, values: dict[str, Any], source: str) -> None:
    section_type = _SECTION_TYPES.get(section)
    if section_type is None:  # [engine] is checked against EngineConfig after conversion
        return
    for key in values:
        if key not in section_type.__struct_fields__:
            known = ", ".join(section_type.__struct_fields__)
            raise ConfigError(f"{source}: unknown key {key!r} in [{section}]; known keys: {known}")


def _check_semantics(settings: Settings, sources: dict[str, str]) -> None:
    """Checks that need more than types: engine keys, unique names, positive numbers."""
    from sluice.workers.config import EngineConfig

    engine_source = sources.get("engine", "[engine]")
    for key in ("model", "device"):
        if key in settings.engine:
            raise ConfigError(f"{engine_source}: [engine] {key} is set per worker (sluice worker --{key})")
    known = [name for name in EngineConfig.__dataclass_fields__ if name not in ("model", "device")]
    for key in settings.engine:
        if key not in known:
            raise ConfigError(f"{engine_source}: unknown key {key!r} in [engine]; known keys: {', '.join(known)}")
    try:
        EngineConfig(model="(per worker)", **settings.engine)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{engine_source}: [engine] {exc}") from None
    for section, key in (("gateway", "port"), ("gateway", "worker_port"), ("broker", "port")):
        port = getattr(getattr(settings, section), key)
        if not 0 <= port < 65536:
            raise ConfigError(f"{sources.get(section, section)}: [{section}] {key} must be 0..65535, got {port}")
    gw, gw_source = settings.gateway, sources.get("gateway", "[gateway]")
    if gw.worker_secret and len(gw.worker_secret) < 16:
        raise ConfigError(f"{gw_source}: [gateway] worker_secret must be at least 16 characters")
    if settings.admin.token and len(settings.admin.token) < 16:
        raise ConfigError(f"{sources.get('admin', '[admin]')}: [admin] token (SLUICE_ADMIN_TOKEN) must be at least "
                          "16 characters (a random one, e.g. from `openssl rand -base64 32`)")
    if bool(gw.worker_tls_cert) != bool(gw.worker_tls_key):
        raise ConfigError(f"{gw_source}: [gateway] worker_tls_cert and worker_tls_key are set together")
    for key in ("max_prompt_chars", "max_messages", "max_n", "metrics_max_tenants"):
        if getattr(gw, key) < 1:
            raise ConfigError(f"{gw_source}: [gateway] {key} must be at least 1, got {getattr(gw, key)}")
    shared, shared_source = settings.shared, sources.get("shared", "[shared]")
    try:
        check_shared_url(shared.url)
    except ValueError as exc:
        raise ConfigError(f"{shared_source}: [shared] {exc}") from None
    if not shared.lease_s > 0:
        raise ConfigError(f"{shared_source}: [shared] lease_s must be positive, got {shared.lease_s}")
    if not shared.prefix or any(c.isspace() for c in shared.prefix):
        raise ConfigError(f"{shared_source}: [shared] prefix must be non-empty, without spaces")
    if settings.tracing.enabled and not _installed("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        raise ConfigError(f"{sources.get('tracing', '[tracing]')}: [tracing] enabled needs the OpenTelemetry SDK "
                          "and OTLP exporter: pip install 'sluice[tracing]'")
    if not 0.0 <= settings.tracing.sample_ratio <= 1.0:
        raise ConfigError(f"{sources.get('tracing', '[tracing]')}: [tracing] sample_ratio must be 0..1, "
                          f"got {settings.tracing.sample_ratio}")
    kafka = settings.kafka
    if not 0 < kafka.heartbeat_interval_ms < kafka.session_timeout_ms:
        raise ConfigError(f"{sources.get('kafka', '[kafka]')}: [kafka] heartbeat_interval_ms must be positive and "
                          f"below session_timeout_ms (a third of it is usual), got {kafka.heartbeat_interval_ms} "
                          f"and {kafka.session_timeout_ms}")
    if settings.admin.demo_key_ttl_days < 1:
        raise ConfigError(f"{sources.get('admin', '[admin]')}: [admin] demo_key_ttl_days must be at least 1")
    if settings.admin.max_failed_sign_ins < 1:
        raise ConfigError(f"{sources.get('admin', '[admin]')}: [admin] max_failed_sign_ins must be at least 1")
    if not settings.admin.console_session_ttl_s > 0:
        raise ConfigError(f"{sources.get('admin', '[admin]')}: [admin] console_session_ttl_s must be positive, "
                          f"got {settings.admin.console_session_ttl_s}")
    _check_objectives(settings.objectives, sources.get("objectives", "[objectives]"))
    from sluice.workers.model.fetch import KNOWN_MODELS

    names = [model.name for model in settings.models]
    models_source = sources.get("models", "models.toml")
    if len(set(names)) != len(names):
        raise ConfigError(f"{models_source}: model names must be unique, got {names}")
    for model in settings.models:
        if model.fetch is not None and model.fetch not in KNOWN_MODELS:
            raise ConfigError(f"{models_source}: model {model.name!r}: fetch = {model.fetch!r} is not a known "
                              f"model; known: {', '.join(KNOWN_MODELS)}")
        if model.fetch is not None and model.demo:
            raise ConfigError(f"{models_source}: model {model.name!r}: set demo or fetch, not both")
        if model.tool_parser is not None and model.tool_parser not in ("hermes", "llama3_json", "mistral"):
            raise ConfigError(f"{models_source}: model {model.name!r}: tool_parser = {model.tool_parser!r}; "
                              "expected hermes, llama3_json or mistral")
    _check_upstreams(settings.upstreams, names, sources.get("upstreams", "upstreams.toml"))
    tenant_source = sources.get("tenants", "tenants.toml")
    seen: set[str] = set()
    for tenant in settings.tenants:
        if not tenant.name or tenant.name in seen:
            raise ConfigError(f"{tenant_source}: tenant name {tenant.name!r} is empty or repeated")
        seen.add(tenant.name)
        if not tenant.weight > 0:
            raise ConfigError(f"{tenant_source}: tenant {tenant.name!r}: weight must be positive")
        for key in QuotaSeed.__struct_fields__:
            value = getattr(tenant.quotas, key)
            if value is not None and value < 0:
                raise ConfigError(f"{tenant_source}: tenant {tenant.name!r}: quotas.{key} must be >= 0")
        unknown_models = set(tenant.allowed_models) - set(names) if names else set()
        if unknown_models:
            raise ConfigError(
                f"{tenant_source}: tenant {tenant.name!r}: allowed_models names unknown model(s) "
                f"{sorted(unknown_models)}"
            )


def _check_objectives(objectives: ObjectiveSettings, source: str) -> None:
    if not 0 < objectives.percentile <= 100:
        raise ConfigError(f"{source}: [objectives] percentile must be in (0, 100], got {objectives.percentile}")
    for key in ObjectiveSettings.__struct_fields__:
        if key != "percentile":
            try:
                check_target(key, getattr(objectives, key))
            except ValueError as exc:
                raise ConfigError(f"{source}: [objectives] {exc}") from None


def upstream_root(base_url: str) -> str:
    """The server root of an upstream's base_url (a trailing slash and /v1 dropped)."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def _check_upstreams(upstreams: tuple[UpstreamSpec, ...], models: list[str], source: str) -> None:
    """Names unique, URLs http(s) with a host, models known. Messages never repeat a URL (it may
    carry credentials)."""
    from urllib.parse import urlsplit

    seen: set[str] = set()
    for up in upstreams:
        if not up.name or up.name in seen or any(c.isspace() or c == "/" for c in up.name):
            raise ConfigError(f"{source}: upstream name {up.name!r} is empty, repeated, or has spaces or '/'")
        seen.add(up.name)
        where = f"{source}: upstream {up.name!r}"
        parts = urlsplit(up.base_url)
        try:
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ConfigError(f"{where}: base_url has a port that is not 1..65535") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ConfigError(f"{where}: base_url must be http(s)://HOST[:PORT][/PREFIX]")
        if parts.username or parts.password:
            raise ConfigError(f"{where}: base_url must not carry credentials; use api_key_env")
        if up.api_key_env and not up.api_key_env.replace("_", "a").isalnum():
            raise ConfigError(f"{where}: api_key_env must name an environment variable (letters, digits, _)")
        if not up.models:
            raise ConfigError(f"{where}: models must list at least one model")
        unknown = sorted(set(up.models) - set(models))
        if unknown:
            raise ConfigError(f"{where}: models {unknown} are not in models.toml (the gateway tokenizes "
                              "with its own copy of each model)")
        extra = sorted(set(up.served_names) - set(up.models))
        if extra:
            raise ConfigError(f"{where}: served_names names model(s) {extra} that are not in its models")
        if up.max_concurrency < 1:
            raise ConfigError(f"{where}: max_concurrency must be at least 1, got {up.max_concurrency}")
        if up.max_num_seqs < 0:
            raise ConfigError(f"{where}: max_num_seqs must be 0 (unknown) or positive, got {up.max_num_seqs}")
        for key in ("request_timeout_s", "connect_timeout_s"):
            if not getattr(up, key) > 0:
                raise ConfigError(f"{where}: {key} must be positive, got {getattr(up, key)}")
        if up.kv_events_endpoint:
            events = urlsplit(up.kv_events_endpoint)
            if up.kind != "vllm":
                raise ConfigError(f"{where}: kv_events_endpoint needs kind = \"vllm\" (only vLLM publishes KV events)")
            if events.scheme not in ("tcp", "ipc") or (events.scheme == "tcp" and not events.hostname):
                raise ConfigError(f"{where}: kv_events_endpoint must be tcp://HOST:PORT or ipc://PATH")


def load_settings(config_dir: str | Path | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Load and validate settings; raises ConfigError with file, key and problem."""
    environ = dict(os.environ if environ is None else environ)
    directory = Path(config_dir or environ.get("SLUICE_CONFIG_DIR") or "config")
    explicit = config_dir is not None or "SLUICE_CONFIG_DIR" in environ
    if explicit and not directory.is_dir():
        raise ConfigError(f"config directory {directory} does not exist (SLUICE_CONFIG_DIR / --config)")
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for filename, key in _FILES.items():
        path = directory / filename
        if not path.exists():
            continue
        content = _read_toml(path)
        if key is None:
            for section, values in content.items():
                if section not in _SECTIONS:
                    raise ConfigError(
                        f"{path}: unknown section [{section}]; known sections: {', '.join(_SECTIONS)}"
                    )
                if not isinstance(values, dict):
                    raise ConfigError(f"{path}: {section} must be a table ([{section}])")
                _check_keys(section, values, str(path))
                data[section] = values
                sources[section] = str(path)
        else:
            unknown = set(content) - {key}
            if unknown:
                raise ConfigError(f"{path}: unexpected top-level key(s) {sorted(unknown)}; expected [[{key}]]")
            data[key] = content.get(key, [])
            sources[key] = str(path)
    for section, overrides in _env_overrides(environ).items():
        values = dict(data.get(section, {}))
        for key, (variable, value) in overrides.items():
            _check_keys(section, {key: value}, f"environment variable {variable}")
            values[key] = value
        sources[section] = f"{sources.get(section, 'defaults')} + environment (SLUICE_{section.upper()}_*)"
        data[section] = values
    data["config_dir"] = str(directory)
    try:
        settings = msgspec.convert(data, Settings, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        # msgspec says "... - at `$.gateway.port`": name the file that section came from.
        section = message.split("`$.", 1)[1].split(".", 1)[0].split("[", 1)[0].rstrip("`") if "`$." in message else ""
        source = sources.get(section, str(directory))
        raise ConfigError(f"{source}: {message}") from None
    _check_semantics(settings, sources)
    return settings
