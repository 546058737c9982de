"""The terminal side of issue #35: `sluice --version`, a validated `--log-level`, request records
off the terminal when a record file is configured, and an upstream's KV shown as "n/a"."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from sluice import cli, telemetry
from sluice.cli import main
from sluice.gateway.console.views import worker_rows
from sluice.live_window import LiveWindow

pytestmark = pytest.mark.unit


def test_version_prints_one_line_and_exits_0() -> None:
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "--version"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0 and done.stdout.startswith("sluice ") and len(done.stdout.splitlines()) == 1


@pytest.mark.parametrize("level", ["LOUD", "", "5"])
def test_an_unknown_log_level_is_one_line_and_exit_2(level: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--log-level", level, "config", "check"])
    assert exited.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sluice: error")]
    assert len(error) == 1 and "DEBUG, INFO, WARNING, ERROR" in error[0], error


def _record() -> telemetry.RequestRecord:
    return telemetry.make_record(request_id="r1", tenant="t", model="m", priority_class="standard", worker="w",
                                 arrival=1.0, dispatch_time=1.0, first_token_time=1.1, finish_time=1.2,
                                 token_times=(1.1, 1.2), prompt_tokens=3, completion_tokens=2, cached_tokens=0,
                                 finish_reason="length")


def test_records_reach_the_terminal_only_without_a_record_file(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "records.jsonl"
    try:
        with caplog.at_level(logging.INFO, logger=telemetry.RECORDS_LOGGER):
            telemetry.configure("")
            telemetry.emit_record(_record())
            telemetry.configure(str(path))
            telemetry.emit_record(_record())
        infos = [r for r in caplog.records if r.name == telemetry.RECORDS_LOGGER]
        assert len(infos) == 1  # the first only: the second went to the file alone
        assert [json.loads(line)["request_id"] for line in path.read_text().splitlines()] == ["r1"]
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger=telemetry.RECORDS_LOGGER):
            telemetry.emit_record(_record())
        assert [r.levelno for r in caplog.records if r.name == telemetry.RECORDS_LOGGER] == [logging.DEBUG]
    finally:
        telemetry.configure("")


def test_an_upstream_s_kv_is_not_shown_as_zero_of_zero() -> None:
    snapshot = {"workers": [
        {"worker_id": "local-0", "kind": "worker", "total_kv_blocks": 100, "free_kv_blocks": 25},
        {"worker_id": "upstream/vllm", "kind": "upstream", "total_kv_blocks": 0, "free_kv_blocks": 0},
    ]}
    rows = {row.worker_id: row for row in worker_rows(snapshot, LiveWindow())}
    assert rows["local-0"].kv_known and rows["local-0"].kv_percent == 75
    assert not rows["upstream/vllm"].kv_known


@pytest.mark.parametrize(("level", "shown"), [("INFO", False), ("DEBUG", True)])
def test_httpx_request_lines_only_at_debug(level: str, shown: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx logs each request (an upstream probe's, with its URL) at INFO: shown only at DEBUG."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", type=str.upper, default="INFO")
    parser.set_defaults(handler=lambda _args: 0, command="test")
    monkeypatch.setattr(cli, "build_parser", lambda _argv=None: parser)
    previous = logging.getLogger("httpx").level
    try:
        assert cli.main(["--log-level", level]) == 0
        assert logging.getLogger("httpx").isEnabledFor(logging.INFO) is shown
    finally:
        logging.getLogger("httpx").setLevel(previous)
