"""The subscriber, one layer: what every transport's subscriber shares, beside the plugin
contract.

- :mod:`~wormhole.subscriber.handlers`: handler registration, the handler loop with its
  retries, and ``wormhole subscribe``'s sink served through it (:class:`Handlers`);
- :mod:`~wormhole.subscriber.link` and :mod:`~wormhole.subscriber.connected`: a subscriber
  connected to publishers (one link per publisher, found directly or through a registry):
  reconnects with backoff, the flows each publisher assigned, batches handed to the handlers
  and what to acknowledge; a transport supplies only the connection (frames in,
  acknowledgements out), as the ``tcp`` transport's client does;
- :mod:`~wormhole.subscriber.local`: the in-process subscriber (a sink on a thread of the
  publisher);
- :mod:`~wormhole.subscriber.dead_letters` (the ``on_error`` guard, replay, purge) and
  :mod:`~wormhole.subscriber.dead_letter_log` (the log);
- :mod:`~wormhole.subscriber.processes`: the subscriber processes ``wormhole run`` starts.

It imports the plugin contract and the data model; connectors and the engine import it.
"""
