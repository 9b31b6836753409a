"""Server addresses and which server holds a key.

A key lives on the server chosen by rendezvous (highest random weight) hashing,
exactly as pymemcache's ``HashClient`` chooses it with its default hasher: each
server's score for a key is ``murmur3_32(f"{host}:{port}-{key}")`` and the highest
score wins. An application that caches through a ``HashClient`` built on the same
server list therefore reads and writes each key on the server this sink
invalidates. Adding or removing a server moves only the keys whose winner
changes (about 1/n of them).

The server list is fixed for the life of the sink: a server that does not answer
is never dropped from the hashing, because its keys would then be invalidated on a
server that does not hold them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

DEFAULT_PORT = 11211

_CACHE_LIMIT = 1 << 16


def parse_server(text: str) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` -> (host, port); ValueError with a fix."""
    spec = text.strip()
    if not spec:
        raise ValueError("empty server address; write host:port, e.g. 127.0.0.1:11211")
    if spec.startswith("["):
        end = spec.find("]")
        if end < 0:
            raise ValueError(f"{text!r}: unclosed '[' in an IPv6 address; write [::1]:11211")
        host, rest = spec[1:end], spec[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected :port after the ']'; write [::1]:11211")
        port_text = rest[1:] if rest else ""
    elif spec.count(":") > 1:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, e.g. [::1]:11211")
    else:
        host, _, port_text = spec.partition(":")
    if not host or any(c.isspace() or c in "/,@" for c in host):
        raise ValueError(f"{text!r} is not a host:port address, e.g. 127.0.0.1:11211")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
    return host, int(port_text)


def node_name(host: str, port: int) -> str:
    """The name a server is hashed by: ``HashClient``'s ``"%s:%s" % (host, port)``."""
    return f"{host}:{port}"


_MASK = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593


def _text_bytes(text: str) -> bytes:
    """The bytes pymemcache's murmur3 hashes for ``text``: each character's low 8 bits."""
    if text.isascii():
        return text.encode("ascii")
    return bytes(ord(c) & 0xFF for c in text)


def _blocks(h: int, data: bytes, end: int) -> int:
    """MurmurHash3 (x86, 32-bit) body over the 4-byte blocks of ``data[:end]``."""
    for (k,) in struct.iter_unpack("<I", data[:end]):
        k = (k * _C1) & _MASK
        k = ((k << 15) | (k >> 17)) * _C2 & _MASK
        h ^= k
        h = ((h << 13) | (h >> 19)) & _MASK
        h = (h * 5 + 0xE6546B64) & _MASK
    return h


def _finish(h: int, tail: bytes, length: int) -> int:
    """MurmurHash3 (x86, 32-bit) tail and finalisation."""
    if tail:
        k = int.from_bytes(tail, "little")
        k = (k * _C1) & _MASK
        k = ((k << 15) | (k >> 17)) * _C2 & _MASK
        h ^= k
    h ^= length
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


class Rendezvous:
    """Maps keys to server indexes by rendezvous hashing (pymemcache-compatible).

    Every score hashes ``f"{node}-{key}"``. The hash state after the full 4-byte
    blocks of each ``"{node}-"`` prefix is computed once. What is left of the prefix
    (its last 0-3 bytes) is often the same for every server (``127.0.0.1:11211-`` is
    16 bytes: nothing is left), and then the key's blocks are mixed once and only
    folded into each server's state. Lookups are also memoised, because
    invalidation streams touch the same keys again and again.
    """

    def __init__(self, nodes: Sequence[str]) -> None:
        if not nodes:
            raise ValueError("no servers")
        self.nodes = list(nodes)
        groups: dict[bytes, list[tuple[int, int, int]]] = {}
        for index, node in enumerate(self.nodes):
            prefix = _text_bytes(f"{node}-")
            end = len(prefix) & ~3
            state = _blocks(0, prefix, end)
            groups.setdefault(prefix[end:], []).append((index, state, len(node) + 1))
        self.groups = list(groups.items())
        self.cache: dict[str, int] = {}

    def server_of(self, key: str) -> int:
        found = self.cache.get(key)
        if found is not None:
            return found
        nodes = self.nodes
        data = _text_bytes(key)
        size = len(key)
        best = -1
        winner = 0
        # _blocks and _finish, inlined and split: the block mixing does not depend on
        # the state, so it runs once per distinct prefix rest, not once per server.
        for rest, members in self.groups:
            whole = rest + data
            end = len(whole) & ~3
            mixed = []
            for (k,) in struct.iter_unpack("<I", whole[:end]):
                k = (k * _C1) & _MASK
                mixed.append(((k << 15) | (k >> 17)) * _C2 & _MASK)
            tail = 0
            if end != len(whole):
                k = (int.from_bytes(whole[end:], "little") * _C1) & _MASK
                tail = ((k << 15) | (k >> 17)) * _C2 & _MASK
            for index, h, prefix_size in members:
                for k in mixed:
                    h ^= k
                    h = ((h << 13) | (h >> 19)) & _MASK
                    h = (h * 5 + 0xE6546B64) & _MASK
                h ^= tail ^ (prefix_size + size)
                h ^= h >> 16
                h = (h * 0x85EBCA6B) & _MASK
                h ^= h >> 13
                h = (h * 0xC2B2AE35) & _MASK
                h ^= h >> 16
                # pymemcache breaks a tie by the larger node name.
                if h > best or (h == best and nodes[index] > nodes[winner]):
                    best, winner = h, index
        cache = self.cache
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = winner
        return winner
