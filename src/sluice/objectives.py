"""Latency objectives: how fast a request must be served, by class, tenant and request (issue #32).

An objective is a time-to-first-token target and an inter-token-latency target, each met at a
percentile over a class's requests (`objectives.percentile`, p95 by default). Where one request's
targets come from, each step only able to tighten what the step before gave:

1. its class ([objectives] in sluice.toml: interactive TTFT 3 s / ITL 300 ms as the source articles
   state, standard looser, batch none: batch work is throughput by definition);
2. its tenant (admin API / console: `ttft_target_s`, `itl_target_s`), which replaces the class's
   targets for the tenant's interactive and standard requests; a tenant's target never makes its
   batch requests latency-sensitive;
3. the request's `X-Sluice-Objective: ttft=1.5, itl=0.2` header (seconds), which can only tighten:
   a looser value keeps the target, and a class without a target does not get one from a header.

The answer repeats the targets it was served against in its own `X-Sluice-Objective` header.

The result travels with the request (`GenerateRequest.ttft_target_s` / `itl_target_s`): the engine
sizes its prefill chunks to keep the ITL targets of the streams it is decoding
(workers/step_budget.py). No torch, no I/O here: the gateway, the settings and the lab import it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

from sluice.protocol import Priority

if TYPE_CHECKING:
    from sluice.settings import ObjectiveSettings

MAX_TARGET_S = 3600.0
HEADER = "x-sluice-objective"


class Objective(msgspec.Struct, frozen=True, kw_only=True):
    """A request's latency targets in seconds; None: no target (best effort)."""

    ttft_s: float | None = None
    itl_s: float | None = None

    def tightened(self, other: Objective) -> Objective:
        """Each target the smaller of the two; a target `self` lacks stays absent."""
        return Objective(ttft_s=_tighter(self.ttft_s, other.ttft_s), itl_s=_tighter(self.itl_s, other.itl_s))

    def met(self, ttft_s: float | None, itl_s: float | None) -> bool:
        """Whether a request's observed TTFT and ITL (at the objective's percentile) meet it.
        An observation that is missing (no token, or a single one: no ITL) cannot miss."""
        return ((self.ttft_s is None or ttft_s is None or ttft_s <= self.ttft_s)
                and (self.itl_s is None or itl_s is None or itl_s <= self.itl_s))


def _tighter(base: float | None, other: float | None) -> float | None:
    if base is None or other is None:
        return base
    return min(base, other)


def check_target(name: str, value: float | None) -> None:
    """ValueError unless `value` is None or a positive, finite number of seconds up to an hour."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0 < value <= MAX_TARGET_S:
        raise ValueError(f"{name} must be a number of seconds above 0 and at most {MAX_TARGET_S:g}, got {value!r}")


def parse_header(value: str) -> Objective:
    """`ttft=1.5, itl=0.2` (seconds; either key may be left out) -> Objective. ValueError on garbage."""
    found: dict[str, float] = {}
    for part in value.split(","):
        key, sep, raw = part.strip().partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "itl") or key in found:
            raise ValueError(f"{HEADER} must look like 'ttft=1.5, itl=0.2' (seconds), got {value[:80]!r}")
        try:
            seconds = float(raw.strip())
        except ValueError:
            raise ValueError(f"{HEADER}: {key} must be a number of seconds, got {raw.strip()[:40]!r}") from None
        check_target(f"{HEADER} {key}", seconds)
        found[key] = seconds
    return Objective(ttft_s=found.get("ttft"), itl_s=found.get("itl"))


def format_header(ttft_s: float | None, itl_s: float | None) -> str:
    """The response's `X-Sluice-Objective`: the targets the request was served against ("none": no target)."""
    parts = [f"{key}={value:g}" for key, value in (("ttft", ttft_s), ("itl", itl_s)) if value is not None]
    return ", ".join(parts) or "none"


PREDICTED_TTFT_HEADER = "x-sluice-predicted-ttft-ms"  # the gateway's TTFT prediction at admission


def format_predicted_ttft(seconds: float) -> str:
    """`X-Sluice-Predicted-TTFT-Ms`: the prediction in whole milliseconds."""
    return str(round(seconds * 1000))


def parse_predicted_ttft(value: str | None) -> float | None:
    """A response's `X-Sluice-Predicted-TTFT-Ms` -> seconds; None when absent or malformed."""
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        return None
    return ms / 1000 if math.isfinite(ms) and ms >= 0 else None


def parse_served(value: str | None) -> Objective | None:
    """A response's `X-Sluice-Objective` (`format_header`'s output) -> the targets it was served
    against; "none" -> no target; None when absent or not in that form (another server)."""
    if value is None:
        return None
    if value.strip().lower() == "none":
        return Objective()
    try:
        return parse_header(value)
    except ValueError:
        return None


def resolve(class_objective: Objective, priority: Priority, tenant: Objective,
            header: Objective | None) -> Objective:
    """A request's objective from its class's, its tenant's and its header's (module docstring)."""
    objective = class_objective
    if priority != Priority.BATCH:
        objective = Objective(
            ttft_s=class_objective.ttft_s if tenant.ttft_s is None else tenant.ttft_s,
            itl_s=class_objective.itl_s if tenant.itl_s is None else tenant.itl_s,
        )
    return objective if header is None else objective.tightened(header)


__all__ = ["HEADER", "MAX_TARGET_S", "Objective", "check_target", "format_header", "parse_header", "parse_served",
           "resolve"]


def class_objective(settings: ObjectiveSettings, priority: Priority) -> Objective:
    """The configured targets of a class (`[objectives]`)."""
    if priority is Priority.INTERACTIVE:
        return Objective(ttft_s=settings.interactive_ttft_s, itl_s=settings.interactive_itl_s)
    if priority is Priority.STANDARD:
        return Objective(ttft_s=settings.standard_ttft_s, itl_s=settings.standard_itl_s)
    return Objective(ttft_s=settings.batch_ttft_s, itl_s=settings.batch_itl_s)
