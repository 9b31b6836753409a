"""Multiple-copy delivery keeps serving: some ready copy serves the application after a
restart, a pause or a copy that cannot serve, with real ZooKeeper and real processes.

Each test is a deterministic trigger of one way an application was left with no copy
serving it while a copy that holds every update was up (issue: "Multiple-copy delivery
that always serves"). The deployment is the two-copy one of ``test_multiple_copy``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_multiple_copy import Copies, reached, shared_versions

from wormhole.testing import wait_until


@pytest.fixture
def copies(tmp_path: Path, zookeeper_server: Any, request: pytest.FixtureRequest) -> Any:
    deployment = Copies(tmp_path, zookeeper_server, f"/mcl-{request.node.name[:40]}")
    yield deployment
    deployment.stop()


def test_a_copy_restarted_in_a_quiet_period_keeps_what_the_shared_datamarkers_name(
    copies: Copies, tmp_path: Path
) -> None:
    """The preferred copy stops gracefully once everything was delivered and comes back:
    its first persist must not collect the update the shared datamarkers name (the last
    one of its previous session), so the application fails back to it and it serves."""
    keys = 10
    for copy in "ab":
        copies.pipeline(copy)
    copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 60, "copy a (preferred) to serve")
    copies.publish("b")
    copies.subscribe(0)
    out = tmp_path / "search.jsonl"
    copies.write(keys, 0)
    wait_until(lambda: reached(out, keys, 0), 60, "round 0")
    # Quiet: the shared datamarkers name the last update written.
    wait_until(
        lambda: max(shared_versions(copies).values(), default=(0,)) == (keys,),
        30,
        "the shared datamarkers to reach the last update",
    )
    assert copies.publishers["a"].stop() == 0
    wait_until(lambda: copies.serving() == "b", 30, "copy b to take over")
    restarted = copies.publish("a")
    wait_until(lambda: copies.serving() == "a", 30, "the application to fail back to a")
    copies.write(keys, 1)
    wait_until(lambda: reached(out, keys, 1), 30, "round 1, from the restarted copy a")
    assert copies.serving() == "a"
    assert "Gone" not in restarted.stderr and "older than" not in restarted.stderr, restarted.stderr
