from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

SUPPORT = Path(__file__).parent / "support"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def support_env() -> dict[str, str]:
    """Environment that loads the misbehaving test sinks into `wormhole` subprocesses."""
    path = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    return {"PYTHONPATH": path, "WORMHOLE_PLUGINS": "wormhole_test_support"}


def rider_sequences(envelopes: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Per rider, the `seq` values in delivery order."""
    out: dict[int, list[int]] = defaultdict(list)
    for e in envelopes:
        out[e["key"]["rider"]].append(e["after"]["seq"])
    return out


def assert_complete_in_order(
    envelopes: list[dict[str, Any]], riders: int, seconds: int, duplicates_allowed: bool
) -> int:
    """Every rider's positions 0..seconds-1 arrived, first occurrences in order.

    At-least-once delivery after a crash replays a suffix of a flow; a replayed
    position repeats one already delivered and never overtakes a newer one.
    Returns the number of duplicates.
    """
    sequences = rider_sequences(envelopes)
    assert sorted(sequences) == list(range(riders)), "some riders never arrived"
    duplicates = 0
    for rider, seqs in sequences.items():
        high = -1
        previous = -1
        for s in seqs:
            if s > high:
                assert s == high + 1, f"rider {rider}: position {s} arrived before {high + 1}"
                high = s
            else:
                duplicates += 1
                # A replay runs forward from where it restarted.
                assert s == previous + 1 or s <= high, f"rider {rider}: replay out of order"
            previous = s
        assert high == seconds - 1, f"rider {rider}: last position {high}, expected {seconds - 1}"
    if not duplicates_allowed:
        assert duplicates == 0, f"{duplicates} duplicates without a crash"
    return duplicates


def check_rounds(path: Path, keys: int, rounds: int) -> int:
    """Each key ``id`` of a jsonl file saw ``n`` go 0..rounds-1 (or from its snapshot row's
    ``n``); replays repeat, never skip or reorder. Returns the number of duplicates."""
    import msgspec

    decoder = msgspec.json.Decoder()
    high = [-1] * keys
    duplicates = 0
    with open(path, "rb") as f:
        for line in f:
            e = decoder.decode(line)
            key, n = e["key"]["id"], e["after"]["n"]
            if e["op"] == "r":
                assert high[key] == -1, f"key {key}: a snapshot row after changes"
                high[key] = n
            elif n > high[key]:
                assert n == high[key] + 1, f"key {key}: {n} arrived before {high[key] + 1}"
                high[key] = n
            else:
                duplicates += 1
    assert high == [rounds - 1] * keys
    return duplicates


def fill_filesystem(path: Path) -> None:
    """Write ``path`` until the filesystem it is on is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 1024):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Any:
    """A real 256 KiB tmpfs, to fill up: a full disk without filling the machine's."""
    import subprocess

    from wormhole.testing import require

    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    ok = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mountpoint)],
            capture_output=True,
        ).returncode
        == 0
    )
    require(ok, "mounting a small tmpfs (needs root)")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
