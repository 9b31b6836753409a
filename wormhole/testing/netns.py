"""Hosts on one machine: Linux network namespaces joined by links that can be cut for real.

::

    for network in start_network(["zk", "a", "b", "sub"]):
        zk = network.address("zk")                     # e.g. "10.213.7.1"
        proc = subprocess.Popen(network.command("a", ["wormhole", "publish", "a.yml"]))
        network.cut("a", "zk")                          # a and zk no longer reach each other
        network.isolate("a")                            # a reaches no host
        network.heal()                                  # every link up again

Each host is a network namespace of its own with one IPv4 address, held on its links only.
Every pair of hosts is joined by a *wire*: two veth pairs, one from each host, bridged in a
namespace of the network's own (the switch). Cutting a wire takes its two ports on the
switch down: each host keeps its link up but without a carrier, so packets to the other host
are dropped in silence -- what a broken switch or a partitioned rack looks like, not an
error at either end. Healing brings the ports up again; the hosts' routes (the point-to-point
addresses' own) never went away. The test process itself (the machine's own namespace) is
joined to the hosts named in ``control`` by wires that are never cut, so it can reach, for
instance, ZooKeeper to watch the claims; it has no route to the other hosts.

The kernel has no ``netem`` on these machines: delay, loss and throttling come from
:class:`wormhole.testing.ThrottlingProxy`. The namespaces and the control links carry a token
of the network's own, and the address block is a /24 that the machine's namespace does not
use (an ``unreachable`` route keeps the test process from sending to the hosts it has no
control wire to), so that networks of parallel test sessions do not collide. Everything is
removed at the end, also when starting fails half-way. Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import shutil
import subprocess
import time
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field

from wormhole.testing.helpers import require


class NetworkError(RuntimeError):
    """An ``ip`` command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def can_make_hosts() -> tuple[bool, str]:
    """Whether this process can create network namespaces, and if not, why."""
    if shutil.which("ip") is None:
        return False, "the ip command (iproute2)"
    if os.geteuid() != 0:
        return False, "network namespaces (they need root)"
    return True, ""


@dataclass
class Network:
    """Hosts (network namespaces) joined pairwise by wires that :meth:`cut` takes down."""

    token: str
    hosts: dict[str, str]
    """Host name -> its IPv4 address."""
    block: ipaddress.IPv4Network
    control: tuple[str, ...] = ()
    control_address: str = ""
    """The machine's own address on its control wires (``""`` without any)."""
    down: set[frozenset[str]] = field(default_factory=set)
    """The wires cut now."""

    @property
    def switch(self) -> str:
        return f"wh-{self.token}-switch"

    def namespace(self, host: str) -> str:
        """The network namespace that is ``host``."""
        if host not in self.hosts:
            raise KeyError(f"no host {host!r} in this network (hosts: {', '.join(self.hosts)})")
        return f"wh-{self.token}-{host}"

    def address(self, host: str) -> str:
        self.namespace(host)
        return self.hosts[host]

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host`` (``ip netns exec``: the same process, its pid unchanged)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def _ports(self, x: str, y: str) -> list[str]:
        self.namespace(x), self.namespace(y)
        if x == y:
            raise ValueError(f"a wire joins two hosts, not {x!r} to itself")
        return [_port(self.hosts, x, y), _port(self.hosts, y, x)]

    def cut(self, x: str, y: str) -> None:
        """Packets between hosts ``x`` and ``y`` are dropped from now on, both ways."""
        for port in self._ports(x, y):
            _ip("-n", self.switch, "link", "set", port, "down")
        self.down.add(frozenset((x, y)))

    def isolate(self, host: str) -> None:
        """``host`` reaches no other host (its control wire, if any, stays)."""
        for other in self.hosts:
            if other != host:
                self.cut(host, other)

    def heal(self, x: str | None = None, y: str | None = None) -> None:
        """Bring the wire between ``x`` and ``y`` up again; with ``x`` only, every wire of
        ``x``; without arguments, every wire."""
        if y is not None and x is not None:
            wires = [(x, y)]
        else:
            wires = [(min(w), max(w)) for w in self.down if x is None or x in w]
        for a, b in wires:
            for port in self._ports(a, b):
                _ip("-n", self.switch, "link", "set", port, "up")
            self.down.discard(frozenset((a, b)))
        for a, b in wires:
            self._wait_carrying(a, b)

    def _wait_carrying(self, x: str, y: str, timeout: float = 10.0) -> None:
        """Until the wire between ``x`` and ``y`` carries packets: both switch ports up and
        forwarding, both hosts' ends up. The kernel reports a carrier change a moment after
        the link is set up (later on a loaded machine), and a packet sent in that moment
        is dropped as on a cut wire."""
        ends = [(self.namespace(x), f"to-{y}"[:15]), (self.namespace(y), f"to-{x}"[:15])]
        deadline = time.monotonic() + timeout
        while True:
            ports = [
                _ip("-n", self.switch, "-d", "-o", "link", "show", "dev", port).stdout
                for port in self._ports(x, y)
            ]
            hosts = [_ip("-n", ns, "-o", "link", "show", "dev", link).stdout for ns, link in ends]
            if all("state UP" in p and "state forwarding" in p for p in ports) and all(
                "state UP" in h for h in hosts
            ):
                return
            if time.monotonic() > deadline:
                raise NetworkError(
                    f"the wire between {x} and {y} did not come up within {timeout}s: "
                    f"{ports} {hosts}"
                )
            time.sleep(0.01)

    def reaches(self, x: str, y: str) -> bool:
        """Whether the wire between ``x`` and ``y`` is up (as this object set it)."""
        return frozenset((x, y)) not in self.down


