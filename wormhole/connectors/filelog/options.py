"""The ``filelog`` source's options."""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, Field

from wormhole.plugins.components import Options


class FilelogOptions(Options):
    """Read updates from files: JSON lines, or logs written by ``wormhole.publish.LogWriter``."""

    path: str = Field(description="a file, a directory of files, or a directory of streams")
    format: Literal["auto", "jsonl", "logwriter"] = Field(
        "auto", description="file format; auto recognises LogWriter files by their framing"
    )
    table: str | None = Field(
        None, description="table for lines that name none (default: the file's directory name)"
    )
    glob: str | None = Field(
        None,
        description="read only files whose name matches this pattern, e.g. '*.jsonl' (files "
        "being written under another name, a .tmp, are then left alone); default: every "
        "file whose name does not start with a dot",
    )
    batch_bytes: ByteSize = Field(ByteSize(1 << 20), description="read at most this much per batch")
    poll_interval_ms: int = Field(100, ge=1, description="how often to look for new data")
    on_decode_error: Literal["fallback", "stop"] = Field(
        "fallback",
        description="a line (or LogWriter record) that is not an update: skip it, recorded "
        "in the state_dir's filelog-rejects.jsonl, with a warning (fallback), or stop there "
        "after delivering what precedes it (stop)",
    )
