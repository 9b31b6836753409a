"""``wormhole status``: the publisher log, every flow's datamarker and lag, dead letters,
backfills, applications removed but still holding the log, and (with a shared registry) the
whole deployment."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from wormhole.cli.shared import EXIT_OK, load, pipeline_command, print_backfills
from wormhole.core.backfill import summary as backfill_summary
from wormhole.core.deployment import deployment as deployment_view
from wormhole.core.lag import measure, removed_applications, stored_datamarkers
from wormhole.core.offline_log import inspect_log
from wormhole.core.pipeline import Pipeline
from wormhole.observability.status import read_live_status
from wormhole.plugins.hookspecs import hookimpl
from wormhole.subscriber.dead_letter_log import count_dead_letters

TEXT_ONLY = ("log_info", "live", "registry")


@hookimpl(tryfirst=True)
def wormhole_commands(commands: Any) -> None:
    status = pipeline_command(commands, "status", "datamarker and lag of every flow", cmd_status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")


def cmd_status(args: argparse.Namespace) -> int:
    pipeline = load(args.pipeline, reads_state_only=True)
    deployment = deployment_view(pipeline)
    if deployment is not None and not pipeline.state_dir.is_dir():
        # A machine without this publisher's state: the registry's view only.
        if args.json:
            print(json.dumps({"pipeline": pipeline.name, "deployment": deployment}))
        else:
            _print_deployment(deployment)
        return EXIT_OK
    status = _status(pipeline, deployment)
    if args.json:
        print(json.dumps({k: v for k, v in status.items() if k not in TEXT_ONLY}))
        return EXIT_OK
    _print_status(pipeline, status)
    return EXIT_OK


def _status(pipeline: Pipeline, deployment: dict[str, Any] | None) -> dict[str, Any]:
    """What ``status --json`` prints, and what the text needs besides (``TEXT_ONLY``)."""
    info = inspect_log(pipeline.state_dir / "log")
    markers = stored_datamarkers(pipeline)
    lag = measure(pipeline, markers, info.next_seq)
    live = read_live_status(pipeline.state_dir)
    names, registry = (
        (set(deployment["applications"]), deployment["registry"])
        if deployment is not None and deployment["applications"]
        else (set(pipeline.applications), None)
    )
    dead_letters = {
        name: 0 for name, a in pipeline.applications.items() if a.on_error.policy == "dead_letter"
    }
    dead_letters.update(count_dead_letters(pipeline.state_dir))
    return {
        "pipeline": pipeline.name,
        "state_dir": str(pipeline.state_dir),
        "running": live is not None,
        "caravans": live["caravans"] if live else [],
        "failed": live["failed"] if live else {},
        "log": {
            "first": info.first_seq,
            "end": info.next_seq,
            "segments": [{"name": n, "first": f, "bytes": s} for n, f, s in info.segments],
        },
        "flows": [asdict(flow) for flow in lag.flows],
        "lag_of": lag.what,
        "lag_error": lag.error,
        "removed_applications": removed_applications(names, markers, info.next_seq),
        "dead_letters": dead_letters,
        "backfills": backfill_summary(pipeline.state_dir),
        "deployment": deployment,
        "log_info": info,
        "live": live,
        "registry": registry,
    }


def _print_status(pipeline: Pipeline, status: dict[str, Any]) -> None:
    info, live = status["log_info"], status["live"]
    total = sum(s for _, _, s in info.segments)
    print(
        f"pipeline {pipeline.name} (state {pipeline.state_dir}): publisher log {info.first_seq:,}"
        f" .. {info.next_seq:,} in {len(info.segments)} segment(s), {total:,} bytes"
    )
    if live is not None:
        print(f"  running (pid {live['pid']}); caravans:")
        for c in live["caravans"]:
            print(
                f"    {','.join(c['applications']):<24} position {c['position']:>12,}  "
                f"{c['read_rate']:>10,.0f} updates/s  {c['bytes_read_from_disk']:,} bytes "
                f"from disk"
            )
        for name, error in live["failed"].items():
            print(f"  application {name} stopped: {error}")
    else:
        print("  not running")
    if status["lag_error"]:
        print(f"  warning: lag unknown: {status['lag_error']}")
    print(f"  lag: {status['lag_of']}")
    print(f"  {'application':<16} {'shard':>5} {'datamarker':>12} {'lag':>10}")
    for flow in status["flows"]:
        marker_text = "-" if flow["datamarker"] is None else f"{flow['datamarker']:,}"
        lag_text = "-" if flow["lag"] is None else f"{flow['lag']:,}"
        print(f"  {flow['application']:<16} {flow['shard']:>5} {marker_text:>12} {lag_text:>10}")
    for app_name, count in status["dead_letters"].items():
        print(
            f"  application {app_name}: {count:,} dead letters (wormhole dead-letters list "
            f"{pipeline.file} --app {app_name})"
        )
    print_backfills(status["backfills"], every=False)
    for entry in status["removed_applications"]:
        print(
            f"  warning: application {entry['application']} is not in "
            f"{status['registry'] or pipeline.file}, but its "
            f"datamarkers keep the publisher log from position {entry['datamarker']:,} "
            f"({entry['lag']:,} updates); it resumes there if added back. To release the log, "
            f"run: wormhole forget {pipeline.file} {entry['application']}"
        )
    if status["deployment"] is not None:
        _print_deployment(status["deployment"])


def _print_deployment(deployment: dict[str, Any]) -> None:
    print(f"deployment ({deployment['registry']}):")
    for entry in deployment["publishers"]:
        node = f"{entry['datastore']}@{entry['copy']}" if entry["copy"] else entry["datastore"]
        serving = f"  serving {', '.join(entry['serving'])}" if entry["serving"] else ""
        print(
            f"  publisher {node:<16} {entry['address']:<22} "
            f"{entry['host']}:{entry['pid']} alive{serving}"
        )
    if not deployment["publishers"]:
        print("  no live publisher")
    for name, instances in deployment["subscribers"].items():
        owned: dict[str, int] = {}
        for flow in deployment["flows"]:
            if flow["application"] == name and flow["owner"]:
                owned[flow["owner"]] = owned.get(flow["owner"], 0) + 1
        listed = ", ".join(f"{i} ({owned.get(i, 0)} flows)" for i in instances) or "none"
        print(f"  application {name}: subscribers {listed}")
    if deployment["flows"]:
        print(
            f"  {'application':<16} {'datastore':<12} {'shard':>5} {'owner':<28} "
            f"{'datamarker':>12} {'lag':>10}"
        )
    for flow in deployment["flows"]:
        print(
            f"  {flow['application']:<16} {flow['datastore']:<12} {flow['shard']:>5} "
            f"{flow['owner'] or '-':<28} {flow['datamarker']:>12,} "
            f"{'-' if flow['lag'] is None else format(flow['lag'], ','):>10}"
        )
