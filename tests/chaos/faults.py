"""Faults for the chaos suite: a seeded schedule, and how each fault is injected.

The schedule (which faults, in which order, the waits between them, the victims and
the durations) is a function of the seed alone, so a failing seed can be rerun with
the same faults. When they land relative to the stream still depends on the machine.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from wormhole.testing.helpers import subscriber_pids

KILL_PUBLISHER = "kill -9 publisher"
KILL_SUBSCRIBER = "kill -9 subscriber"
PAUSE_SUBSCRIBER = "SIGSTOP subscriber past its heartbeat timeout"
CUT_SUBSCRIBERS = "cut subscriber connections"
RESTART_DATABASE = "restart database"
CUT_SOURCE = "cut source connection"
THROTTLE_SOURCE = "throttle source connection"


@dataclass(frozen=True)
class Fault:
    kind: str
    gap_s: float
    """How long the stream runs undisturbed before this fault."""
    victim: int
    """Picks the subscriber (an index into the sorted (application, instance) list)."""
    hold_s: float
    """How long a stop outlasts the heartbeat timeout, or a throttle lasts."""

    def describe(self) -> str:
        return f"{self.kind} (after {self.gap_s:.2f}s, victim {self.victim}, {self.hold_s:.2f}s)"


def schedule(rng: random.Random, kinds: list[str], count: int) -> list[Fault]:
    """``count`` faults: every kind at least once, the rest drawn at random, shuffled."""
    order = list(kinds) + rng.choices(kinds, k=max(0, count - len(kinds)))
    rng.shuffle(order)
    return [
        Fault(kind, rng.uniform(0.5, 2.0), rng.randrange(1 << 16), rng.uniform(0.3, 1.5))
        for kind in order
    ]


def subscribers_of(publisher: int) -> dict[tuple[str, int], int]:
    """``(application, instance) -> pid`` of the subscriber processes ``publisher`` started."""
    out = {}
    for pid in subscriber_pids(publisher):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # gone meanwhile
        out[(args[args.index("--app") + 1], int(args[args.index("--instance") + 1]))] = pid
    return out


def tcp_connections(pid: int) -> dict[int, tuple[int, int]]:
    """``socket inode -> (local port, remote port)`` of the IPv4 TCP sockets ``pid`` holds."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
        table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return {}  # the process is gone
    out = {}
    for row in table:
        fields = row.split()
        inode = int(fields[9])
        if inode in inodes:
            out[inode] = (int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16))
    return out


def cut(*filter_words: str) -> int:
    """Close the loopback TCP connections that match an ``ss`` filter, both ends (the
    kernel aborts them: the peers see a reset). Returns how many sockets were closed."""
    result = subprocess.run(
        ["ss", "-K", "-t", "-n", "dst", "127.0.0.1", *filter_words],
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(1 for line in result.stdout.splitlines()[1:] if line.strip())


def cut_port(port: int) -> int:
    """Cut every connection to or from the listening ``port`` (both ends)."""
    return cut("(", "sport", "=", f":{port}", "or", "dport", "=", f":{port}", ")")


def cut_process_connections(pid: int, remote_port: int) -> int:
    """Cut ``pid``'s connections to ``remote_port`` (and only those)."""
    closed = 0
    for local, remote in tcp_connections(pid).values():
        if remote == remote_port:
            closed += cut("(", "sport", "=", f":{local}", "and", "dport", "=", f":{remote}", ")")
    return closed


def send(pid: int, signum: signal.Signals) -> bool:
    """Signal ``pid``; False if it is already gone."""
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
