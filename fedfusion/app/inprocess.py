"""A Flower Grid whose nodes run fedfusion's ClientApp logic in this process (no Ray, no gRPC).

For tests and small experiments: ``strategy.start(InProcessGrid(settings), ...)`` or
``run_server(settings, InProcessGrid(settings))`` run a whole federation, round by round,
through the strategy's own Message-API loop. Each node keeps its own ``state`` RecordDict
across rounds, as Flower's ``context.state`` does.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedfusion.app.config import Settings
from fedfusion.client_app import handle_train, settings_for_node


def ensure_task_identity() -> None:
    """Messages need a run identity; inside Flower the SuperLink sets it, here we do
    (only where nothing has set it yet)."""
    if TaskIdentity._run_id is None:
        TaskIdentity.run_id = TaskIdentity.task_id = 1
        TaskIdentity.node_id = 0


class InProcessGrid(Grid):
    """Nodes ``100 + i`` run client ``i`` of ``settings`` in this process.

    ``tamper(node_index, reply) -> reply`` lets a test corrupt one client's upload;
    clients in ``crash`` raise inside the ClientApp; ``delay[i]`` seconds are added to client
    i's work. The round ``timeout`` is honoured as on a real grid, where clients work in
    parallel: a client whose own work took longer than ``timeout`` sends no reply.
    Each client's settings come from
    :func:`~fedfusion.client_app.settings_for_node`, as in the ClientApp, with node config
    ``{"partition-id": i, **node_configs[i]}`` (e.g. a per-client ``model``).
    """

    def __init__(self, settings: Settings,
                 tamper: Callable[[int, Message], Message] | None = None,
                 crash: Iterable[int] = (),
                 node_configs: Mapping[int, Mapping[str, Any]] | None = None,
                 delay: Mapping[int, float] | None = None):
        ensure_task_identity()
        self.node_configs = dict(node_configs or {})
        self.settings = settings
        self.tamper = tamper
        self.crash = set(crash)
        self.delay = dict(delay or {})
        self.node_ids = [100 + i for i in range(settings.num_clients)]
        self.states = {node: RecordDict() for node in self.node_ids}
        self._ids = itertools.count()

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> list[Message]:
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            client = self.node_ids.index(node)
            start = time.perf_counter()
            try:
                time.sleep(self.delay.get(client, 0.0))
                if client in self.crash:
                    raise MemoryError(f"client {client} ran out of memory")
                settings = settings_for_node(self.settings.to_mapping(), {
                    "partition-id": client, **self.node_configs.get(client, {})})
                content = handle_train(settings, client, msg.content, self.states[node])
                reply = Message(content, reply_to=msg)
            except Exception as exc:  # what Flower does with a ClientApp exception
                reply = Message(Error(code=0, reason=str(exc)), reply_to=msg)
            if timeout is not None and time.perf_counter() - start > timeout:
                continue  # too late: the grid stopped waiting for this node
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
