"""The configuration reference (docs/configuration.md): generated from the settings types, complete,
and current."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from sluice import config_reference, settings
from sluice.cli import main

pytestmark = pytest.mark.unit

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_the_page_is_current() -> None:
    written = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    assert written == config_reference.render(), (
        "docs/configuration.md is stale: run `sluice config reference` from the repository root")


def test_every_setting_has_a_description() -> None:
    assert config_reference.missing_descriptions() == [], (
        "write a docstring under each of these fields (what it means to an operator)")


def test_every_section_file_and_key_is_in_the_reference() -> None:
    tables = {t.heading: t for f in config_reference.reference() for t in f.tables}
    assert {f"[{s}]" for s in settings._SECTIONS} | {"[[models]]", "[[tenants]]", "[tenants.quotas]",
                                                     "[[upstreams]]"} == set(tables)
    for section, cls in settings._SECTION_TYPES.items():
        assert [k.name for k in tables[f"[{section}]"].keys] == list(cls.__struct_fields__)
    # Every file the loader reads is a file of the page.
    assert [f.name for f in config_reference.reference()] == list(settings._FILES)


def test_each_environment_variable_reaches_its_key() -> None:
    for config_file in config_reference.reference():
        for table in config_file.tables:
            for key in table.keys:
                if key.env is None:
                    continue
                section = table.heading.strip("[]")
                overrides = settings._env_overrides({key.env: "1"})
                assert {s: list(keys) for s, keys in overrides.items()} == {section: [key.name]}, key.env


def test_files_without_overrides_list_no_variable() -> None:
    for config_file in config_reference.reference()[1:]:
        assert all(key.env is None for table in config_file.tables for key in table.keys)
        assert "No environment variable overrides this file." in config_file.intro


class _Documented(msgspec.Struct):
    # A comment is not a description.
    commented: int = 1
    described: str = "x"
    """What it means,
    over two lines."""
    after_a_blank: bool = False

    """A string after a blank line still follows its field."""


def test_descriptions_are_the_docstrings_under_the_fields() -> None:
    assert config_reference.field_descriptions(_Documented) == {
        "described": "What it means, over two lines.",
        "after_a_blank": "A string after a blank line still follows its field.",
    }


def test_the_command_writes_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "configuration.md"
    assert main(["config", "reference", "--output", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == config_reference.render()
    assert main(["config", "reference", "--output", "-"]) == 0
    assert capsys.readouterr().out.endswith(config_reference.render())


def test_the_command_refuses_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "reference", "--output", str(tmp_path / "nowhere" / "configuration.md")]) == 2
    assert "does not exist" in capsys.readouterr().err
