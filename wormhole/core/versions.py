"""Per-key versions of updates, derived from their source positions.

A sink that must not let a replay undo newer work (a subscriber restarting from
an older datamarker delivers again updates it already applied) keeps, for every
key, the version of the last update it applied, and skips an update whose
version is lower. :func:`version_of` gives that version: a tuple of integers,
compared element by element, that grows along each key's history. It is
computed from ``update.position`` and ``update.logical`` as the built-in
sources fill them:

``postgres``
    ``position`` is ``<commit LSN>:<index in the transaction>``. A change's
    version is ``(commit LSN, index + 1)``. A snapshot read (op ``r``) is
    ``(snapshot LSN, 0)``: every key is read once, and every change streamed
    after the snapshot commits at or after that LSN, so it is newer.

``mysql`` (MariaDB)
    ``logical`` is the transaction's GTID ``domain-server-sequence`` and the last
    part of ``position`` the change's index in the transaction. A change's
    version is ``(sequence, index + 1)``. MariaDB keeps a domain's sequence
    numbers increasing across servers, so versions stay comparable after the
    source moves to a replica. A snapshot read is ``(lowest sequence in the
    snapshot's GTID position, 0)``. Sequence numbers of different GTID domains
    are compared as they are, so rows written through several domains get no
    protection beyond per-key order. MySQL GTIDs (``uuid:sequence``) restart
    with every server uuid: they give no version.

``filelog``, JSON-lines files
    ``position`` (and ``logical``) is ``<file>:<offset>``. Files are read in
    natural name order (digit runs compare as numbers), so the version is the
    file name in that order followed by the offset: each character as its code
    point + 1, a 0 after each run of characters, each digit run as its value
    + 1, a 0 at the end of the name, then the offset.

``filelog``, LogWriter logs
    ``logical`` is ``<publisher id>:<seq>``; the version is ``(seq,)``. Sequence
    numbers are comparable within one publisher id, so a key should be
    published by one publisher (or by copies that share its id).

Any other update (another connector, or positions that do not parse) has no
version: ``None``. Such updates are not comparable, so the last write wins.

:func:`version_number` packs a version into one integer below 2**63, for stores
that keep a single number per document (OpenSearch external versions).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from wormhole.core.update import Update

Version = tuple[int, ...]

_DIGITS = re.compile(r"(\d+)")
_MINOR_BITS = 16
_MAJOR_LIMIT = 1 << (63 - _MINOR_BITS)


def version_of(update: Update) -> Version | None:
    """The update's per-key version, or ``None`` when its positions are not comparable."""
    parse = _PARSERS.get(update.connector)
    if parse is None:
        return None
    try:
        return parse(update)
    except (ValueError, IndexError):
        return None


def is_older(version: Version | None, than: Version | None) -> bool:
    """Whether ``version`` is strictly older than ``than``; ``False`` if either is unknown."""
    return version is not None and than is not None and version < than


def version_number(version: Version | None) -> int | None:
    """The version as one integer below 2**63 that keeps its order, or ``None``.

    ``(a,)`` is ``a``; ``(a, b)`` is ``a * 2**16 + b`` when ``a < 2**47`` and
    ``b < 2**16`` (PostgreSQL: LSNs below 128 TiB of WAL and transactions of up
    to 65,535 changes; MariaDB: any realistic sequence number). Other versions
    (JSON-lines file positions, larger values) do not fit: ``None``.
    """
    if version is None or any(v < 0 for v in version):
        return None
    if len(version) == 1:
        return version[0] if version[0] < 1 << 63 else None
    if len(version) == 2:
        major, minor = version
        if major < _MAJOR_LIMIT and minor < 1 << _MINOR_BITS:
            return (major << _MINOR_BITS) | minor
    return None


@functools.lru_cache(maxsize=4096)
def natural_name(name: str) -> Version:
    """A file name as integers that sort in natural order (``2.jsonl`` before ``10.jsonl``)."""
    out: list[int] = []
    for i, part in enumerate(_DIGITS.split(name)):
        if i % 2:
            out.append(int(part) + 1)
        else:
            out.extend(ord(c) + 1 for c in part)
            out.append(0)
    out.append(0)
    return tuple(out)


def _lsn(text: str) -> int:
    high, slash, low = text.partition("/")
    if not slash:
        raise ValueError(f"not an LSN: {text!r}")
    return (int(high, 16) << 32) | int(low, 16)


def _postgres(update: Update) -> Version:
    lsn, _, index = update.position.rpartition(":")
    if update.op == "r":
        return (_lsn(lsn), 0)
    return (_lsn(lsn), int(index) + 1)


def _gtid_sequence(gtid: str) -> int:
    parts = gtid.strip().split("-")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a MariaDB GTID: {gtid!r}")
    return int(parts[2])


def _mysql(update: Update) -> Version | None:
    if ":" in update.logical:
        return None  # MySQL uuid:sequence
    if update.op == "r":
        parts = [p for p in update.logical.split(",") if p.strip()]
        if not parts:
            return None
        return (min(_gtid_sequence(p) for p in parts), 0)
    index = update.position.rsplit(":", 1)[1]
    return (_gtid_sequence(update.logical), int(index) + 1)


def _filelog(update: Update) -> Version:
    if update.logical != update.position:  # a LogWriter log: <publisher id>:<seq>
        return (int(update.logical.rsplit(":", 1)[1]),)
    name, colon, offset = update.position.rpartition(":")
    if not colon:
        raise ValueError(f"not a file position: {update.position!r}")
    return (*natural_name(name), int(offset))


_PARSERS: dict[str, Callable[[Update], Version | None]] = {
    "postgres": _postgres,
    "mysql": _mysql,
    "filelog": _filelog,
}
