"""A subscriber process for bench/tcp_delivery.py: records append-to-callback latency.

Prints ``{"samples": [[seconds, updates], ...]}`` on SIGTERM.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

from wormhole import Subscriber


def main() -> int:
    app, address = sys.argv[1], sys.argv[2]
    sub = Subscriber(app, [address], instance=sys.argv[3] if len(sys.argv) > 3 else None)
    samples: list[list[float]] = []

    @sub.on_batch
    def record(updates: list[Any]) -> None:
        samples.append([sub.latency(), len(updates)])

    signal.signal(signal.SIGTERM, lambda *_: sub.stop())
    sub.run()
    print(json.dumps({"samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
