"""Subscriber processes that ``wormhole run`` starts for applications with a sink.

The engine starts them (:mod:`wormhole.core.subscriber_launch`) for a transport that
declares the ``subscriber_processes`` capability, once the transport has started: one
:class:`SubscriberProcesses` per run, ``spawn`` for each application's instances, and
``stop`` at the point of the transport's stop that it chooses (``hub.stop_subscribers``).

Each is ``wormhole subscribe PIPELINE --app NAME --instance N`` in a session of
its own (a Ctrl-C in the terminal reaches the publisher, which then stops its
subscribers in order) that dies with the publisher (``--exit-with-parent``).
One that exits is restarted with backoff; one that exits with code 2 (a fatal
error, already reported) fails the run.

At a graceful stop every subscriber gets SIGTERM and is waited for as long as it
makes progress: closing a sink can take long (a Spark refresh, an index commit),
and killing it then would leave the sink unfinished. Progress is CPU time spent
by the subscriber's process tree (its sink's helper processes, such as Spark's
JVM, included). One that makes none for the stall time is killed, and one that
exits with an error fails the run, naming its application.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wormhole.core.backoff import Backoff
from wormhole.core.errors import WormholeError
from wormhole.plugins.metrics_endpoint import SubscriberPorts

log = logging.getLogger("wormhole.subscriber")

Key = tuple[str, int]


class SubscriberProcesses:
    def __init__(self, hub: Any, label: str, extra_args: Callable[[], list[str]] = list) -> None:
        self.hub = hub
        self.label = label
        self.extra_args = extra_args
        """More arguments for ``wormhole subscribe`` (e.g. the publisher's address)."""
        self.children: dict[Key, subprocess.Popen[bytes]] = {}
        self.started: dict[Key, float] = {}
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        metrics = getattr(hub.pipeline, "metrics", None)
        self.metrics_ports = SubscriberPorts(metrics.listen) if metrics is not None else None
        """With metrics: each subscriber serves on a port after the publisher's."""

    def spawn(self, application: str, index: int) -> None:
        command = [
            sys.executable,
            "-m",
            "wormhole.cli",
            "subscribe",
            self.hub.pipeline.file,
            "--app",
            application,
            "--instance",
            str(index),
            *self.extra_args(),
            *(
                ["--metrics", self.metrics_ports.address(application, index)]
                if self.metrics_ports is not None
                else []
            ),
            "--exit-with-parent",
            str(os.getpid()),
        ]
        self.children[(application, index)] = subprocess.Popen(command, start_new_session=True)
        self.started[(application, index)] = time.monotonic()
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._supervise, name=f"{self.label} children", daemon=True
            )
            self.thread.start()

    def _supervise(self) -> None:
        try:
            self._restart_loop()
        finally:
            # Children forked here (restarts) get PR_SET_PDEATHSIG when this *thread*
            # exits, not the process: it must outlive them, or a graceful stop would
            # SIGKILL every restarted subscriber instead of letting it drain.
            self.stopped.wait()

    def _restart_loop(self) -> None:
        backoff: dict[Key, Backoff] = {}
        while not self.stopping.wait(0.2):
            for key, child in list(self.children.items()):
                code = child.poll()
                if code is None or self.stopping.is_set() or key not in self.children:
                    continue
                if code == 2:
                    self.hub.fail(
                        WormholeError(
                            f"subscriber {key[0]}/{key[1]} stopped with a fatal error (see above)"
                        )
                    )
                    return
                if key not in backoff:
                    backoff[key] = Backoff(log, first=0.5, cap=30.0, stop=self.stopping)
                elif time.monotonic() - self.started.get(key, 0.0) > 30:
                    backoff[key].reset()  # it ran for a while: restart promptly
                if not backoff[key].wait(
                    "subscriber %s/%d exited with code %s; restarting in %.1fs",
                    key[0],
                    key[1],
                    code,
                ):
                    return
                if key in self.children:
                    self.spawn(*key)

    def applications(self) -> list[str]:
        """The applications with subscriber processes, sorted."""
        return sorted({app for app, _ in self.children})

    def stop(self, deadline: float, application: str | None = None, stall: float = 10.0) -> None:
        """SIGTERM the subscribers (of one application, or all of them) and wait for them.

        Until ``deadline`` (monotonic) they may take their time; after it, one that has
        made no progress for ``stall`` seconds (the transport's drain timeout) is killed.
        When all have stopped, one that was killed or exited with an error fails the run.
        Stopping all of them a second time does nothing.
        """
        if application is None and self.stopped.is_set():
            return
        if application is None:
            self.stopping.set()
            leaving = dict(self.children)
        else:
            leaving = {k: c for k, c in self.children.items() if k[0] == application}
            for key in leaving:
                self.children.pop(key, None)
        running = {k: c for k, c in leaving.items() if c.poll() is None}
        for child in running.values():
            child.send_signal(signal.SIGTERM)
        waited = [self._wait(key, child, deadline, stall) for key, child in running.items()]
        problems = [p for p in waited if p]
        for problem in problems:
            log.error("%s", problem)
        if application is None:
            self.stopped.set()
            if problems:
                self.hub.fail(WormholeError("; ".join(problems)))

    def _wait(
        self, key: Key, child: subprocess.Popen[bytes], deadline: float, stall: float
    ) -> str | None:
        """Wait for one subscriber to exit; what went wrong, if anything."""
        name = f"{key[0]}/{key[1]}"
        spent = _cpu_seconds(child.pid)
        last_progress = time.monotonic()
        while True:
            try:
                code = child.wait(PROGRESS_SAMPLE_S)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            before, spent = spent, _cpu_seconds(child.pid)
            busy = PROGRESS_CPU * PROGRESS_SAMPLE_S
            if spent is not None and before is not None and spent - before >= busy:
                last_progress = now
            if now < deadline or now - last_progress < stall:
                continue
            log.warning(
                "subscriber %s made no progress for %.0fs while stopping; killing it",
                name,
                now - last_progress,
            )
            child.kill()
            child.wait()
            return (
                f"subscriber {name} of application {key[0]} made no progress for "
                f"{now - last_progress:.0f}s while stopping and was killed: its sink did not "
                f"finish closing (transport.drain_timeout_s is how long a stopping subscriber "
                f"may sit idle)"
            )
        if code == -signal.SIGTERM:
            # Ended by the signal's default action: it had not reached `wormhole subscribe`'s
            # handlers yet, which are installed before its sink opens. Nothing to close.
            return None
        if code != 0:
            return (
                f"subscriber {name} of application {key[0]} exited with code {code} while "
                f"stopping: its sink did not close cleanly (see its messages above)"
            )
        return None


PROGRESS_SAMPLE_S = 0.5
PROGRESS_CPU = 0.05
"""A stopping subscriber whose process tree uses at least this share of one core is busy
(a background thread's idle wake-ups stay well below it)."""


def _cpu_seconds(pid: int) -> float | None:
    """CPU time of a process and its live descendants (None where /proc cannot tell)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    pending = [pid]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
            # Fields after the command name (which may hold spaces): utime is the 12th
            # of those, stime, cutime and cstime follow.
            fields = stat[stat.rindex(")") + 2 :].split()
            total += sum(int(f) for f in fields[11:15])
            for task in Path(f"/proc/{current}/task").iterdir():
                children = (task / "children").read_text().split()
                pending.extend(int(c) for c in children)
        except (OSError, ValueError, IndexError):
            if current == pid:
                return None
    return total / tick
