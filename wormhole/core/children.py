"""Subscriber processes that ``wormhole run`` starts for applications with a sink.

Each is ``wormhole subscribe PIPELINE --app NAME --instance N`` in a session of
its own (a Ctrl-C in the terminal reaches the publisher, which then stops its
subscribers in order) that dies with the publisher (``--exit-with-parent``).
One that exits is restarted with backoff; one that exits with code 2 (a fatal
error, already reported) fails the run.
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
from typing import Any

from wormhole.core.errors import WormholeError

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
        self.thread: threading.Thread | None = None

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
        backoff: dict[Key, float] = {}
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
                if time.monotonic() - self.started.get(key, 0.0) > 30:
                    backoff.pop(key, None)  # it ran for a while: restart promptly
                delay = backoff.get(key, 0.5)
                log.warning(
                    "subscriber %s/%d exited with code %s; restarting in %.1fs",
                    key[0],
                    key[1],
                    code,
                    delay,
                )
                if self.stopping.wait(delay):
                    return
                backoff[key] = min(delay * 2, 30.0)
                if key in self.children:
                    self.spawn(*key)

    def stop(self, deadline: float, application: str | None = None) -> None:
        """SIGTERM the subscribers (of one application, or all of them), wait until
        ``deadline`` (monotonic), then kill what is left."""
        if application is None:
            self.stopping.set()
            leaving = dict(self.children)
        else:
            leaving = {k: c for k, c in self.children.items() if k[0] == application}
            for key in leaving:
                self.children.pop(key, None)
        for child in leaving.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for key, child in leaving.items():
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("subscriber %s/%d did not stop in time; killing it", *key)
                child.kill()
                child.wait()
