"""Ports picked for servers started next (`sluice serve --replicas`, the test clusters) lie below the
kernel's ephemeral range, so the local end of an outgoing connection cannot take one first."""

from __future__ import annotations

import socket

import pytest

from sluice.broker import LISTEN_PORTS_FROM, ephemeral_ports, free_port, free_ports, port_in_use

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
