"""The test hosts of wormhole.testing.netns: namespaces joined by wires that cut for real."""

from __future__ import annotations

import socket
import subprocess
import sys
from typing import Any

import pytest

from wormhole.testing.netns import leftovers, start_network

PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0).close()
    print("connected")
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print(type(exc).__name__)
"""


def probe(network: Any, source: str, address: str, port: int = 9) -> str:
    """Connect from ``source`` to ``address``: "refused" (reached, nothing listens),
    "TimeoutError" (packets dropped) or another error's name."""
    command = network.command(source, [sys.executable, "-c", PROBE, address, str(port)])
    return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()


def test_a_cut_wire_drops_packets_in_silence_and_healing_restores_it() -> None:
    generator = start_network(["x", "y", "z"])
    network = next(generator)
    try:
        y, z = network.address("y"), network.address("z")
        assert probe(network, "x", y) == "refused"  # reached: nothing listens on port 9
        network.cut("x", "y")
        assert probe(network, "x", y) == "TimeoutError"
        assert probe(network, "y", network.address("x")) == "TimeoutError"
        assert probe(network, "x", z) == "refused", "only the wire between x and y is cut"
        network.isolate("z")
        assert probe(network, "y", z) == "TimeoutError"
        network.heal("z")  # z's wires only
        assert probe(network, "y", z) == "refused"
        assert probe(network, "x", y) == "TimeoutError"
        network.heal()
        assert probe(network, "x", y) == "refused"
        assert probe(network, "y", z) == "refused"
    finally:
        generator.close()
    assert leftovers(network) == []


def test_the_session_hosts_reach_zookeeper_and_the_test_process_reaches_only_it(
    netns_hosts: Any, host_zookeeper: Any
) -> None:
    from wormhole.testing.zookeeper import answers

    zk = host_zookeeper
    assert answers(zk.host, zk.port)
    assert probe(netns_hosts, "a", zk.host, zk.port) == "connected"
    with pytest.raises(OSError, match=r"No route to host|unreachable"):
        socket.create_connection((netns_hosts.address("a"), 9), timeout=1.0)


def test_hosts_must_be_distinct() -> None:
    with pytest.raises(ValueError, match="distinct"):
        next(start_network(["x", "x"]))


def test_a_network_that_fails_half_way_is_removed() -> None:
    from wormhole.testing.netns import NetworkError, _ip

    def state() -> tuple[str, str, str]:
        return _ip("netns", "list").stdout, _ip("route").stdout, _ip("-o", "link").stdout

    before = state()
    with pytest.raises(NetworkError, match="bad/name"):
        next(start_network(["x", "bad/name"]))  # a namespace name cannot hold a slash
    assert state() == before
