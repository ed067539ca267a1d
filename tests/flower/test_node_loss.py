"""Node loss is reported once, naming the right node and the real reason.

When a SuperNode dies mid-round, Flower's SuperLink answers its message itself: an error reply
with code NODE_UNAVAILABLE whose ``src_node_id`` is the SuperLink's (1), not the node's, and
whose ``reply_to_message_id`` is the id of the message sent to the node
(``flwr.server.superlink.linkstate.utils.create_message_error_unavailable_res_message``).
Reading the sender from ``src_node_id`` gave two exclusions: "client node 1: client error:
Error: Node Unavailable ..." and "node <id>: no reply within 90 s".

These tests run the strategy against Flower's own in-memory SuperLink state (the LinkState a
SuperLink keeps, with its heartbeat bookkeeping, and Flower's ``InMemoryGrid`` over it): nodes
are threads that heartbeat, pull their message and store their reply exactly as a SuperNode's
Fleet API calls do; a killed node stops heartbeating. Other tests feed ``aggregate_train`` the
reply shapes Flower builds, made by Flower's own functions.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from conftest import TinyNet
from flwr.app import ConfigRecord, Error, Message
from flwr.common.constant import (
    NOOP_ACCOUNT_NAME,
    NOOP_FLWR_AID,
    SUPERLINK_NODE_ID,
    ErrorCode,
)
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.server.superlink.linkstate.utils import (
    create_message_error_unavailable_ins_message,
    create_message_error_unavailable_res_message,
)
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from fedfusion import client
from fedfusion.flower.client_errors import (
    MESSAGE_UNAVAILABLE,
    NODE_UNAVAILABLE,
    REPLY_MESSAGE_UNAVAILABLE,
)
from fedfusion.flower.local import ensure_task_identity
from fedfusion.strategies import FedAvg
from fedfusion.wire import encode_models, encode_upload

HEARTBEAT_S = 0.5  # Flower declares a node lost after HEARTBEAT_PATIENCE (2) x this



def upload_reply(msg: Message, client_id: int) -> Message:
    """A valid reply to ``msg``: the broadcast model, uploaded as ``client_id``."""
    gen = torch.Generator().manual_seed(client_id)
    x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    return Message(encode_upload(client.make_upload(client.initial_models(msg, TinyNet), x, y,
                                                    client_id=client_id)), reply_to=msg)


class FlowerLink:
    """Flower's in-memory SuperLink state with ``len(behaviours)`` SuperNodes (threads).

    Each node heartbeats every 0.1 s and serves its messages through the LinkState calls a
    SuperNode's Fleet API makes (``get_message_ins``, ``store_message_res``), giving the reply
    a message id as the SuperNode does. ``behaviours[i](msg)`` returns node i's reply, or
    None: the node is killed on receiving the message (no heartbeat, no reply)."""

    def __init__(self, behaviours: list[Callable[[Message], Message | None]]):
        factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(),
                                   ObjectStoreFactory())
        self.state = factory.state()
        ensure_task_identity()  # messages carry the task identity's run id
        run = Run.create_empty(run_id=TaskIdentity.run_id)
        run.primary_task_id, run.federation_id = 4242, NOOP_FEDERATION_ID
        self.state.run_ids[run.run_id] = RunRecord(run=run)
        self.state.task_store[4242] = Task(task_id=4242, run_id=run.run_id)
        self.node_ids = []
        for _ in behaviours:
            node = self.state.create_node(NOOP_FLWR_AID, NOOP_ACCOUNT_NAME,
                                          secrets.token_bytes(32), heartbeat_interval=HEARTBEAT_S)
            self.state.acknowledge_node_heartbeat(node, HEARTBEAT_S)
            self.node_ids.append(node)
        self.grid = InMemoryGrid(factory, pull_interval=0.05)
        self.grid.set_run(run)
        self.killed: set[int] = set()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, args=(node, behaviour),
                                          daemon=True)
                         for node, behaviour in zip(self.node_ids, behaviours, strict=True)]

    def _serve(self, node: int, behaviour: Callable[[Message], Message | None]) -> None:
        while not self._stop.is_set():
            self.state.acknowledge_node_heartbeat(node, HEARTBEAT_S)
            for msg in self.state.get_message_ins(node_id=node, limit=1):
                reply = behaviour(msg)
                if reply is None:
                    self.killed.add(node)
                    return  # killed: its heartbeat stops, it never replies
                reply.metadata.__dict__["_message_id"] = str(uuid.uuid4())  # as a SuperNode
                assert self.state.store_message_res(reply) is not None
            time.sleep(0.1)

    @contextmanager
    def running(self) -> Iterator[InMemoryGrid]:
        """The nodes serve while the ServerApp's messages come from the SuperLink (whose
        node id a ServerApp's messages carry as their source)."""
        previous = TaskIdentity.node_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        for thread in self._threads:
            thread.start()
        try:
            yield self.grid
        finally:
            TaskIdentity.node_id = previous
            self._stop.set()
            for thread in self._threads:
                thread.join(5)


