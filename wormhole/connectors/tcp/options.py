"""Options of the ``tcp`` transport, shared by the publisher and ``wormhole subscribe``."""

from __future__ import annotations

import ssl

from pydantic import ByteSize, Field, model_validator

from wormhole.connectors.tcp.protocol import MAX_HEARTBEAT_MS
from wormhole.plugins.components import Options


class TlsOptions(Options):
    """TLS for subscriber connections (Python's ssl module)."""

    cert: str = Field(description="the publisher's certificate chain (PEM)")
    key: str = Field(description="the publisher's private key (PEM)")
    ca: str | None = Field(
        None, description="CA bundle subscribers verify the publisher with (default: system CAs)"
    )
    server_name: str | None = Field(
        None, description="name subscribers expect in the publisher's certificate (default: host)"
    )
    client_cert: str | None = Field(
        None, description="subscribers' certificate: set it (and client_ca) for mutual TLS"
    )
    client_key: str | None = Field(None, description="subscribers' private key")
    client_ca: str | None = Field(
        None, description="CA bundle the publisher verifies subscriber certificates with"
    )

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            context.load_verify_locations(self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.client_cert:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context


class TcpOptions(Options):
    """Subscribers connect over TCP; one connection carries all of a subscriber's flows."""

    listen: str = Field("127.0.0.1:0", description="host:port to listen on (port 0: any free)")
    token: str = Field(
        "", description="shared secret subscribers must present (empty: no authentication)"
    )
    tls: TlsOptions | None = Field(None, description="TLS for subscriber connections")
    heartbeat_ms: int = Field(
        1000, ge=10, le=MAX_HEARTBEAT_MS, description="heartbeat interval, both ways"
    )
    heartbeat_timeout_ms: int = Field(
        3000, ge=20, le=86_400_000, description="a peer silent this long is gone (its shards move)"
    )
    credits: int = Field(
        8, ge=1, le=1024, description="batch frames a subscriber may have unacknowledged"
    )
    max_frame: ByteSize = Field(
        ByteSize(1 << 20), description="largest frame accepted from a subscriber"
    )
    max_batch_frame: ByteSize = Field(
        ByteSize(4 << 20),
        ge=4096,
        description="largest batch frame sent to a subscriber: larger publisher-log batches "
        "are split into several frames",
    )
    read_cache: ByteSize = Field(
        ByteSize(256 << 20),
        ge=0,
        description="memory the log readers' cache may hold: the flows of one range (a Spark "
        "micro-batch) decode each publisher-log batch once while it fits (0: no cache)",
    )
    datamarker_updates: int = Field(
        10_000, ge=1, description="send a flow's datamarker at least every N updates ..."
    )
    datamarker_interval_ms: int = Field(100, ge=1, description="... or every T milliseconds")
    spawn: bool = Field(
        True, description="`wormhole run` starts each application's subscribers as processes"
    )
    drain_timeout_s: float = Field(
        10.0, ge=0, description="on stop, how long subscribers may take to finish what they hold"
    )
    give_up_s: float | None = Field(
        None,
        gt=0,
        description="`wormhole subscribe`: exit with an error after this many seconds without "
        "a session with a publisher (default: retry for as long as it runs)",
    )

    @model_validator(mode="after")
    def _check(self) -> TcpOptions:
        from wormhole.connectors.tcp.protocol import parse_address

        parse_address(self.listen)
        if self.heartbeat_timeout_ms <= self.heartbeat_ms:
            raise ValueError("heartbeat_timeout_ms must be larger than heartbeat_ms")
        return self
