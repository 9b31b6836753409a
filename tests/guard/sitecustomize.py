"""Imported at start-up by every Python process with this directory on ``PYTHONPATH``
(the Spark driver and executors' Python workers in tests/test_spark_cluster.py).

With ``WORMHOLE_GUARD_DIR`` set, an audit hook refuses every open and listing of a path
under that directory, and records it in ``WORMHOLE_GUARD_LOG``: a test proves a process
never touched the directory, and checks that the guard works by tripping it on purpose.
"""

from __future__ import annotations

import os
import sys

_GUARDED = os.environ.get("WORMHOLE_GUARD_DIR")
_LOG = os.environ.get("WORMHOLE_GUARD_LOG", os.devnull)
_EVENTS = {"open", "os.listdir", "os.scandir", "os.mkdir", "os.rename", "os.remove"}


def _install(guarded: str) -> None:
    root = os.path.realpath(guarded)

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event not in _EVENTS or not args or not isinstance(args[0], str | bytes):
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        if path == root or path.startswith(root + os.sep):
            import traceback

            with open(_LOG, "a") as log:
                log.write(f"{os.getpid()} {event} {path}\n")
                log.write("".join(traceback.format_stack(limit=12)))
            raise PermissionError(f"guarded directory: {path}")

    sys.addaudithook(hook)


if _GUARDED:
    _install(_GUARDED)
