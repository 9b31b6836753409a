"""The ``postgres`` source and position mapper (needs the ``postgres`` extra: psycopg2)."""

from __future__ import annotations

from functools import partial
from typing import Any

from wormhole.connectors.postgres.options import PostgresOptions
from wormhole.core.update import Update
from wormhole.plugins.components import Capabilities, Version, log_reader
from wormhole.plugins.hookspecs import CommandLine, hookimpl


def _source(options: PostgresOptions) -> Any:
    from wormhole.connectors.postgres.source import PostgresSource

    return PostgresSource(options)


class PostgresPositionMapper:
    """Native ``<commit LSN>:<index>`` <-> logical ``<commit LSN>``.

    A logical position names a whole transaction; mapped back it means "before
    the first change of that transaction".

    Versions: a change's is ``(commit LSN, index + 1)``. A snapshot read (op ``r``)
    is ``(snapshot LSN, 0)``: every key is read once, and every change streamed
    after the snapshot commits at or after that LSN, so it is newer.
    """

    def to_logical(self, native: str) -> str:
        return native.partition(":")[0]

    def to_native(self, logical: str) -> str:
        return f"{logical.partition(':')[0]}:-1"

    def version(self, update: Update) -> Version:
        lsn, _, index = update.position.rpartition(":")
        if update.op == "r":
            return (_lsn(lsn), 0)
        return (_lsn(lsn), int(index) + 1)


def _lsn(text: str) -> int:
    high, slash, low = text.partition("/")
    if not slash:
        raise ValueError(f"not an LSN: {text!r}")
    return (int(high, 16) << 32) | int(low, 16)


wormhole_sources, wormhole_position_mappers = log_reader(
    "postgres",
    source=_source,
    options=PostgresOptions,
    description="PostgreSQL logical decoding (pgoutput), with an initial snapshot.",
    capabilities=Capabilities(backfill=True, snapshot_pending=True, lag=True),
    mapper=lambda _options: PostgresPositionMapper(),
    mapper_description="Commit LSN plus change index <-> commit LSN (origin LSN if replicated).",
)


@hookimpl
def wormhole_commands(commands: Any, cli: CommandLine) -> None:
    trigger = commands.add_parser(
        "postgres-schema-trigger",
        help="install or remove the event trigger that writes schema changes into the WAL",
    )
    trigger.add_argument("pipeline", help="pipeline file (YAML) whose source is postgres")
    trigger.add_argument("--remove", action="store_true", help="remove the trigger")
    trigger.add_argument(
        "--sql", action="store_true", help="print the SQL instead (for a superuser to run)"
    )
    trigger.set_defaults(func=partial(_schema_trigger_command, cli))


def _schema_trigger_command(cli: CommandLine, args: Any) -> int:
    """``wormhole postgres-schema-trigger PIPELINE [--remove] [--sql]``."""
    from wormhole.connectors.postgres import schema_trigger
    from wormhole.core.errors import ConfigError, SourceError, first_line

    pipeline = cli.load_pipeline(args.pipeline)
    options = pipeline.source.options
    if not isinstance(options, PostgresOptions):
        raise ConfigError(
            f"source.type: postgres-schema-trigger works on a pipeline whose source is "
            f"postgres; {args.pipeline} reads {pipeline.source.type}",
            args.pipeline,
        )
    statement = schema_trigger.REMOVE if args.remove else schema_trigger.INSTALL
    if args.sql:
        print(statement.strip())
        return 0
    try:
        import psycopg2
    except ImportError:
        raise SourceError(
            "source.type: postgres needs psycopg2; install the extra: pip install "
            "'wormhole-cdc[postgres]'"
        ) from None
    try:
        conn = psycopg2.connect(options.dsn)
    except psycopg2.OperationalError as exc:
        raise SourceError(f"source.dsn: cannot connect to PostgreSQL ({first_line(exc)})") from exc
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SHOW server_version_num")
            row = cur.fetchone()
            version = int(row[0]) if row else 0
            if not args.remove and version < schema_trigger.MINIMUM_VERSION:
                raise SourceError(
                    f"the schema trigger needs PostgreSQL 14 or later (pgoutput sends logical "
                    f"decoding messages from 14 on); this server is {version}"
                )
            cur.execute(statement)
    except psycopg2.Error as exc:
        action = "remove" if args.remove else "install"
        raise SourceError(
            f"cannot {action} the schema trigger ({first_line(exc)}); "
            f"{schema_trigger.PRIVILEGE_HINT}"
        ) from exc
    finally:
        conn.close()
    if args.remove:
        print("removed the schema trigger: schema changes are no longer written to the WAL")
    else:
        print(
            f"installed the schema trigger (event triggers {', '.join(schema_trigger.TRIGGERS)},"
            f" function {schema_trigger.FUNCTION}): every schema change from now on is written "
            f"to the WAL"
        )
    return 0
