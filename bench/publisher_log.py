"""The publisher log on its own: append, reopen, first read from disk, an offline range read
and ``position_at_time`` on a log of many batches and segments.

Run: ``python bench/publisher_log.py`` (figures for this tree), or
``python bench/publisher_log.py --against DIR`` to alternate rounds between this tree and the
checkout in DIR on the same machine and print the ratios (this tree / DIR; below 1 is faster).

Every case writes its own log (``log.fsync: false``) of ``--batches`` batches of
``--batch-size`` updates, rolled every ``--roll-size`` bytes, then:

* ``append``: seconds to append every batch;
* ``open``: seconds to open the written log again (recovery of the newest segment);
* ``first read``: seconds for a new reader in the middle of the log to return its first batch
  from disk (what a caravan catching up pays on its first read of an old segment);
* ``read all``: seconds for one reader to read the whole log from disk;
* ``range``: seconds for ``read_log_range`` of 1,000 updates in the middle of the log;
* ``at time``: seconds for ``position_at_time`` of an update in the middle of the log;
* then the index files are deleted, as in a log written before segments had them, and
  ``range`` and ``at time`` are measured again (what they cost when they scan: the ratio
  printed for each), then ``open`` (which indexes every segment again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = (
    "append",
    "open",
    "first read",
    "read all",
    "range",
    "at time",
    "range, no index",
    "at time, no index",
    "open, no index",
)
BASELINES = {"range": "range, no index", "at time": "at time, no index"}


def measure(batches: int, batch_size: int, roll_size: int) -> dict[str, float]:
    from wormhole.core.publisher_log import PublisherLog, position_at_time, read_log_range
    from wormhole.core.update import Update

    root = Path(tempfile.mkdtemp(prefix="wh-bench-plog-"))
    try:
        row = {"id": 1, "name": "x" * 100}
        base_ts = 1_700_000_000_000
        out: dict[str, float] = {}
        plog = PublisherLog(root, roll_size=roll_size, fsync=False, tail_updates=1)
        plog.open()
        started = time.perf_counter()
        for b in range(batches):
            updates = [
                Update.create(
                    op="c",
                    key={"id": b * batch_size + i},
                    after=row,
                    table="t",
                    ts_ms=base_ts + b * batch_size + i,
                )
                for i in range(batch_size)
            ]
            plog.append(updates, {"b": b})
        out["append"] = time.perf_counter() - started
        plog.close()
        total = batches * batch_size
        middle = total // 2 + 7

        started = time.perf_counter()
        plog = PublisherLog(root, roll_size=roll_size, fsync=False, tail_updates=1)
        plog.open()
        out["open"] = time.perf_counter() - started
        started = time.perf_counter()
        reader = plog.reader(middle)
        batch = reader.read()
        out["first read"] = time.perf_counter() - started
        assert batch is not None and batch.first_seq == middle, batch
        reader.close()
        started = time.perf_counter()
        reader = plog.reader(0)
        seen = 0
        while (batch := reader.read()) is not None:
            seen += len(batch.updates)
        out["read all"] = time.perf_counter() - started
        assert seen == total, (seen, total)
        reader.close()
        plog.close()

        started = time.perf_counter()
        got = sum(1 for _ in read_log_range(root, middle, middle + 1000))
        out["range"] = time.perf_counter() - started
        assert got == 1000, got
        started = time.perf_counter()
        found = position_at_time(root, base_ts + middle)
        out["at time"] = time.perf_counter() - started
        assert found == middle, (found, middle)

        # The same without the index files (a log written before them): the baseline of one run.
        for index in root.glob("index.*"):
            index.unlink()
        started = time.perf_counter()
        got = sum(1 for _ in read_log_range(root, middle, middle + 1000))
        out["range, no index"] = time.perf_counter() - started
        started = time.perf_counter()
        found = position_at_time(root, base_ts + middle)
        out["at time, no index"] = time.perf_counter() - started
        assert (got, found) == (1000, middle), (got, found)
        started = time.perf_counter()
        plog = PublisherLog(root, roll_size=roll_size, fsync=False, tail_updates=1)
        plog.open()
        out["open, no index"] = time.perf_counter() - started
        plog.close()
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_tree(tree: str, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--json",
        f"--batches={args.batches}",
        f"--batch-size={args.batch_size}",
        f"--roll-size={args.roll_size}",
    ]
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--roll-size", type=int, default=16 << 20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", help="another checkout to compare with, alternately")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.batches, args.batch_size, args.roll_size)))
        return 0
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"this": here} if not args.against else {"this": here, "base": args.against}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(_run_tree(tree, args))
    print(
        f"{args.batches:,} batches of {args.batch_size} updates, segments of "
        f"{args.roll_size:,} bytes; median of {args.rounds} rounds, seconds"
    )
    header = f"{'case':<20}" + "".join(f"{name:>12}" for name in trees)
    print(header + ("       ratio" if args.against else ""))
    for case in CASES:
        medians = {name: statistics.median(r[case] for r in runs[name]) for name in trees}
        line = f"{case:<20}" + "".join(f"{medians[name]:>12.4f}" for name in trees)
        if args.against:
            line += f"{medians['this'] / medians['base']:>12.3f}"
        print(line)
    if not args.against:
        for case, baseline in BASELINES.items():
            ratio = statistics.median(r[case] / r[baseline] for r in runs["this"])
            print(f"{case}: {ratio:.3f} of the time without index files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
