"""HTML form fields → the admin API's request structs, validated by the same msgspec schemas.

A form sends strings: numbers are converted by msgspec (non-strict), an empty quota field means
unlimited (null), allowed models are one per line or comma-separated. A validation error becomes
an `OpenAIError` naming the field, exactly as the admin API answers it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from sluice.gateway.admin.schemas import KeyCreate, QuotasPatch, TenantCreate, TenantPatch
from sluice.gateway.db.models import QUOTA_FIELDS
from sluice.gateway.edge.errors import OpenAIError

T = TypeVar("T")
_PATH = re.compile(r"`\$\.([A-Za-z0-9_.\[\]]+)`")


def _convert(payload: dict[str, Any], kind: type[T]) -> T:
    try:
        return msgspec.convert(payload, kind, strict=False)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        raise OpenAIError(400, str(exc), param=match.group(1) if match else None) from None


def _text(form: Mapping[str, Any], name: str) -> str:
    value = form.get(name, "")
    if isinstance(value, list):  # a repeated field: the last one wins, as in most frameworks
        value = value[-1] if value else ""
    return str(value).strip()


def _models(form: Mapping[str, Any]) -> list[str]:
    return [m for m in re.split(r"[\s,]+", _text(form, "allowed_models")) if m]


def _quotas(form: Mapping[str, Any]) -> dict[str, Any]:
    return {f: (_text(form, f) or None) for f in QUOTA_FIELDS}


def tenant_create(form: Mapping[str, Any]) -> TenantCreate:
    payload: dict[str, Any] = {
        "name": _text(form, "name"),
        "description": _text(form, "description"),
        "allowed_models": _models(form),
        "quotas": {k: v for k, v in _quotas(form).items() if v is not None},
    }
    for field in ("priority_ceiling", "default_class", "weight"):
        if _text(form, field):
            payload[field] = _text(form, field)
    return _convert(payload, TenantCreate)


def tenant_patch(form: Mapping[str, Any]) -> TenantPatch:
    return _convert({
        "description": _text(form, "description"),
        "priority_ceiling": _text(form, "priority_ceiling"),
        "default_class": _text(form, "default_class"),
        "weight": _text(form, "weight"),
        "allowed_models": _models(form),
        # Latency targets (sluice/objectives.py): empty = the class's target.
        "ttft_target_s": _text(form, "ttft_target_s") or None,
        "itl_target_s": _text(form, "itl_target_s") or None,
        # queue | shed (docs/objectives.md); absent from an older form: unchanged.
        **({"on_predicted_miss": _text(form, "on_predicted_miss")} if "on_predicted_miss" in form else {}),
    }, TenantPatch)


def quotas_patch(form: Mapping[str, Any]) -> QuotasPatch:
    """Every field of the form is set: an empty one is unlimited."""
    return _convert(_quotas(form), QuotasPatch)


def key_create(form: Mapping[str, Any]) -> KeyCreate:
    payload: dict[str, Any] = {"name": _text(form, "name")}
    if _text(form, "expires_in_days"):
        payload["expires_in_days"] = _text(form, "expires_in_days")
    return _convert(payload, KeyCreate)