def test_a_node_lost_mid_round_gives_one_exclusion_naming_it():
    """Three SuperNodes, one killed on receiving its message: the round ends when Flower's
    heartbeat check gives up on it (about 1 s here, far before round_timeout), with exactly
    one exclusion naming the lost node and the reason, and the other two fused."""
    behaviours: list[Callable[[Message], Message | None]] = [
        lambda msg: upload_reply(msg, 0), lambda msg: None, lambda msg: upload_reply(msg, 2)]
    link = FlowerLink(behaviours)
    lost = link.node_ids[1]
    strategy = FedAvg(TinyNet, num_clients=3, round_timeout=60.0)
    started = time.perf_counter()
    with link.running() as grid:
        strategy.start(grid)
    assert time.perf_counter() - started < 30  # the heartbeat, not the round timeout
    assert link.killed == {lost}
    assert len(strategy.exclusions) == 1, strategy.exclusions
    exclusion = strategy.exclusions[0]
    assert exclusion["client"] == f"node {lost}"
    assert exclusion["reason"].startswith("node unavailable (lost heartbeat) after ")
    assert "Node Unavailable" in exclusion["detail"]  # Flower's own words kept as detail
    assert sorted((u.client_id, u.node_id) for u in strategy.uploads) == [
        (0, link.node_ids[0]), (2, link.node_ids[2])]


def test_a_client_error_on_a_supernode_names_that_node():
    """A ClientApp that raises on a SuperNode: the error reply comes from the node itself;
    one exclusion, naming the node and the ClientApp's exception."""
    def raises(msg: Message) -> Message:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                             reason="<class 'ValueError'>:<'bad partition'>"), reply_to=msg)

    link = FlowerLink([lambda msg: upload_reply(msg, 0), raises])
    strategy = FedAvg(TinyNet, num_clients=2, round_timeout=60.0)
    with link.running() as grid:
        strategy.start(grid)
    assert strategy.exclusions == [{"round": 1, "client": f"node {link.node_ids[1]}",
                                    "node_id": link.node_ids[1], "client_id": None,
                                    "reason": "client error: ValueError: bad partition"}]
    assert [u.node_id for u in strategy.uploads] == [link.node_ids[0]]


class NodesGrid:
    """Only what ``configure_train`` asks of a grid: the connected node ids."""

    def __init__(self, node_ids: list[int]):
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def sent_round(strategy: FedAvg, node_ids: list[int], server_round: int = 1,
               ids: bool = True) -> list[Message]:
    """The round's messages as a grid has pushed them (each given its id, as Flower's
    ``InMemoryGrid.push_messages`` does; ``ids=False``: a grid that gives none)."""
    messages = list(strategy.configure_train(
        server_round, encode_models(strategy.initial_models()), ConfigRecord(),
        NodesGrid(node_ids)))  # type: ignore[arg-type]
    for msg in messages:
        if ids:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    return messages


def test_flowers_own_error_replies_are_attributed_to_the_node_sent_to():
    """Each reply shape the SuperLink makes in a node's place (node unavailable, reply
    expired, message unavailable), built by Flower's own functions: src_node_id is the
    SuperLink's, yet each exclusion names the node the message went to, once, with the
    reason; no 'node 1' anywhere."""
    strategy = FedAvg(TinyNet, num_clients=4, round_timeout=90.0)
    messages = sent_round(strategy, [11, 22, 33, 44])
    by_node = {msg.metadata.dst_node_id: msg for msg in messages}
    replies = [
        upload_reply(by_node[11], 0),
        create_message_error_unavailable_res_message(by_node[22].metadata, "node_unavail"),
        create_message_error_unavailable_res_message(by_node[33].metadata, "msg_unavail"),
        create_message_error_unavailable_ins_message(by_node[44].metadata.message_id,
                                                     TaskIdentity.run_id),
    ]
    assert {reply.metadata.src_node_id for reply in replies[1:]} == {SUPERLINK_NODE_ID}
    strategy.aggregate_train(1, replies)
    reasons = {e["client"]: e["reason"] for e in strategy.exclusions}
    assert len(strategy.exclusions) == 3 and set(reasons) == {"node 22", "node 33", "node 44"}
    assert reasons["node 22"].startswith("node unavailable (lost heartbeat) after ")
    assert reasons["node 33"].startswith("reply expired after ")
    assert reasons["node 44"].startswith("message unavailable after ")
    assert not any("node 1" in str(e) for e in strategy.exclusions)
    assert [u.node_id for u in strategy.uploads] == [11]


