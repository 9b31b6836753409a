"""Errors a user can cause. Each carries a message that names the input and the fix."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (drivers add pages of context), or its
    repr when the message is empty."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


class WormholeError(Exception):
    """Base class for errors that are reported to the user without a traceback."""

    exit_code = 2


class ConfigError(WormholeError):
    """The pipeline file or an option in it is wrong."""

    def __init__(self, problems: list[str] | str, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        super().__init__(head + "; ".join(self.problems))

    def render(self) -> str:
        lines = [f"invalid pipeline{f' {self.source}' if self.source else ''}:"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


class Stopped(WormholeError):
    """A stop was asked for (SIGTERM, Ctrl-C, ``stop()``) before the command got going:
    while it waited for the registry, say. Not a failure: the command exits 0, as a stop
    does later, and nothing was claimed or acknowledged."""

    exit_code = 0


class StateError(WormholeError):
    """The state directory cannot be used (unwritable, or inconsistent with the pipeline)."""


class LogCorruptError(WormholeError):
    """A log file is damaged somewhere other than its tail."""

    def __init__(self, path: str, offset: int, reason: str) -> None:
        self.path = path
        self.offset = offset
        super().__init__(
            f"{path}: corrupt record at offset {offset} ({reason}); the log cannot be read "
            f"past it. Restore the file from a copy, or move it and everything after it away "
            f"to start over from an earlier state."
        )


class SourceError(WormholeError):
    """The source cannot be read (missing path, unreadable file, malformed record)."""


class SourceStopped(SourceError):
    """The source was asked to stop (its context's ``stop`` event) while it waited, for a
    reconnect say. Not a failure: the run ends as a graceful stop does."""


class BackfillError(WormholeError):
    """A backfill cannot run as asked (a table without a primary key, a condition that does
    not parse, a table already being backfilled); nothing was changed."""


class SinkError(WormholeError):
    """A sink could not make a batch durable."""


class StartError(StateError):
    """A new application's start point is outside the publisher log: that application does
    not run; the others do."""


class FilterError(WormholeError):
    """An application's filter cannot be applied (a column it names does not exist).

    It stops that application's delivery only; the other applications go on.
    """

    def __init__(self, application: str, message: str) -> None:
        super().__init__(message)
        self.application = application


def file_problem(
    path: object, exc: BaseException | None, what: str, setting: str = "state_dir"
) -> StateError:
    """A file-system error on ``path`` as an error that names the path and the fix.

    ``what`` says what could not be done (``"lock the state dir"``), ``setting`` the key of
    the pipeline file that chose the path. For an error without an errno (SQLite's
    ``attempt to write a readonly database``), the path is probed for the cause."""
    import errno
    import os

    name = os.fspath(path)  # type: ignore[call-overload]
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else _probe(name)
    reason = os.strerror(code) if code else first_line(exc) if exc else "not writable"
    if code in (errno.EACCES, errno.EPERM):
        fix = (
            f"run wormhole as the user that owns it{_owner(name)}, give this user (uid "
            f"{os.geteuid()}) write access to it, or set {setting} to a directory this user "
            f"may write"
        )
    elif code == errno.EROFS:
        fix = f"its file system is mounted read-only: remount it read-write, or set {setting} "
        fix += "to a writable directory"
    elif code in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space on that disk, or set {setting} to a directory on another one"
    else:
        fix = f"check the path and its permissions, or set {setting} to another directory"
    return StateError(f"cannot {what}: {name}: {reason}; {fix}")


def _probe(path: str) -> int | None:
    """Why ``path`` (a file, or the directory meant to hold it) cannot be written."""
    import os

    if os.path.isdir(path):
        return _probe_dir(path)
    if os.path.exists(path):
        try:
            os.close(os.open(path, os.O_WRONLY))
        except OSError as exc:
            return exc.errno
    # Missing, or writable while its directory (SQLite's journal) may not be.
    return _probe_dir(os.path.dirname(path) or ".")


def _probe_dir(directory: str) -> int | None:
    import os

    try:
        probe = os.path.join(directory, f".wormhole-probe-{os.getpid()}")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as exc:
        return exc.errno
    return None


def _owner(path: str) -> str:
    """`` (user NAME, uid N)`` for the file or, if missing, its directory; "" if unknown."""
    import os
    import pwd

    for candidate in (path, os.path.dirname(path)):
        try:
            uid = os.stat(candidate).st_uid
        except OSError:
            continue
        try:
            return f" (user {pwd.getpwuid(uid).pw_name}, uid {uid})"
        except KeyError:
            return f" (uid {uid})"
    return ""
