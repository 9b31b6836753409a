"""The fault-injection proxy of wormhole.testing, against a real echo server."""

from __future__ import annotations

import socket
import threading

from wormhole.testing import ThrottlingProxy


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def _receive(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        assert chunk, "connection closed early"
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def test_the_proxy_forwards_both_ways_through_a_throttle_a_pause_and_cuts_connections() -> None:
    listener, thread = _echo_server()
    upstream = listener.getsockname()
    try:
        with ThrottlingProxy(f"{upstream[0]}:{upstream[1]}", rate=512 * 1024) as proxy:
            client = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
            payload = bytes(range(256)) * 512  # 128 KiB: several paced chunks
            client.sendall(payload)
            assert _receive(client, len(payload)) == payload
            assert proxy.forwarded == {"up": len(payload), "down": len(payload)}

            proxy.pause("down")
            client.sendall(b"held")
            proxy.resume("down")
            assert _receive(client, 4) == b"held"

            proxy.cut()
            assert client.recv(1) == b"", "a cut closes the client's end"
            client.close()
            assert proxy.connections == 0
            again = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
            again.sendall(b"after the cut")
            assert _receive(again, 13) == b"after the cut"
            again.close()
            assert proxy.accepted == 2
    finally:
        # shutdown wakes the thread blocked in accept; close alone does not.
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(10)
