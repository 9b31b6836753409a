"""Stable shard hash.

``shard = crc32(canonical_json(key)) % shards`` where canonical JSON is the key
object with its members sorted by name and no whitespace. CRC-32 (IEEE, as in
zlib) is the same in every language and every version, so a subscriber written
in another language can compute the shard of a key, and the shard of a key never
changes across restarts or upgrades.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec

from wormhole.core.update import Update

_canonical = msgspec.json.Encoder(order="sorted").encode


def canonical_key(key: dict[str, Any]) -> bytes:
    """The key as canonical JSON bytes (sorted members, no whitespace)."""
    return _canonical(key)


def stable_hash(key: dict[str, Any]) -> int:
    """A 32-bit hash of the key that is the same on every machine and version."""
    return zlib.crc32(_canonical(key))


def shard_of(key: dict[str, Any], shards: int) -> int:
    """The shard a key belongs to."""
    return zlib.crc32(_canonical(key)) % shards


def assign_shards(updates: list[Update], shards: int) -> list[Update]:
    """Set every update's shard, in place; a truncate (op ``t``) concerns every flow, so it
    is copied to each shard, in order with that shard's updates. Returns the batch."""
    crc = zlib.crc32
    canonical = _canonical
    truncates = False
    for u in updates:
        u.shard = crc(canonical(u.key)) % shards
        if u.op == "t":
            truncates = True
    if not truncates:
        return updates
    out: list[Update] = []
    for u in updates:
        if u.op != "t":
            out.append(u)
            continue
        out.extend(msgspec.structs.replace(u, shard=shard) for shard in range(shards))
    return out
