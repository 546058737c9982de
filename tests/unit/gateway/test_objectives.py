"""Latency objectives (sluice/objectives.py): where a request's targets come from, the header's
grammar, and the [objectives] settings' checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.errors import ConfigError
from sluice.objectives import Objective, class_objective, format_header, parse_header, resolve
from sluice.protocol import Priority
from sluice.settings import ObjectiveSettings, load_settings

CLASSES = ObjectiveSettings()


def test_class_defaults_are_the_articles_targets_and_batch_has_none() -> None:
    assert class_objective(CLASSES, Priority.INTERACTIVE) == Objective(ttft_s=3.0, itl_s=0.3)
    standard = class_objective(CLASSES, Priority.STANDARD)
    assert standard.ttft_s is not None and standard.ttft_s > 3.0 and standard.itl_s is not None and standard.itl_s > 0.3
    assert class_objective(CLASSES, Priority.BATCH) == Objective()


def test_tenant_replaces_the_class_targets_but_never_makes_batch_latency_sensitive() -> None:
    tenant = Objective(itl_s=0.5)
    assert resolve(class_objective(CLASSES, Priority.INTERACTIVE), Priority.INTERACTIVE, tenant, None) == Objective(
        ttft_s=3.0, itl_s=0.5)
    assert resolve(class_objective(CLASSES, Priority.BATCH), Priority.BATCH, tenant, None) == Objective()


def test_the_header_only_tightens() -> None:
    base = class_objective(CLASSES, Priority.INTERACTIVE)
    assert resolve(base, Priority.INTERACTIVE, Objective(), parse_header("ttft=1.5, itl=0.1")) == Objective(
        ttft_s=1.5, itl_s=0.1)
    assert resolve(base, Priority.INTERACTIVE, Objective(), parse_header("ttft=60,itl=9")) == base  # looser: kept
    assert resolve(base, Priority.INTERACTIVE, Objective(), parse_header("itl=0.2")) == Objective(ttft_s=3.0, itl_s=0.2)
    # A class without a target gets none from a header.
    batch = class_objective(CLASSES, Priority.BATCH)
    assert resolve(batch, Priority.BATCH, Objective(), parse_header("itl=0.1")) == Objective()


@pytest.mark.parametrize("bad", ["", "ttft", "ttft=", "ttft=abc", "ttft=-1", "ttft=0", "itl=nan", "itl=inf",
                                 "itl=1e9", "speed=1", "ttft=1,ttft=2", "ttft=1;itl=2", "ttft=1,,itl=2", "\x00"])
def test_header_garbage_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="x-sluice-objective"):
        parse_header(bad)


def test_the_answer_header_names_the_targets() -> None:
    assert format_header(3.0, 0.3) == "ttft=3, itl=0.3"
    assert format_header(None, None) == "none"
    assert parse_header(format_header(1.25, None)) == Objective(ttft_s=1.25)


@pytest.mark.parametrize(("key", "value"), [("interactive_itl_s", "-1"), ("standard_ttft_s", "0"),
                                            ("batch_itl_s", "nan"), ("percentile", "0"), ("percentile", "101"),
                                            ("interactive_ttft_s", "'fast'"), ("unknown_key", "1")])
def test_bad_objective_settings_are_one_line_config_errors(tmp_path: Path, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(tmp_path, {f"SLUICE_OBJECTIVES_{key.upper()}": value})
    assert "\n" not in str(exc.value) and "objectives" in str(exc.value)


def test_objective_settings_from_a_file(tmp_path: Path) -> None:
    (tmp_path / "sluice.toml").write_text("[objectives]\ninteractive_itl_s = 0.2\nbatch_ttft_s = 600\n")
    settings = load_settings(tmp_path, {})
    assert class_objective(settings.objectives, Priority.INTERACTIVE) == Objective(ttft_s=3.0, itl_s=0.2)
    assert class_objective(settings.objectives, Priority.BATCH) == Objective(ttft_s=600.0)
