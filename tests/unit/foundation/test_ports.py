"""Ports picked for servers started next (`sluice serve --replicas`, the test clusters) lie below the
kernel's ephemeral range, so the local end of an outgoing connection cannot take one first, and are
claimed, so that another process picking at the same time does not get the same one."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from sluice import broker
from sluice.broker import LISTEN_PORTS_FROM, claim_port, ephemeral_ports, free_port, free_ports, port_in_use

pytestmark = pytest.mark.unit


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    low, high = ephemeral_ports()
    assert 0 < low <= high <= 65535
    for _ in range(20):
        port = free_port()
        assert LISTEN_PORTS_FROM <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_seen_and_consecutive_ports_are_all_free() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        assert port_in_use("127.0.0.1", held.getsockname()[1])
    first = free_ports(4)
    assert not any(port_in_use("127.0.0.1", first + i) for i in range(4))


def test_a_claimed_port_is_not_picked_again_until_its_claim_is_old(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker, "CLAIMS_DIR", tmp_path / "claims")
    port = free_port()
    assert (tmp_path / "claims" / str(port)).is_file()
    assert not claim_port(port)  # another process picking now skips it
    old = time.time() - broker.CLAIM_S - 1
    os.utime(tmp_path / "claims" / str(port), (old, old))
    assert claim_port(port) and not claim_port(port)


def test_claims_are_skipped_where_the_directory_is_a_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "claims").symlink_to(elsewhere)
    monkeypatch.setattr(broker, "CLAIMS_DIR", tmp_path / "claims")
    assert claim_port(20_000) and claim_port(20_000)
    assert list(elsewhere.iterdir()) == []
