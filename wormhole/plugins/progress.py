"""Progress of long work: an initial snapshot, a ``wormhole run --once``.

Whoever does the work reports it on a :class:`ProgressTask` (``advance`` as it goes, a
total when it knows one); a source gets its :class:`Progress` in its
:class:`wormhole.plugins.components.SourceContext`. What the operator sees is decided
here, once: a progress bar (``rich``) when stderr is a terminal, and otherwise a log line
every ``interval_s`` seconds (and one when a task ends) with what is done of the total,
the rate and the time left. ``wormhole top`` shows the running tasks too (``live.json``).

Part of the plugin contract, like :mod:`wormhole.plugins.events`: it imports nothing of the
engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import IO, Any

log = logging.getLogger("wormhole.progress")

DEFAULT_INTERVAL_S = 5.0


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class ProgressTask:
    """One piece of long work: ``done`` of ``total`` (None: not known) ``unit``."""

    def __init__(
        self, owner: Progress, name: str, total: int | None, unit: str, estimate: bool = True
    ) -> None:
        self.owner = owner
        self.name = name
        self.total = total
        self.estimate = estimate
        """Whether ``total`` is an estimate (a database's row count): shown as ``~N``, and
        once the work goes past it, no longer shown as a total (nor is an ETA)."""
        self.unit = unit
        self.done = 0
        self.detail = ""
        """What is being worked on now (a table's name, say)."""
        self.started = time.monotonic()
        self.finished: float | None = None
        self._next_log = self.started + owner.interval_s
        self._bar: Any = None

    # ---------------------------------------------------------------- reporting
    def advance(self, count: int, detail: str | None = None) -> None:
        """``count`` more are done (``detail``: what is being worked on now)."""
        self.update(done=self.done + count, detail=detail)

    def update(
        self,
        done: int | None = None,
        total: int | None = None,
        detail: str | None = None,
        estimate: bool | None = None,
    ) -> None:
        """Set what is done, the total (``estimate``: whether it is one), or the detail
        (what is left as is when None)."""
        with self.owner.lock:
            if done is not None:
                self.done = done
            if total is not None:
                self.total = total
            if estimate is not None:
                self.estimate = estimate
            if detail is not None:
                self.detail = detail
        self.owner._show(self)

    def forget_total(self) -> None:
        """The total is not known (any more): no percentage, no ETA."""
        with self.owner.lock:
            self.total = None
        self.owner._show(self)

    def finish(self) -> None:
        """The work is done: a last line (or the bar at its end), and the task leaves."""
        if self.finished is not None:
            return
        self.finished = time.monotonic()
        # What was done is the total now, exactly.
        self.total, self.estimate = self.done, False
        self.owner._finish(self)

    # ----------------------------------------------------------------- figures
    @property
    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    @property
    def rate(self) -> float:
        """Units done per second, over the whole task so far."""
        elapsed = self.elapsed
        return self.done / elapsed if elapsed > 0 else 0.0

    @property
    def known_total(self) -> int | None:
        """The total to show: None when there is none, or when the work went past an
        estimate (the estimate was wrong; how much is left is not known)."""
        total = self.total
        if total is None or (self.estimate and self.done > total):
            return None
        return max(total, self.done)

    @property
    def eta(self) -> float | None:
        """Seconds left at the rate so far (None: no total, or no rate yet)."""
        rate = self.rate
        total = self.known_total
        if total is None or rate <= 0:
            return None
        return max(0.0, (total - self.done) / rate)

    def figures(self) -> dict[str, Any]:
        """The task as ``live.json`` carries it."""
        eta = self.eta
        return {
            "name": self.name,
            "unit": self.unit,
            "done": self.done,
            "total": self.known_total,
            "estimate": self.estimate,
            "detail": self.detail,
            "rate": round(self.rate, 1),
            "eta_seconds": None if eta is None else round(eta, 1),
            "elapsed_seconds": round(self.elapsed, 1),
        }

    def line(self) -> str:
        """The task in a log line: ``initial snapshot: 20,000 of ~50,000 rows (40%), ...``."""
        total = self.known_total
        if total:
            about = "~" if self.estimate else ""
            of = f" of {about}{total:,} {self.unit} ({100 * self.done / total:.0f}%)"
        elif self.total and self.finished is None:
            # An estimate the work went past: say so rather than show done > total.
            of = f" {self.unit} (more than the estimated {self.total:,}; total not known)"
        else:
            of = f" {self.unit}"
        text = f"{self.name}: {self.done:,}{of}, {self.rate:,.0f} {self.unit}/s"
        if self.finished is not None:
            text += f", done in {_duration(self.elapsed)}"
        else:
            eta = self.eta
            text += f", ETA {_duration(eta)}" if eta is not None else ""
        return f"{text} ({self.detail})" if self.detail else text


class Progress:
    """Where the progress of a process's long work goes (see the module docstring).

    ``bar``: draw rich progress bars on ``stream`` (stderr) instead of logging lines.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        bar: bool = False,
        stream: IO[str] | None = None,
    ) -> None:
        self.log = logger or log
        self.interval_s = interval_s
        self.bar = bar
        self.stream = stream
        self.lock = threading.Lock()
        self.running: list[ProgressTask] = []
        self._rich: Any = None

    @classmethod
    def for_stderr(cls, logger: logging.Logger | None, interval_s: float) -> Progress:
        """Bars when stderr is a terminal, log lines otherwise."""
        import sys

        stream = sys.stderr
        try:
            terminal = stream.isatty()
        except (AttributeError, ValueError):
            terminal = False
        return cls(logger, interval_s, bar=terminal, stream=stream)

    def task(
        self, name: str, total: int | None = None, unit: str = "rows", estimate: bool = True
    ) -> ProgressTask:
        """Start reporting a piece of work (``estimate``: whether ``total`` is one)."""
        task = ProgressTask(self, name, total, unit, estimate)
        with self.lock:
            self.running.append(task)
        if self.bar:
            self._add_bar(task)
        return task

    def tasks(self) -> list[dict[str, Any]]:
        """The running tasks' figures."""
        with self.lock:
            running = list(self.running)
        return [t.figures() for t in running]

    def close(self) -> None:
        """Stop drawing (tasks still running are left where they are)."""
        with self.lock:
            rich, self._rich = self._rich, None
        if rich is not None:
            rich.stop()

    # ------------------------------------------------------------------ drawing
    def _show(self, task: ProgressTask) -> None:
        if task._bar is not None:
            self._draw(task)
            return
        now = time.monotonic()
        if now >= task._next_log:
            task._next_log = now + self.interval_s
            self.log.info("%s", task.line())

    def _finish(self, task: ProgressTask) -> None:
        with self.lock:
            if task in self.running:
                self.running.remove(task)
            last = not self.running
        if task._bar is not None:
            self._draw(task)
            if last:
                self.close()
        self.log.info("%s", task.line())

    def _add_bar(self, task: ProgressTask) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bars

        with self.lock:
            if self._rich is None:
                self._rich = Bars(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]}"),
                    TimeRemainingColumn(),
                    TextColumn("{task.fields[detail]}"),
                    console=Console(file=self.stream, stderr=self.stream is None),
                    refresh_per_second=4,
                )
                self._rich.start()
            task._bar = self._rich.add_task(task.name, total=task.total, rate="", detail="")

    def _draw(self, task: ProgressTask) -> None:
        rich = self._rich
        if rich is None:
            return
        total = task.known_total
        rich.update(
            task._bar,
            completed=task.done,
            total=total,
            rate=f"{task.rate:,.0f} {task.unit}/s",
            detail=task.detail,
        )


__all__ = ["DEFAULT_INTERVAL_S", "Progress", "ProgressTask"]
