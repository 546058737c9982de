"""Tracing is off by default and then costs nothing: no span, no context, nothing imported; its
settings are validated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sluice import tracing
from sluice.settings import ConfigError, load_settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def test_off_by_default_and_every_hook_is_a_no_op() -> None:
    assert load_settings(REPO / "config", environ={}).tracing.enabled is False
    assert tracing.configure(False, "http://127.0.0.1:1/v1/traces", "test") is False
    assert not tracing.enabled()
    with tracing.span("anything") as span:
        assert span is None
    assert tracing.current_traceparent() is None
    tracing.record_span("anything", "00-" + "1" * 32 + "-" + "2" * 16 + "-01", 1.0, 2.0)  # dropped


def test_the_sdk_is_not_imported_while_off() -> None:
    # Whatever imported it before (another test), these hooks alone never need it.
    before = {name for name in sys.modules if name.startswith("opentelemetry.sdk")}
    with tracing.span("x"):
        tracing.current_traceparent()
    assert {name for name in sys.modules if name.startswith("opentelemetry.sdk")} == before


@pytest.mark.parametrize("ratio", ["-0.1", "1.5"])
def test_sample_ratio_must_be_a_share(ratio: str) -> None:
    with pytest.raises(ConfigError, match=r"sample_ratio must be 0\.\.1"):
        load_settings(REPO / "config", environ={"SLUICE_TRACING_SAMPLE_RATIO": ratio})
