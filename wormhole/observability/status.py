"""The live status of a running publisher: ``<state_dir>/live.json``.

The built-in observability plugin writes the publisher's snapshot
(:class:`wormhole.core.snapshot.RunSnapshot`) there every datamarker interval; ``wormhole
status`` (and ``wormhole forget``, ``wormhole top``) read it to show caravans, their
positions and read rates, the applications served and those that failed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("wormhole.publisher")

FILENAME = "live.json"


def save(state_dir: Path, status: dict[str, Any]) -> None:
    """Write ``status`` (a publisher's snapshot) to ``<state_dir>/live.json``."""
    path = state_dir / FILENAME
    temporary = path.with_name(f".{FILENAME}.tmp")
    try:
        temporary.write_text(json.dumps(status))
        os.replace(temporary, path)
    except OSError as exc:  # status only: never fatal
        log.debug("cannot write %s: %s", path, exc)


def read_live_status(state_dir: Path) -> dict[str, Any] | None:
    """The running publisher's live status, or None if no publisher is running there."""
    try:
        live = json.loads((state_dir / FILENAME).read_text())
        os.kill(int(live["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dict(live)
