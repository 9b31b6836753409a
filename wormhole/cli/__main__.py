"""``python -m wormhole.cli``: the ``wormhole`` command (subscriber processes are started so)."""

import sys

from wormhole.cli import main

sys.exit(main())
