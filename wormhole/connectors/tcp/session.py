"""One connected subscriber's session at the publisher: frames go out in order (with
credits), acknowledgements and heartbeats come in."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from wormhole.connectors.tcp import protocol as p
from wormhole.connectors.tcp.options import TcpOptions
from wormhole.plugins.components import Frame, PublisherView

log = logging.getLogger("wormhole.tcp")


class _Notice:
    __slots__ = ("body", "revoked")

    def __init__(self, body: p.Notice) -> None:
        self.body = body
        self.revoked = body.revoked


class _Piece:
    """The rest of a split batch: frames already encoded and recorded in flight."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class TcpSession:
    """One connected subscriber: frames go out in order, acks and heartbeats come in."""

    def __init__(
        self,
        hub: PublisherView,
        options: TcpOptions,
        sock: socket.socket,
        peer: str,
        hello: p.Hello,
        forget: Callable[[TcpSession], None],
    ) -> None:
        """``forget(session)``: called once the session closed (the server lets go of it)."""
        self.hub = hub
        self.options = options
        self.sock = sock
        self.forget = forget
        self.peer = peer
        self.application = hello.application
        self.name = f"{hello.application}/{hello.instance}@{peer}"
        self.instance = hello.instance
        self.window = min(hello.credits, self.options.credits)
        self.credits = self.window
        self.cond = threading.Condition()
        self.outbox: deque[Frame | _Notice | _Piece] = deque()
        self.data_queued = 0
        self.handling = False
        """A frame left the outbox and is not yet recorded in flight (see ``idle``)."""
        self.closed = False
        self.close_reason = ""
        self.next_frame_id = 1
        self.inflight: deque[tuple[int, int]] = deque()  # (frame id, updates)
        self.notices: dict[int, list[int]] = {}
        self.next_notice_id = 1
        self.pending_datamarkers: dict[int, int] = {}
        self.owned: set[int] = set()
        """The shards the subscriber owns as of the frames sent so far (sender thread only)."""
        self.updates_since_datamarker = 0
        self.last_datamarker = time.monotonic()
        self.send_lock = threading.Lock()
        self.last_sent = time.monotonic()
        self.said_last = False  # a refuse or bye went out: nothing may follow it

    def start(self) -> None:
        threading.Thread(target=self._receive, name=f"recv {self.name}", daemon=True).start()
        threading.Thread(target=self._send, name=f"send {self.name}", daemon=True).start()

    # ----------------------------------------------------- SubscriberSession
    def notice(self, assigned: list[int], revoked: list[int], datamarkers: dict[int, int]) -> None:
        with self.cond:
            if self.closed:
                return
            notice_id = self.next_notice_id
            self.next_notice_id += 1
            if revoked:
                self.notices[notice_id] = revoked
                # Datamarkers still held back (sent every N updates or T ms) go out
                # before the revoke, so the next owner starts exactly where this one stopped.
                self.outbox.append(Frame(self.application, [], {}, 0, 0))
                self.data_queued += 1
            self.outbox.append(
                _Notice(
                    p.Notice(
                        id=notice_id,
                        assigned=assigned,
                        revoked=revoked,
                        datamarkers=datamarkers,
                        epoch=self.hub.epoch(self.application),
                    )
                )
            )
            self.cond.notify_all()

    timed_delivery = True
    """``deliver`` takes a ``deadline`` (see ``SubscriberSession.deliver``)."""

    def deliver(
        self, frame: Frame, stop: threading.Event, deadline: float | None = None
    ) -> bool | None:
        with self.cond:
            while self.data_queued >= self.options.credits and not self.closed:
                if stop.is_set():
                    return False
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    self.cond.wait(min(0.1, remaining))
                else:
                    self.cond.wait(0.1)
            if self.closed:
                return True  # its flows were moved back to their datamarkers
            self.outbox.append(frame)
            self.data_queued += 1
            self.cond.notify_all()
        return True

    # ------------------------------------------------------------- sending
    def _write(self, data: bytes, last: bool = False) -> None:
        with self.send_lock:
            if self.said_last:
                return
            self.said_last = last
            # The socket's timeout (heartbeat_timeout_ms) bounds each wait for the
            # subscriber to take bytes, not the whole frame: a slow link is not a dead one.
            p.send_all(self.sock, data)
            self.last_sent = time.monotonic()

    def _send(self) -> None:
        heartbeat = self.options.heartbeat_ms / 1000.0
        interval = self.options.datamarker_interval_ms / 1000.0
        try:
            while True:
                with self.cond:
                    while not self.closed:
                        ready = self.outbox and (
                            isinstance(self.outbox[0], _Notice) or self.credits > 0
                        )
                        if ready:
                            break
                        now = time.monotonic()
                        idle_datamarkers = (
                            self.pending_datamarkers
                            and not self.outbox
                            and self.credits > 0
                            and now - self.last_datamarker >= interval
                        )
                        if idle_datamarkers:
                            break
                        if now - self.last_sent >= heartbeat:
                            break
                        self.cond.wait(min(heartbeat, interval) / 2)
                    if self.closed:
                        return
                    item: Frame | _Notice | _Piece | None = None
                    if self.outbox and (isinstance(self.outbox[0], _Notice) or self.credits > 0):
                        item = self.outbox.popleft()
                        if isinstance(item, Frame):
                            self.data_queued -= 1
                            self.handling = True
                        if not isinstance(item, _Notice):
                            self.credits -= 1
                        self.cond.notify_all()
                    elif self.pending_datamarkers and not self.outbox and self.credits > 0:
                        item = Frame(self.application, [], {}, 0, 0)
                        self.handling = True
                        self.credits -= 1
                if item is None:
                    self._write(p.encode(p.HEARTBEAT))
                elif isinstance(item, _Notice):
                    self._owns(item.body)
                    self._write(p.encode(p.NOTICE, item.body))
                elif isinstance(item, _Piece):
                    self._write(item.data)
                else:
                    self._write(self._batch(item))
        except OSError as exc:
            self.close(f"send failed: {exc}")
        except Exception as exc:  # pragma: no cover - a bug; keep serving the others
            log.exception("%s: sender failed", self.name)
            self.close(f"sender failed: {exc!r}")

    def _owns(self, notice: p.Notice) -> None:
        self.owned.update(notice.assigned)
        self.owned.difference_update(notice.revoked)
        # The batch queued just before a revoke took these along; whatever came after it
        # is no longer the subscriber's to acknowledge.
        for shard in notice.revoked:
            self.pending_datamarkers.pop(shard, None)

    def _batch(self, frame: Frame) -> bytes:
        # A frame built from the caravan's snapshot of the owners can reach the outbox
        # after a notice that revoked one of its shards. Its datamarker for that shard
        # must not travel, nor wait here until the shard comes back to this subscriber:
        # acknowledged then, it would move the flow past updates the subscriber dropped.
        # Frames and notices go out in order, so what the subscriber owns when it
        # processes this frame is ``owned`` now.
        owned = self.owned
        datamarkers_in = frame.datamarkers
        if not owned.issuperset(datamarkers_in):
            datamarkers_in = {s: v for s, v in datamarkers_in.items() if s in owned}
        # Datamarkers go out every N updates or T ms per connection, not with every frame.
        self.pending_datamarkers.update(datamarkers_in)
        self.updates_since_datamarker += len(frame.updates)
        now = time.monotonic()
        datamarkers: dict[int, int] = {}
        if (
            self.updates_since_datamarker >= self.options.datamarker_updates
            or now - self.last_datamarker >= self.options.datamarker_interval_ms / 1000.0
            or not frame.updates
        ):
            datamarkers = self.pending_datamarkers
            self.pending_datamarkers = {}
            self.updates_since_datamarker = 0
            self.last_datamarker = now
        first_id = self.next_frame_id
        pieces = p.encode_batches(
            first_id,
            frame.first_seq,
            frame.end_seq,
            frame.appended_ns,
            datamarkers,
            frame.updates,
            int(self.options.max_batch_frame),
        )
        self.next_frame_id += len(pieces)
        with self.cond:
            self.inflight.extend((first_id + i, count) for i, (_, count) in enumerate(pieces))
            # The rest of a split batch goes next, ahead of anything queued meanwhile
            # (a revoke must not overtake it), each piece taking a credit.
            self.outbox.extendleft(_Piece(data) for data, _ in reversed(pieces[1:]))
            self.handling = False
            self.cond.notify_all()
        return pieces[0][0]

    # ----------------------------------------------------------- receiving
    def _receive(self) -> None:
        max_frame = int(self.options.max_frame)
        try:
            while not self.closed:
                kind, body = p.read_frame(self.sock, max_frame)
                if kind == p.ACK:
                    self._ack(body)
                elif kind == p.NOTICE_ACK:
                    with self.cond:
                        shards = self.notices.pop(body.id, [])
                    if shards:
                        self.hub.revoked(self.application, self, shards)
                elif kind == p.HEARTBEAT:
                    pass
                elif kind == p.BYE:
                    self.close(f"left{': ' + body.reason if body.reason else ''}")
                    return
                else:
                    raise p.ProtocolError(f"unexpected {p.NAMES.get(kind, kind)} frame")
        except TimeoutError:
            self.close(
                f"missed heartbeats: nothing received for {self.options.heartbeat_timeout_ms} ms"
            )
        except p.PeerClosed:
            self.close("connection closed by the subscriber")
        except p.ProtocolError as exc:
            log.warning("%s: %s; closing the connection", self.name, exc)
            self._refuse(str(exc))
            self.close(str(exc))
        except OSError as exc:
            self.close(f"connection lost: {exc}")

    def _ack(self, ack: p.Ack) -> None:
        updates = 0
        with self.cond:
            while self.inflight and self.inflight[0][0] <= ack.id:
                updates += self.inflight.popleft()[1]
            # Never more credit than the window: a confused client cannot open it wider.
            self.credits = min(self.credits + max(ack.credits, 0), self.window)
            self.cond.notify_all()
        # The hub ignores datamarkers of flows this session no longer holds.
        self.hub.acknowledge(self.application, self, ack.datamarkers, updates)

    def _refuse(self, reason: str) -> None:
        with contextlib.suppress(OSError):
            self._write(p.encode(p.REFUSE, p.Refuse(reason=reason, fatal=False)), last=True)

    def close(self, reason: str) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.close_reason = reason
            self.cond.notify_all()
        p.close_socket(self.sock)
        self.hub.detach(self, reason)
        self.forget(self)

    def flush(self) -> None:
        """Send datamarkers held back (every N updates or T ms) now."""
        with self.cond:
            if not self.closed:
                self.outbox.append(Frame(self.application, [], {}, 0, 0))
                self.data_queued += 1
                self.cond.notify_all()

    def idle(self) -> bool:
        """Everything sent was acknowledged and nothing waits to be sent."""
        with self.cond:
            return self.closed or (not self.outbox and not self.handling and not self.inflight)

    def bye(self, reason: str) -> None:
        with contextlib.suppress(OSError):
            self._write(p.encode(p.BYE, p.Bye(reason=reason)), last=True)
        self.close(reason)


__all__ = ["TcpSession"]