def _port(hosts: dict[str, str], x: str, y: str) -> str:
    """The switch's port facing ``x`` on the wire to ``y`` (at most 15 characters)."""
    names = list(hosts)
    return f"p{names.index(x)}-{names.index(y)}"


def _used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 prefixes of the machine's namespace: its routes (but the default) and its
    addresses' subnets."""
    used = []
    routes = _ip("-4", "route", "show", "table", "all").stdout.splitlines()
    addresses = [line.split()[1] for line in _ip("-4", "-o", "addr").stdout.splitlines()]
    words = [r.split()[1] if r.split()[0] in ("unreachable", "blackhole", "local",
             "broadcast", "prohibit") else r.split()[0] for r in routes if r.split()]  # fmt: skip
    for word in [*words, *addresses]:
        try:
            used.append(ipaddress.IPv4Network(word, strict=False))
        except ValueError:
            continue  # "default", or not an address
    return used


def _free_block() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of the machine's namespace overlaps."""
    used = _used_networks()
    for _ in range(200):
        block = ipaddress.IPv4Network(
            f"10.{random.randrange(64, 250)}.{random.randrange(256)}.0/24"
        )
        if not any(block.overlaps(network) for network in used):
            return block
    raise NetworkError(
        "no /24 in 10.64.0.0-10.249.255.0 is free of the machine's routes and addresses for the "
        "test hosts"
    )


def _remove(token: str, control_links: Iterable[str], block: str) -> None:
    _ip("route", "del", "unreachable", block, check=False)
    for link in control_links:
        _ip("link", "del", link, check=False)
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"wh-{token}-"):
            _ip("netns", "del", name, check=False)


def start_network(
    hosts: Sequence[str], control: Sequence[str] = ()
) -> Generator[Network, None, None]:
    """Create the hosts, a wire between every two, and a control wire from the machine's
    namespace to each host in ``control``; yields the :class:`Network`, removes it all after
    (a generator for fixtures). Skips the calling test without root (fails under CI=true)."""
    ok, what = can_make_hosts()
    require(ok, what)
    if len(set(hosts)) != len(hosts) or not hosts:
        raise ValueError(f"hosts must be distinct names, got {list(hosts)}")
    token = f"{os.getpid() % 10000:04d}{random.randrange(16**3):03x}"
    block = _free_block()
    base = int(block.network_address)
    addresses = {h: str(ipaddress.IPv4Address(base + 1 + i)) for i, h in enumerate(hosts)}
    control_address = str(ipaddress.IPv4Address(base + 254)) if control else ""
    network = Network(token, addresses, block, tuple(control), control_address)
    control_links = [f"wh{token}c{i}" for i, _ in enumerate(control)]
    try:
        # The machine's namespace reaches the control hosts by their own routes and no
        # other host: without this, packets to them would take the default route out.
        _ip("route", "add", "unreachable", str(block))
        _ip("netns", "add", network.switch)
        for host in hosts:
            ns = network.namespace(host)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for x, y in itertools.combinations(hosts, 2):
            bridge = f"b{hosts.index(x)}-{hosts.index(y)}"
            _ip("-n", network.switch, "link", "add", bridge, "type", "bridge")
            for near, far in ((x, y), (y, x)):
                link, port = f"to-{far}"[:15], _port(addresses, near, far)
                ns = network.namespace(near)
                _ip(
                    "link", "add", link, "netns", ns, "type", "veth",
                    "peer", "name", port, "netns", network.switch,
                )  # fmt: skip
                _ip("-n", network.switch, "link", "set", port, "master", bridge, "up")
                local, remote = addresses[near], addresses[far]
                _ip("-n", ns, "addr", "add", local, "peer", f"{remote}/32", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", network.switch, "link", "set", bridge, "up")
        for host, link in zip(control, control_links, strict=True):
            ns = network.namespace(host)
            _ip("link", "add", link, "type", "veth", "peer", "name", "to-control", "netns", ns)
            _ip("addr", "add", control_address, "peer", f"{addresses[host]}/32", "dev", link)
            _ip("-n", ns, "addr", "add", addresses[host], "peer", control_address, "dev",
                "to-control")  # fmt: skip
            _ip("link", "set", link, "up")
            _ip("-n", ns, "link", "set", "to-control", "up")
        yield network
    finally:
        _remove(token, control_links, str(block))


def leftovers(network: Network) -> list[str]:
    """What of ``network`` still exists (after it was removed: nothing)."""
    names = _ip("netns", "list", check=False).stdout
    links = _ip("-o", "link", check=False).stdout
    routes = _ip("route", "show", "type", "unreachable", check=False).stdout
    return (
        [n.split()[0] for n in names.splitlines() if f"wh-{network.token}-" in n]
        + [
            line.split(":")[1].strip()
            for line in links.splitlines()
            if f"wh{network.token}c" in line
        ]
        + [r for r in routes.splitlines() if r.split()[1:2] == [str(network.block)]]
    )


__all__ = ["Network", "NetworkError", "can_make_hosts", "leftovers", "start_network"]
