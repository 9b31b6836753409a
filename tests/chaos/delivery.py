"""What the chaos suite checks in each application's output, flow by flow.

The publisher log is the reference: it numbers every update (its seq) once, in the
order the flows must deliver them. For each flow (application, shard), the updates in
the application's jsonl file, in file order, must be *runs* of consecutive updates of
the flow. A run that starts where delivery has not been yet continues the flow (no
gap); a run that starts earlier is a replay. Every replay must start at or after the
flow's datamarker that was persisted before the last fault that precedes it in the file
(a datamarker never moves back, and the docs promise that nothing before the persisted
datamarker is delivered again). At the end every flow has delivered its last update.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from wormhole.core.datamarkers import read_datamarkers
from wormhole.core.publisher_log import inspect_log, read_log_range


@dataclass
class Snapshot:
    """Taken just before a fault: the persisted datamarkers, then the output files' sizes.

    Everything at or past ``sizes[app]`` in a file was written after the datamarkers were
    read, so no replay there may start before them.
    """

    fault: str
    datamarkers: dict[tuple[str, int], int]
    sizes: dict[str, int]

    @classmethod
    def take(cls, fault: str, state_dir: Path, outputs: dict[str, Path]) -> Snapshot:
        markers = {k: d.position for k, d in read_datamarkers(state_dir).items()}
        sizes = {app: _size(path) for app, path in outputs.items()}
        return cls(fault, markers, sizes)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class _Key(msgspec.Struct):
    id: int


class _Row(msgspec.Struct):
    id: int
    n: int


class _Line(msgspec.Struct):
    key: _Key
    after: _Row
    shard: int


def log_seqs(state_dir: Path) -> dict[tuple[int, int], tuple[int, int]]:
    """``(id, n) -> (seq, shard)`` for every update in the publisher log, which must hold
    each change exactly once (the source resumed exactly after every fault)."""
    log = state_dir / "log"
    info = inspect_log(log)
    assert info.first_seq == 0, f"the publisher log was collected up to {info.first_seq}"
    decode_row = msgspec.json.Decoder(_Row).decode
    seqs: dict[tuple[int, int], tuple[int, int]] = {}
    for seq, update in read_log_range(log, 0, info.next_seq):
        row = decode_row(update.after)
        previous = seqs.setdefault((row.id, row.n), (seq, update.shard))
        assert previous[0] == seq, (
            f"the publisher log holds key {row.id} n={row.n} twice: seq {previous[0]} and {seq}"
        )
    return seqs


@dataclass
class Replay:
    shard: int
    start: int
    """Seq of the first update delivered again."""
    length: int
    snapshot: int
    """Index of the last fault before it (-1: none)."""


@dataclass
class Report:
    application: str
    lines: int
    duplicates: int
    replays: list[Replay] = field(default_factory=list)

    def per_fault(self, snapshots: list[Snapshot]) -> dict[str, tuple[int, int]]:
        """``"#i fault" -> (replays, duplicates)`` for the faults that preceded replays."""
        out: dict[str, tuple[int, int]] = {}
        for r in self.replays:
            name = f"#{r.snapshot + 1} {snapshots[r.snapshot].fault}" if r.snapshot >= 0 else "-"
            count, dups = out.get(name, (0, 0))
            out[name] = (count + 1, dups + r.length)
        return out


def check_flows(
    application: str,
    path: Path,
    seqs: dict[tuple[int, int], tuple[int, int]],
    snapshots: list[Snapshot],
) -> Report:
    """Check one application's output against the publisher log (see the module doc)."""
    order: dict[int, list[int]] = defaultdict(list)
    for seq, shard in sorted(seqs.values()):
        order[shard].append(seq)
    index = {seq: i for flow in order.values() for i, seq in enumerate(flow)}
    high: dict[int, int] = defaultdict(lambda: -1)
    previous: dict[int, int] = defaultdict(lambda: -1)
    open_replay: dict[int, Replay] = {}
    report = Report(application, 0, 0)
    bounds = [s.sizes.get(application, 0) for s in snapshots]
    decode = msgspec.json.Decoder(_Line).decode
    offset = 0
    fault = -1
    with open(path, "rb") as f:
        for line in f:
            while fault + 1 < len(bounds) and bounds[fault + 1] <= offset:
                fault += 1
            where = f"{path.name} offset {offset}"
            assert line.endswith(b"\n"), f"{where}: a partial last line"
            try:
                e = decode(line)
            except msgspec.DecodeError as exc:
                message = f"{where}: not an update envelope ({exc}): {line[:200]!r}"
                raise AssertionError(message) from exc
            offset += len(line)
            report.lines += 1
            found = seqs.get((e.key.id, e.after.n))
            assert found is not None, f"{where}: key {e.key.id} n={e.after.n} is not in the log"
            seq, shard = found
            assert shard == e.shard, f"{where}: shard {e.shard}, the log says {shard}"
            i = index[seq]
            if i != previous[shard] + 1:  # a new run
                assert i <= high[shard] + 1, (
                    f"{where}: flow {application}/{shard} skipped from seq "
                    f"{order[shard][high[shard]] if high[shard] >= 0 else '(start)'} to {seq}: "
                    f"{i - high[shard] - 1} updates missing or reordered"
                )
                open_replay.pop(shard, None)
                if i <= high[shard]:
                    assert fault >= 0, (
                        f"{where}: flow {application}/{shard} delivered seq {seq} again "
                        f"before any fault"
                    )
                    persisted = snapshots[fault].datamarkers.get((application, shard), 0)
                    assert seq >= persisted, (
                        f"{where}: flow {application}/{shard} replayed from seq {seq}, before "
                        f"its datamarker {persisted} persisted before fault #{fault + 1} "
                        f"({snapshots[fault].fault})"
                    )
                    replay = Replay(shard, seq, 0, fault)
                    report.replays.append(replay)
                    open_replay[shard] = replay
            if i <= high[shard]:
                report.duplicates += 1
                open_replay[shard].length += 1
            else:
                open_replay.pop(shard, None)
                high[shard] = i
            previous[shard] = i
    for shard, flow in order.items():
        delivered = high[shard] + 1
        assert delivered == len(flow), (
            f"flow {application}/{shard} delivered {delivered} of its {len(flow)} updates "
            f"(next missing: seq {flow[delivered] if delivered < len(flow) else '-'})"
        )
    assert os.path.getsize(path) == offset
    return report
