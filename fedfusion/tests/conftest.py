"""Shared fixtures: an in-process Flower grid and small real-data settings."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest
from flwr.app import Error, Message
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedfusion.client_app import run_client, settings_for_node
from fedfusion.config import Settings
from fedfusion.payload import decode_models, encode_upload

# Messages need a run identity; inside Flower the SuperLink sets it.
TaskIdentity.run_id = TaskIdentity.task_id = 1
TaskIdentity.node_id = 0


class InProcessGrid(Grid):
    """A Grid whose nodes run fedfusion's client logic in this process (no Ray, no gRPC).

    ``tamper(node_index, reply) -> reply`` lets a test corrupt one client's upload;
    clients in ``crash`` raise inside the ClientApp. Each client's settings come from
    :func:`~fedfusion.client_app.settings_for_node`, as in the ClientApp, with node config
    ``{"partition-id": i, **node_configs[i]}`` (e.g. a per-client ``model``).
    """

    def __init__(self, settings: Settings,
                 tamper: Callable[[int, Message], Message] | None = None,
                 crash: Iterable[int] = (),
                 node_configs: Mapping[int, Mapping[str, Any]] | None = None):
        self.settings = settings
        self.tamper = tamper
        self.crash = set(crash)
        self.node_configs = dict(node_configs or {})
        self.node_ids = [100 + i for i in range(settings.num_clients)]
        self._ids = itertools.count()

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> list[Message]:
        replies = []
        for msg in messages:
            client = self.node_ids.index(msg.metadata.dst_node_id)
            config = msg.content["config"]
            try:
                if client in self.crash:
                    raise MemoryError(f"client {client} ran out of memory")
                settings = settings_for_node(self.settings.to_mapping(), {
                    "partition-id": client, **self.node_configs.get(client, {})})
                upload = run_client(settings, client, decode_models(msg.content["arrays"]),
                                    list(config["sections"]), int(config["server-round"]),
                                    list(config.get("optional-sections", [])))
                reply = Message(encode_upload(upload), reply_to=msg)
            except Exception as exc:  # what Flower does with a ClientApp exception
                reply = Message(Error(code=0, reason=str(exc)), reply_to=msg)
            replies.append(self.tamper(client, reply) if self.tamper else reply)
        return replies

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    # The remaining Grid methods are not used by Strategy.start.
    def set_run(self, run_id: int) -> None:
        raise NotImplementedError

    @property
    def run(self):  # noqa: ANN201
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        raise NotImplementedError

    def get_nodes(self):  # noqa: ANN201
        raise NotImplementedError

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        raise NotImplementedError


@pytest.fixture
def small_settings(tmp_path) -> Settings:
    """3 clients on a 3000-sample real FMNIST subset, 3 epochs: seconds per federation."""
    return Settings(num_clients=3, train_subset=3000, local_epochs=3, alpha=1.0,
                    output_dir=str(tmp_path), val_size=200)
