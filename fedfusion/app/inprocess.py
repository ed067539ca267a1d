"""The App's federation in this process: :class:`~fedfusion.flower.local.LocalGrid` running
fedfusion's own ClientApp with the run's settings (no Ray, no gRPC).

``strategy.start(InProcessGrid(settings))`` or ``run_server(settings, InProcessGrid(settings))``
run a whole federation, round by round, through the strategy's own Message-API loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Message

from fedfusion.app.config import Settings
from fedfusion.flower.local import LocalGrid, ensure_task_identity

__all__ = ["InProcessGrid", "ensure_task_identity"]


class InProcessGrid(LocalGrid):
    """Node ``100 + i`` runs client ``i`` of ``settings`` through the App's ClientApp, with
    node config ``{"partition-id": i, "num-partitions": N, **node_configs[i]}`` (e.g. a
    per-client ``model``); ``tamper``, ``crash`` and ``delay`` as in LocalGrid."""

    def __init__(self, settings: Settings,
                 tamper: Callable[[int, Message], Message] | None = None,
                 crash: Iterable[int] = (),
                 node_configs: Mapping[int, Mapping[str, Any]] | None = None,
                 delay: Mapping[int, float] | None = None):
        from fedfusion.client_app import app

        self.settings = settings
        super().__init__(app, settings.num_clients, run_config=settings.to_mapping(),
                         node_configs=node_configs, tamper=tamper, crash=crash, delay=delay)

    def node_of(self, client_id: int) -> int:
        """The node that runs client ``client_id``."""
        return self.node_ids[client_id]
