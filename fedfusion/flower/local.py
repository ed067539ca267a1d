"""A Flower Grid that runs any ClientApp in this process: a federation without Ray or gRPC.

For tests, notebooks and small experiments with your own ClientApp::

    grid = LocalGrid(client_app, num_nodes=5)
    strategy = FedBEns(Net, num_clients=5, num_members=3)
    strategy.start(grid)

Node ``i`` has id ``100 + i`` (or ``node_ids[i]``: Flower's own are random 64-bit integers) and
node config ``{"partition-id": i, "num-partitions": N}``
(plus ``node_configs[i]``); each keeps its own ``context.state`` across rounds, as Flower's
SuperNodes do. Clients run one after another; the round ``timeout`` is honoured as on a real
grid, where they work in parallel: each client gets ``timeout`` seconds of its own, and one
that has not replied by then (slow or hung) is left behind and sends no reply.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


def ensure_task_identity() -> None:
    """Flower builds a Message only inside a run (its task identity: run, task and node id);
    inside Flower the SuperLink sets it. In a process without a run, give it run 1, task 1,
    node 0 through Flower's public setters, as Flower's own in-process compat runner does;
    an identity already set (a real run in this process) is left alone."""
    try:
        TaskIdentity.run_id  # noqa: B018 (the public getter raises while no run is set)
    except RuntimeError:
        TaskIdentity.run_id = TaskIdentity.task_id = 1
        TaskIdentity.node_id = 0


class LocalGrid(Grid):
    """Nodes ``100 + i`` (or ``node_ids``) run ``client_app`` in this process.

    Parameters
    ----------
    client_app : ClientApp
        Any Flower ClientApp.
    num_nodes : int
        Number of nodes (clients).
    run_config : mapping, optional
        ``context.run_config`` of every node.
    node_configs : mapping, optional
        Per node index, entries added to its ``context.node_config``.
    tamper : callable, optional
        ``tamper(node_index, reply) -> reply``: corrupt a client's reply (fault tests).
    crash : iterable of int
        Node indices whose ClientApp raises (as a node that runs out of memory).
    delay : mapping, optional
        Per node index, seconds added to its work (a slow node).
    node_ids : sequence of int, optional
        The nodes' ids (default ``100 + i``), e.g. 64-bit ones as Flower's SuperLink gives.
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, *,
                 run_config: Mapping[str, Any] | None = None,
                 node_configs: Mapping[int, Mapping[str, Any]] | None = None,
                 tamper: Callable[[int, Message], Message] | None = None,
                 crash: Iterable[int] = (), delay: Mapping[int, float] | None = None,
                 node_ids: Sequence[int] | None = None):
        ensure_task_identity()
        self.client_app = client_app
        self.tamper = tamper
        self.crash = set(crash)
        self.delay = dict(delay or {})
        self.node_ids = (list(node_ids) if node_ids is not None
                         else [100 + i for i in range(num_nodes)])
        if len(self.node_ids) != num_nodes or len(set(self.node_ids)) != num_nodes:
            raise ValueError(f"LocalGrid needs {num_nodes} distinct node ids, got "
                             f"{self.node_ids[:8]}")
        node_configs = node_configs or {}
        self.contexts = {
            node: Context(run_id=1, node_id=node, state=RecordDict(),
                          run_config=dict(run_config or {}),
                          node_config={"partition-id": i, "num-partitions": num_nodes,
                                       **node_configs.get(i, {})})
            for i, node in enumerate(self.node_ids)}
        self._ids = itertools.count()

    #: replies are yielded one by one, as a streaming grid's
    #: (:class:`~fedfusion.flower.streaming.StreamingGrid`)
    streams_replies: ClassVar[bool] = True

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterator[Message]:
        """Run each addressed node's ClientApp, one after another, each in a worker thread
        given ``timeout`` seconds of its own (a real grid's nodes work in parallel), and
        yield its reply as it comes: a node that has not replied by then is left behind, as
        a real grid stops waiting for it (its thread finishes, or hangs, in the background;
        its reply is dropped)."""
        for msg in messages:
            node = msg.metadata.dst_node_id
            index = self.node_ids.index(node)
            outcome: list[Message] = []
            worker = threading.Thread(target=self._run_node, args=(msg, node, index, outcome),
                                      name=f"fedfusion-local-node-{node}", daemon=True)
            worker.start()
            worker.join(timeout)
            if worker.is_alive() or not outcome:
                continue  # too late: the grid stopped waiting for this node
            reply = outcome[0]
            yield self.tamper(index, reply) if self.tamper else reply

    def _run_node(self, msg: Message, node: int, index: int, outcome: list[Message]) -> None:
        try:
            time.sleep(self.delay.get(index, 0.0))
            if index in self.crash:
                raise MemoryError(f"client {index} ran out of memory")
            outcome.append(self.client_app(msg, self.contexts[node]))
        except Exception as exc:  # what Flower does with a ClientApp exception
            outcome.append(Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"),
                                   reply_to=msg))

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
