"""The ZooKeeper test fixture: a real server that clients reach, whose ephemeral nodes go
with their session, and that can be restarted with its data."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("kazoo")


def test_ephemeral_nodes_go_with_their_session_and_data_survives_a_restart(
    zookeeper_server: Any,
) -> None:
    from wormhole.testing import wait_until

    owner = zookeeper_server.client()
    watcher = zookeeper_server.client()
    try:
        owner.ensure_path("/wormhole/test/datasets")
        owner.create("/wormhole/test/datasets/shop", b"16")
        owner.create("/wormhole/test/publishers", b"", makepath=True)
        owner.create("/wormhole/test/publishers/db1", b"127.0.0.1:7070", ephemeral=True)
        assert watcher.get_children("/wormhole/test/publishers") == ["db1"]
        owner.stop()
        owner.close()
        wait_until(
            lambda: watcher.get_children("/wormhole/test/publishers") == [],
            30,
            "the ephemeral node to go with its session",
        )
        zookeeper_server.stop()
        zookeeper_server.start()
        again = zookeeper_server.client()
        try:
            assert again.get("/wormhole/test/datasets/shop")[0] == b"16"
        finally:
            again.stop()
            again.close()
    finally:
        watcher.stop()
        watcher.close()
