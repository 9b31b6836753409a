"""Debezium's change-event format: what ``envelope: debezium`` writes.

A sink or transport that offers the format puts :class:`DebeziumFields` into its options
model and calls :meth:`DebeziumEncoder.messages` on each batch; it gets Kafka-style
messages (topic, key, value) whose key and value are what Debezium's JsonConverter
writes for the same change. A plugin sink asks for it the same way (see
``docs/debezium.md``).

The encoder is generic: it reads an update's :attr:`~wormhole.core.update.Update.columns`
(column types, in PostgreSQL's type vocabulary) to type the values, and its
:attr:`~wormhole.core.update.Update.details` (what the source knows of the change: LSN,
transaction id, snapshot flag...) for the ``source`` block. Values arrive as the
envelope has them (numbers, booleans, and every other type as the database's text
output) and leave as Debezium's default mappings make them.

This module is the entry; import from it. The work is in a module per stage:

============  ===========================================================================
``options``   :class:`DebeziumFields` (the options a component mixes in), :class:`Message`
``values``    value conversions: text output to Debezium's values (times, decimals, ...)
``columns``   column types to Connect schemas and conversions (:class:`DebeziumTypes`)
``schemas``   ``source`` block, transaction block and transaction-event schemas
``envelope``  change events assembled (:class:`DebeziumEncoder`)
``records``   messages as JSON lines; change events read back (:func:`decode_message`)
============  ===========================================================================
"""

from __future__ import annotations

from wormhole.plugins.debezium.columns import DebeziumTypes
from wormhole.plugins.debezium.envelope import DebeziumEncoder
from wormhole.plugins.debezium.options import UNAVAILABLE, VERSION, DebeziumFields, Message
from wormhole.plugins.debezium.records import decode_message, encode_lines

__all__ = [
    "UNAVAILABLE",
    "VERSION",
    "DebeziumEncoder",
    "DebeziumFields",
    "DebeziumTypes",
    "Message",
    "decode_message",
    "encode_lines",
]
