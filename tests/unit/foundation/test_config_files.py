"""The shipped config files mean what they say: every key in config/*.toml is a field of the
settings model and arrives there with its value, and every setting is read by some code."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sluice.settings import ModelSpec, QuotaSeed, Settings, TenantSeed, load_settings
from sluice.workers.config import EngineConfig

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "config"
SECTIONS: dict[str, type[msgspec.Struct]] = {
    name: kind for name, kind in typing.get_type_hints(Settings).items()
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct)
}


def _code() -> str:
    """The source that reads settings: everything but the settings model itself."""
    files = [p for p in (REPO / "src" / "sluice").rglob("*.py") if p != REPO / "src" / "sluice" / "settings.py"]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def _as_loaded(value: Any) -> Any:
    return tuple(_as_loaded(v) for v in value) if isinstance(value, list) else value


def test_every_key_of_sluice_toml_is_a_setting_with_its_value() -> None:
    raw = tomllib.loads((CONFIG / "sluice.toml").read_text(encoding="utf-8"))
    settings = load_settings(CONFIG, environ={})
    assert set(raw) <= set(SECTIONS) | {"engine"}
    for section, values in raw.items():
        for key, value in values.items():
            if section == "engine":
                assert key in {f.name for f in dataclasses.fields(EngineConfig)}, key
                assert settings.engine[key] == value
            else:
                assert key in SECTIONS[section].__struct_fields__, f"[{section}] {key}"
                assert getattr(getattr(settings, section), key) == _as_loaded(value), f"[{section}] {key}"


def test_every_model_and_tenant_key_is_a_setting_with_its_value() -> None:
    settings = load_settings(CONFIG, environ={})
    models = tomllib.loads((CONFIG / "models.toml").read_text(encoding="utf-8"))["models"]
    assert len(models) == len(settings.models)
    for raw, model in zip(models, settings.models, strict=True):
        assert set(raw) <= set(ModelSpec.__struct_fields__)
        assert all(getattr(model, k) == v for k, v in raw.items())
    tenants = tomllib.loads((CONFIG / "tenants.toml").read_text(encoding="utf-8"))["tenants"]
    for raw, tenant in zip(tenants, settings.tenants, strict=True):
        quotas = raw.pop("quotas", {})
        assert set(raw) <= set(TenantSeed.__struct_fields__) and set(quotas) <= set(QuotaSeed.__struct_fields__)
        assert all(getattr(tenant, k) == _as_loaded(v) for k, v in raw.items())
        assert all(getattr(tenant.quotas, k) == v for k, v in quotas.items())


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_setting_is_read_by_the_code(section: str) -> None:
    code = _code()
    unread = [key for key in SECTIONS[section].__struct_fields__ if not re.search(rf"\.{key}\b", code)]
    assert not unread, f"[{section}] settings no code reads: {unread} (use them or remove them)"


def test_every_model_and_tenant_field_is_read_by_the_code() -> None:
    code = _code()
    for kind in (ModelSpec, TenantSeed):
        unread = [key for key in kind.__struct_fields__ if not re.search(rf"\.{key}\b", code)]
        assert not unread, f"{kind.__name__} fields no code reads: {unread}"
