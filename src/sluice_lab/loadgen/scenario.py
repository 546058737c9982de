"""Scenario files (TOML) for `sluice bench serve`: who sends what, when, and how it is judged.

    name = "chat"
    model = "demo"                  # the `model` field of every request
    endpoint = "chat"               # "chat" (/v1/chat/completions) or "completions"
    duration_s = 60                 # stop issuing new requests after this long
    max_requests = 400              # ... or after this many
    seed = 0
    tokenizer = ""                  # optional model dir: calibrates synthetic prompt lengths
    [slo]
    ttft_s = 3.0
    itl_s = 0.3
    [[tenants]]
    name = "chat-app"
    api_key_env = "SLUICE_KEY_CHAT" # or api_key = "sk-..." inline
    [[workloads]]
    name = "chat"
    tenant = "chat-app"
    service_tier = "priority"       # OpenAI service_tier -> sluice class (omit for the default)
    arrival = { process = "poisson", rate = 2.0 }    # or gamma (rate, cv) or closed (concurrency)
    bursts = [{ at_s = 10.0, count = 20 }]
    prompt_tokens = { dist = "lognormal", median = 200, sigma = 0.5, min = 16, max = 1024 }
    output_tokens = { dist = "fixed", value = 128 }  # uniform (min, max) or file (path, field)
    ignore_eos = true
    api = "stream"                  # or "batch": lines go through /v1/files + /v1/batches
    batch_lines = 200               # batch only: number of lines in the batch
    batch_poll_s = 1.0

Every problem is a ValueError naming the file, the key and the fault.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice_lab.loadgen.prompts import LengthDist, lengths_from_jsonl

_TOP_KEYS = {"name", "description", "model", "endpoint", "duration_s", "max_requests", "seed",
             "tokenizer", "slo", "tenants", "workloads"}
_TENANT_KEYS = {"name", "api_key", "api_key_env"}
_WORKLOAD_KEYS = {"name", "tenant", "service_tier", "arrival", "bursts", "prompt_tokens",
                  "output_tokens", "ignore_eos", "temperature", "api", "batch_lines", "batch_poll_s"}
_ARRIVAL_KEYS = {"poisson": {"process", "rate"}, "gamma": {"process", "rate", "cv"},
                 "closed": {"process", "concurrency", "think_s"}}
_DIST_KEYS = {"fixed": {"dist", "value"}, "uniform": {"dist", "min", "max"},
              "lognormal": {"dist", "median", "sigma", "min", "max"}, "file": {"dist", "path", "field"}}
SERVICE_TIERS = ("priority", "default", "auto", "flex")


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 3.0
    itl_s: float = 0.3

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft=3s,itl=300ms` (units s or ms; a bare number is seconds)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            if not sep or key.strip() not in ("ttft", "itl"):
                raise ValueError(f"--slo: expected ttft=VALUE and/or itl=VALUE, got {part!r}")
            values[key.strip()] = _parse_duration(raw.strip(), f"--slo {key.strip()}")
        default = cls()
        return cls(ttft_s=values.get("ttft", default.ttft_s), itl_s=values.get("itl", default.itl_s))


def _parse_duration(raw: str, what: str) -> float:
    scale = 1.0
    if raw.endswith("ms"):
        raw, scale = raw[:-2], 1e-3
    elif raw.endswith("s"):
        raw = raw[:-1]
    try:
        value = float(raw) * scale
    except ValueError:
        raise ValueError(f"{what}: {raw!r} is not a duration (use e.g. 3s or 300ms)") from None
    if not value > 0:
        raise ValueError(f"{what}: must be positive")
    return value


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    api_key: str = field(repr=False)  # never printed


@dataclass(frozen=True, slots=True)
class Arrival:
    process: str  # poisson | gamma | closed
    rate: float = 0.0  # requests/s (poisson, gamma)
    cv: float = 1.0  # gamma: coefficient of variation of inter-arrival gaps (1 = Poisson)
    concurrency: int = 0  # closed loop: requests in flight
    think_s: float = 0.0  # closed loop: pause between a reply and the next request


@dataclass(frozen=True, slots=True)
class Burst:
    at_s: float
    count: int


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    tenant: Tenant
    arrival: Arrival
    prompt_tokens: LengthDist
    output_tokens: LengthDist
    service_tier: str | None = None
    bursts: tuple[Burst, ...] = ()
    ignore_eos: bool = True
    temperature: float = 0.0
    api: str = "stream"  # stream | batch
    batch_lines: int = 0
    batch_poll_s: float = 1.0


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    model: str
    endpoint: str
    workloads: tuple[Workload, ...]
    slo: Slo
    duration_s: float = 60.0
    max_requests: int = 0  # 0 = no cap
    seed: int = 0
    tokenizer: str = ""
    description: str = ""


class _Ctx:
    """Collects the file name for error messages."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, key: str, problem: str) -> ValueError:
        return ValueError(f"{self.path}: {key}: {problem}")

    def table(self, value: Any, key: str, allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a table, got {type(value).__name__}")
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise self.fail(f"{key}.{unknown[0]}", f"unknown key (allowed: {', '.join(sorted(allowed))})")
        return value

    def number(self, table: dict[str, Any], key: str, where: str, *, default: float | None = None,
               positive: bool = True, allow_zero: bool = False) -> float:
        if key not in table:
            if default is None:
                raise self.fail(f"{where}.{key}", "is required")
            return default
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"{where}.{key}", f"must be a number, got {value!r}")
        if positive and (value < 0 or (value == 0 and not allow_zero)):
            raise self.fail(f"{where}.{key}", f"must be {'non-negative' if allow_zero else 'positive'}, "
                                              f"got {value}")
        return float(value)

    def integer(self, table: dict[str, Any], key: str, where: str, *, default: int | None = None,
                minimum: int = 1) -> int:
        if key not in table:
            if default is None:
                raise self.fail(f"{where}.{key}", "is required")
            return default
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{where}.{key}", f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.fail(f"{where}.{key}", f"must be at least {minimum}, got {value}")
        return value

    def string(self, table: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
        if key not in table:
            if default is None:
                raise self.fail(f"{where}.{key}", "is required")
            return default
        value = table[key]
        if not isinstance(value, str):
            raise self.fail(f"{where}.{key}", f"must be a string, got {value!r}")
        return value


def _dist(ctx: _Ctx, raw: Any, where: str, base: Path) -> LengthDist:
    if not isinstance(raw, dict) or raw.get("dist") not in _DIST_KEYS:
        raise ctx.fail(f"{where}.dist", f"must be one of {', '.join(_DIST_KEYS)}")
    kind = raw["dist"]
    table = ctx.table(raw, where, _DIST_KEYS[kind])
    if kind == "fixed":
        return LengthDist("fixed", value=ctx.integer(table, "value", where))
    if kind == "file":
        path = base / ctx.string(table, "path", where)
        if not path.is_file():
            raise ctx.fail(f"{where}.path", f"no such file: {path}")
        return LengthDist("file", values=lengths_from_jsonl(path, ctx.string(table, "field", where)))
    low = ctx.integer(table, "min", where, default=1)
    high = ctx.integer(table, "max", where, default=None if kind == "uniform" else 1_000_000)
    if high < low:
        raise ctx.fail(f"{where}.max", f"must be at least min ({low}), got {high}")
    if kind == "uniform":
        return LengthDist("uniform", low=low, high=high)
    return LengthDist("lognormal", low=low, high=high, median=ctx.number(table, "median", where),
                      sigma=ctx.number(table, "sigma", where, allow_zero=True))


def _arrival(ctx: _Ctx, raw: Any, where: str) -> Arrival:
    if not isinstance(raw, dict) or raw.get("process") not in _ARRIVAL_KEYS:
        raise ctx.fail(f"{where}.process", f"must be one of {', '.join(_ARRIVAL_KEYS)}")
    process = raw["process"]
    table = ctx.table(raw, where, _ARRIVAL_KEYS[process])
    if process == "closed":
        return Arrival("closed", concurrency=ctx.integer(table, "concurrency", where),
                       think_s=ctx.number(table, "think_s", where, default=0.0, allow_zero=True))
    rate = ctx.number(table, "rate", where)
    cv = ctx.number(table, "cv", where, default=1.0) if process == "gamma" else 1.0
    return Arrival(process, rate=rate, cv=cv)


def _tenant_key(ctx: _Ctx, table: dict[str, Any], where: str) -> str:
    if "api_key" in table and "api_key_env" in table:
        raise ctx.fail(where, "give api_key or api_key_env, not both")
    if "api_key_env" in table:
        var = ctx.string(table, "api_key_env", where)
        key = os.environ.get(var, "")
        if not key:
            raise ctx.fail(f"{where}.api_key_env", f"environment variable {var} is not set")
        return key
    return ctx.string(table, "api_key", where, default="")


def parse_scenario(data: dict[str, Any], path: str = "<scenario>", base: Path | None = None) -> Scenario:
    ctx = _Ctx(path)
    base = base or Path(".")
    ctx.table(data, "scenario", _TOP_KEYS)
    tenants: dict[str, Tenant] = {}
    raw_tenants = data.get("tenants", [])
    if not isinstance(raw_tenants, list):
        raise ctx.fail("tenants", "must be an array of tables ([[tenants]])")
    for i, raw in enumerate(raw_tenants):
        where = f"tenants[{i}]"
        table = ctx.table(raw, where, _TENANT_KEYS)
        name = ctx.string(table, "name", where)
        if name in tenants:
            raise ctx.fail(f"{where}.name", f"duplicate tenant {name!r}")
        tenants[name] = Tenant(name, _tenant_key(ctx, table, where))
    raw_workloads = data.get("workloads")
    if not isinstance(raw_workloads, list) or not raw_workloads:
        raise ctx.fail("workloads", "at least one [[workloads]] table is required")
    workloads = []
    for i, raw in enumerate(raw_workloads):
        where = f"workloads[{i}]"
        table = ctx.table(raw, where, _WORKLOAD_KEYS)
        tenant_name = ctx.string(table, "tenant", where)
        if tenant_name not in tenants:
            raise ctx.fail(f"{where}.tenant", f"unknown tenant {tenant_name!r} (declare it in [[tenants]])")
        tier = table.get("service_tier")
        if tier is not None and tier not in SERVICE_TIERS:
            raise ctx.fail(f"{where}.service_tier", f"must be one of {', '.join(SERVICE_TIERS)}")
        api = ctx.string(table, "api", where, default="stream")
        if api not in ("stream", "batch"):
            raise ctx.fail(f"{where}.api", f"must be 'stream' or 'batch', got {api!r}")
        bursts = []
        for j, burst in enumerate(table.get("bursts", [])):
            bwhere = f"{where}.bursts[{j}]"
            btable = ctx.table(burst, bwhere, {"at_s", "count"})
            bursts.append(Burst(ctx.number(btable, "at_s", bwhere, allow_zero=True),
                                ctx.integer(btable, "count", bwhere)))
        # A batch workload is one submission, not an arrival process.
        arrival = Arrival("batch") if api == "batch" else _arrival(ctx, table.get("arrival"), f"{where}.arrival")
        workloads.append(Workload(
            name=ctx.string(table, "name", where, default=f"workload{i}"),
            tenant=tenants[tenant_name], arrival=arrival,
            prompt_tokens=_dist(ctx, table.get("prompt_tokens"), f"{where}.prompt_tokens", base),
            output_tokens=_dist(ctx, table.get("output_tokens"), f"{where}.output_tokens", base),
            service_tier=tier, bursts=tuple(bursts),
            ignore_eos=bool(table.get("ignore_eos", True)),
            temperature=ctx.number(table, "temperature", where, default=0.0, allow_zero=True),
            api=api,
            batch_lines=ctx.integer(table, "batch_lines", where, default=100) if api == "batch" else 0,
            batch_poll_s=ctx.number(table, "batch_poll_s", where, default=1.0),
        ))
    slo_table = ctx.table(data.get("slo", {}), "slo", {"ttft_s", "itl_s"})
    endpoint = ctx.string(data, "endpoint", "scenario", default="chat")
    if endpoint not in ("chat", "completions"):
        raise ctx.fail("endpoint", f"must be 'chat' or 'completions', got {endpoint!r}")
    return Scenario(
        name=ctx.string(data, "name", "scenario", default=Path(path).stem),
        description=ctx.string(data, "description", "scenario", default=""),
        model=ctx.string(data, "model", "scenario", default="demo"),
        endpoint=endpoint, workloads=tuple(workloads),
        slo=Slo(ttft_s=ctx.number(slo_table, "ttft_s", "slo", default=3.0),
                itl_s=ctx.number(slo_table, "itl_s", "slo", default=0.3)),
        duration_s=ctx.number(data, "duration_s", "scenario", default=60.0),
        max_requests=ctx.integer(data, "max_requests", "scenario", default=0, minimum=0),
        seed=ctx.integer(data, "seed", "scenario", default=0, minimum=0),
        tokenizer=ctx.string(data, "tokenizer", "scenario", default=""),
    )


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the scenario ({exc.strerror})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc})") from None
    return parse_scenario(data, str(path), path.parent)
