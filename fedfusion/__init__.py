"""fedfusion: Flower strategies that fuse client models in one shot (or a few rounds).

The library, importable into any Flower project (see docs/library.md):

* strategies: :mod:`fedfusion.strategies` (``FedBEns``, ``RegMean``, ``AdaptiveModelSelection``,
  ``FedAvg``, ...), each built from a model factory: ``FedBEns(Net, num_clients=5,
  num_members=3, val=(x_val, y_val))``, then ``strategy.start(grid)``;
* the client side: :mod:`fedfusion.client` (``initial_models``, ``reply``, ``make_upload``);
* :func:`evaluate`, :class:`ModelSpec`, :class:`ClientUpload`, :class:`LocalGrid`,
  :func:`load_predictor`.

The Flower App (run config, launcher, replay CLI) is :mod:`fedfusion.app` with the components
:mod:`fedfusion.server_app` and :mod:`fedfusion.client_app`.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

__version__ = "0.1.0"

#: public name -> module that defines it (imported on first use: ``import fedfusion`` stays
#: light, and no submodule import cycles through this package)
_EXPORTS = {
    "evaluate": "fedfusion.core.evaluation",
    "ModelSpec": "fedfusion.core.architecture",
    "ClientUpload": "fedfusion.wire",
    "UploadError": "fedfusion.wire",
    "LocalGrid": "fedfusion.flower.local",
    "load_predictor": "fedfusion.strategies.predictors",
    "save_predictor": "fedfusion.core.predictors",
}

__all__ = [*_EXPORTS, "client", "strategies", "setup_logging"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in ("client", "strategies"):
        return importlib.import_module(f"fedfusion.{name}")
    raise AttributeError(f"module 'fedfusion' has no attribute {name!r}")


class _StdoutHandler(logging.StreamHandler):
    """Writes to ``sys.stdout`` as it is when a record is emitted, not to the stream that was
    ``sys.stdout`` when the handler was made (a redirect or a test's capture may have closed
    that one since)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ and setStream assign it
        pass


def setup_logging() -> None:
    """Progress lines of the ``fedfusion`` logger on stdout, in the server and in every client
    process (a Ray actor or a SuperNode has no handler of its own)."""
    log = logging.getLogger("fedfusion")
    if not log.handlers:
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s fedfusion %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
