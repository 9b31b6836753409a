from __future__ import annotations

import logging
import threading
import time

import pytest

from wormhole.core.backoff import Backoff


def test_waits_double_up_to_the_cap_and_each_is_logged_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backoff = Backoff(logging.getLogger("test.backoff"), first=0.01, cap=0.03)
    with caplog.at_level(logging.WARNING, "test.backoff"):
        for _ in range(3):
            assert backoff.wait("lost %s (%s); reconnecting in %.2fs", "the stream", "reset")
    assert [r.getMessage() for r in caplog.records] == [
        "lost the stream (reset); reconnecting in 0.01s",
        "lost the stream (reset); reconnecting in 0.02s",
        "lost the stream (reset); reconnecting in 0.03s",
    ]
    backoff.reset()
    assert backoff.delay == 0.01


def test_a_stop_request_ends_the_wait_at_once() -> None:
    stop = threading.Event()
    backoff = Backoff(logging.getLogger("test.backoff"), first=30.0, cap=60.0, stop=stop)
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    assert not backoff.wait("retrying in %.1fs")
    assert time.monotonic() - started < 5