def test_our_error_codes_are_flowers():
    assert (MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE) == (
        ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
        ErrorCode.NODE_UNAVAILABLE)


def test_a_node_the_grid_gave_up_on_early_is_not_reported_as_a_timeout():
    """A grid that returns before round_timeout without a word about a node: the exclusion
    says how long the grid waited, not 'no reply within <round_timeout> s'."""
    strategy = FedAvg(TinyNet, num_clients=2, round_timeout=90.0)
    messages = sent_round(strategy, [11, 22])
    strategy.aggregate_train(1, [upload_reply(messages[0], 0)])
    assert [e["client"] for e in strategy.exclusions] == ["node 22"]
    assert strategy.exclusions[0]["reason"].startswith("no reply: the grid returned after 0 s, "
                                                       "before the 90 s round timeout")


def test_a_reply_to_no_message_of_the_round_is_ignored_and_the_node_still_accounted():
    """A reply whose reply_to_message_id matches nothing sent and whose sender was not sent
    the round is not fused (who sent it is unknown); the silent node is excluded once."""
    strategy = FedAvg(TinyNet, num_clients=2, round_timeout=90.0)
    messages = sent_round(strategy, [11, 22])
    stray = upload_reply(messages[1], 5)
    stray.metadata.__dict__["_reply_to_message_id"] = "not-sent"
    stray.metadata.__dict__["_src_node_id"] = 99
    assert stray.metadata.reply_to_message_id == "not-sent" and stray.metadata.src_node_id == 99
    strategy.aggregate_train(1, [upload_reply(messages[0], 0), stray])
    assert [e["client"] for e in strategy.exclusions] == [
        "unknown node (reply from node 99)", "node 22"]
    assert "'not-sent', which this round did not send" in strategy.exclusions[0]["reason"]
    assert [u.client_id for u in strategy.uploads] == [0]


def test_a_second_reply_for_one_node_is_ignored():
    strategy = FedAvg(TinyNet, num_clients=2, round_timeout=90.0)
    messages = sent_round(strategy, [11, 22])
    strategy.aggregate_train(1, [upload_reply(messages[0], 0), upload_reply(messages[1], 1),
                                 upload_reply(messages[1], 7)])
    assert [(e["client"], e["reason"]) for e in strategy.exclusions] == [
        ("node 22", "a second reply to one message; ignored (the first was kept)")]
    assert [(u.client_id, u.node_id) for u in strategy.uploads] == [(0, 11), (1, 22)]


def test_a_grid_without_message_ids_is_read_by_the_sender():
    """A grid that gives its messages no ids (a test double, fedfusion's LocalGrid): replies
    are attributed by their sender, when the round was sent there."""
    strategy = FedAvg(TinyNet, num_clients=2, round_timeout=90.0)
    messages = sent_round(strategy, [11, 22], ids=False)
    error = Message(Error(code=0, reason="MemoryError: out of memory"), reply_to=messages[1])
    strategy.aggregate_train(1, [upload_reply(messages[0], 0), error])
    assert strategy.exclusions == [{"round": 1, "client": "node 22", "node_id": 22,
                                    "client_id": None,
                                    "reason": "client error: MemoryError: out of memory"}]


@pytest.mark.parametrize("code", [MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE,
                                  NODE_UNAVAILABLE])
def test_infrastructure_errors_are_not_called_client_errors(code):
    strategy = FedAvg(TinyNet, num_clients=2, round_timeout=90.0)
    messages = sent_round(strategy, [11, 22])
    error = create_message_error_unavailable_res_message(messages[1].metadata, "node_unavail")
    error.error.__dict__["_code"] = code  # the same shape, each code
    assert error.error.code == code
    strategy.aggregate_train(1, [upload_reply(messages[0], 0), error])
    assert len(strategy.exclusions) == 1
    assert not strategy.exclusions[0]["reason"].startswith("client error")
