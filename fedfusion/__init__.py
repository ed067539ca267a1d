"""fedfusion: Flower strategies that fuse client models in one shot (or a few rounds)."""

import logging
import sys

__version__ = "0.1.0"


def setup_logging() -> None:
    """Progress lines of the ``fedfusion`` logger on stdout, in the server and in every client
    process (a Ray actor or a SuperNode has no handler of its own)."""
    log = logging.getLogger("fedfusion")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s fedfusion %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
