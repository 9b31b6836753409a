"""psycopg2, the driver of the ``postgres`` source (the ``postgres`` extra), imported once
for every module of the source: ``psycopg2`` is None when it is not installed, which
``open`` reports."""

from __future__ import annotations

from typing import Any

psycopg2: Any
try:
    import psycopg2
    import psycopg2.extensions
    import psycopg2.extras
except ImportError:  # pragma: no cover - reported at open()
    psycopg2 = None

HAVE_PSYCOPG2 = psycopg2 is not None
