"""HTTP bodies of the admin API (msgspec; converted to rows in the service)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

if TYPE_CHECKING:
    from sluice.gateway.quotas.usage import UsageRow

ClassName = Literal["interactive", "standard", "batch"]
Limit = Annotated[int, msgspec.Meta(ge=0, le=2**53)] | None
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Weight = Annotated[float, msgspec.Meta(gt=0, le=1e6)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
# A stream's disconnect grace for this tenant (docs/streams.md); null = the gateway's setting.
Grace = Annotated[float, msgspec.Meta(ge=0, le=3600)] | None
# A latency target of this tenant's interactive and standard requests (sluice/objectives.py);
# null = the class's target from [objectives].
Target = Annotated[float, msgspec.Meta(gt=0, le=3600)] | None
# A request predicted to miss its TTFT target at every worker: queued anyway (its prediction in the
# x-sluice-predicted-ttft-ms header) or refused at once with a 429 (docs/objectives.md).
OnPredictedMiss = Literal["queue", "shed"]


class Quotas(msgspec.Struct, kw_only=True):
    """Quota limits; null = unlimited."""

    requests_per_minute: Limit = None
    tokens_per_minute: Limit = None
    tokens_per_day: Limit = None
    max_concurrent: Limit = None
    max_queued: Limit = None
    max_prompt_tokens: Limit = None
    max_output_tokens: Limit = None


class QuotasPatch(msgspec.Struct, kw_only=True):
    """Only the fields present change; null sets a limit to unlimited."""

    requests_per_minute: Limit | msgspec.UnsetType = msgspec.UNSET
    tokens_per_minute: Limit | msgspec.UnsetType = msgspec.UNSET
    tokens_per_day: Limit | msgspec.UnsetType = msgspec.UNSET
    max_concurrent: Limit | msgspec.UnsetType = msgspec.UNSET
    max_queued: Limit | msgspec.UnsetType = msgspec.UNSET
    max_prompt_tokens: Limit | msgspec.UnsetType = msgspec.UNSET
    max_output_tokens: Limit | msgspec.UnsetType = msgspec.UNSET

    def changes(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not msgspec.UNSET}


class TenantCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Name
    description: Annotated[str, msgspec.Meta(max_length=2000)] = ""
    priority_ceiling: ClassName = "standard"
    default_class: ClassName = "standard"
    weight: Weight = 1.0
    allowed_models: list[ModelName] = msgspec.field(default_factory=list)  # empty = every model
    disconnect_grace_s: Grace = None
    ttft_target_s: Target = None
    itl_target_s: Target = None
    on_predicted_miss: OnPredictedMiss = "queue"
    quotas: Quotas = msgspec.field(default_factory=Quotas)


class TenantPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Name | msgspec.UnsetType = msgspec.UNSET
    description: Annotated[str, msgspec.Meta(max_length=2000)] | msgspec.UnsetType = msgspec.UNSET
    priority_ceiling: ClassName | msgspec.UnsetType = msgspec.UNSET
    default_class: ClassName | msgspec.UnsetType = msgspec.UNSET
    weight: Weight | msgspec.UnsetType = msgspec.UNSET
    allowed_models: list[ModelName] | msgspec.UnsetType = msgspec.UNSET
    enabled: bool | msgspec.UnsetType = msgspec.UNSET
    disconnect_grace_s: Grace | msgspec.UnsetType = msgspec.UNSET
    ttft_target_s: Target | msgspec.UnsetType = msgspec.UNSET
    itl_target_s: Target | msgspec.UnsetType = msgspec.UNSET
    on_predicted_miss: OnPredictedMiss | msgspec.UnsetType = msgspec.UNSET
    quotas: QuotasPatch | msgspec.UnsetType = msgspec.UNSET


class TenantOut(msgspec.Struct, kw_only=True):
    id: str
    name: str
    description: str
    priority_ceiling: ClassName
    default_class: ClassName
    weight: float
    allowed_models: list[str]
    enabled: bool
    created_at: dt.datetime
    disconnect_grace_s: float | None  # null: the gateway's gateway.disconnect_grace_s
    ttft_target_s: float | None  # null: the class's target ([objectives])
    itl_target_s: float | None  # null: the class's target ([objectives])
    on_predicted_miss: OnPredictedMiss
    quotas: Quotas


class TenantList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[TenantOut]


class TenantDeleted(msgspec.Struct, kw_only=True):
    id: str
    deleted: bool  # True: the tenant and its keys are gone
    disabled: bool  # True: it has usage history, so it was disabled (keys stop working) instead
    message: str


class KeyCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(max_length=100)] = ""
    expires_in_days: Annotated[int, msgspec.Meta(ge=1, le=36500)] | None = None
    expires_at: dt.datetime | None = None


class KeyCreated(msgspec.Struct, kw_only=True):
    """The only answer that ever contains the key itself."""

    id: str
    tenant_id: str
    key: str
    prefix: str
    name: str
    created_at: dt.datetime
    expires_at: dt.datetime | None


class KeyOut(msgspec.Struct, kw_only=True):
    id: str
    tenant_id: str
    prefix: str
    name: str
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None


class KeyList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[KeyOut]


class UsageOut(msgspec.Struct, kw_only=True):
    tenant_id: str
    model: str
    day: dt.date
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    requests: int


class UsageList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    start: dt.date | None
    end: dt.date | None
    data: list[UsageOut]


def usage_list(rows: Iterable[UsageRow], start: dt.date | None, end: dt.date | None) -> UsageList:
    """The answer of both usage routes: the admin's (any tenant) and a tenant's own."""
    return UsageList(
        start=start,
        end=end,
        data=[
            UsageOut(
                tenant_id=r.tenant_id,
                model=r.model,
                day=r.day,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens,
                total_tokens=r.total_tokens,
                requests=r.requests,
            )
            for r in rows
        ],
    )


class AuditOut(msgspec.Struct, kw_only=True):
    id: int
    at: dt.datetime
    actor: str
    action: str
    target: str
    details: dict[str, Any]


class AuditList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[AuditOut]
