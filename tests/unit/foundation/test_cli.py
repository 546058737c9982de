"""The `sluice` command: one-line errors and non-zero exits for bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, **(env or {})},
    )


def test_config_check_accepts_the_shipped_config() -> None:
    result = run_cli("config", "check", "--config", str(REPO / "config"))
    assert result.returncode == 0, result.stderr
    assert "50 tenant(s)" in result.stdout


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "sluice.toml").write_text("[gateway]\nport = 'x'\n")
    result = run_cli("config", "check", "--config", str(tmp_path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice: error:") and "sluice.toml" in lines[0]


def test_missing_config_dir_is_one_line(tmp_path: Path) -> None:
    result = run_cli("config", "check", "--config", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_unknown_command_and_bad_flag() -> None:
    assert run_cli("frobnicate").returncode == 2
    result = run_cli("broker", "--port", "not-a-number")
    assert result.returncode == 2 and "invalid int value" in result.stderr


def test_broker_on_a_port_in_use_is_one_line(broker) -> None:
    result = run_cli("broker", "--port", str(broker.port))
    assert result.returncode == 2
    assert "already in use" in result.stderr


def test_broker_with_missing_binary_is_one_line(tmp_path: Path) -> None:
    result = run_cli("broker", "--port", "0", env={"SLUICE_BROKER_BIN": str(tmp_path / "nope")})
    assert result.returncode == 2
    assert "not an executable file" in result.stderr


def _wait_for_line(process: subprocess.Popen[str], needle: str) -> str:
    assert process.stdout is not None
    for line in process.stdout:
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} never printed")


def test_foreground_broker_ends_when_the_broker_dies(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "broker", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )
    try:
        _wait_for_line(process, "Kafka protocol on")
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        assert len(children) == 1
        os.kill(int(children[0]), signal.SIGKILL)  # the Tansu process dies under the command
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(("argv", "lab"), [(["--log-level", "DEBUG", "worker", "--model", "m"], False),
                                           (["gateway"], False), (["--log-level", "bench", "bench"], True),
                                           (["bench", "engine", "--help"], True), (["--help"], True), ([], True)])
def test_the_lab_is_imported_only_for_bench_and_help(argv: list[str], lab: bool) -> None:
    code = ("import sys; from sluice.cli import build_parser; build_parser(sys.argv[1:]); "
            "print('sluice_lab.cli' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(lab)
