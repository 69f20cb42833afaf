"""``python -m sbpflow.apps.bench``: how ``sbpflow bench`` starts its ranks and its 1-rank
run. The harness runs as the package :mod:`sbpflow.apps.bench` (not a second copy named
``__main__``), so a ``--import`` module's ``register_runner`` reaches the registry it
reads."""

import sys

from sbpflow.apps.bench import main

sys.exit(main(sys.argv[1:], prog="sbpflow bench"))
