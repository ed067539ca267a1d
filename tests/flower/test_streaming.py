"""Replies handed over as they arrive, uploads on disk as they arrive.

A grid with Flower's public push / pull API whose replies come in one per pull: the
strategy, started on it, decodes each reply and writes its upload to the folder before the
next reply exists; an upload excluded after it arrived leaves no file; the folder replays
as the round fused it; a node that never answers ends the round at the timeout.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import numpy as np
import pytest
from conftest import TinyNet
from flwr.app import Message
from helpers.node_replies import marked_upload

from fedfusion.flower.streaming import StreamingGrid
from fedfusion.strategies import FedAvg
from fedfusion.upload_store import MANIFEST, UploadWriter, load_uploads
from fedfusion.wire import ClientUpload


class TrickleGrid:
    """Flower's push / pull API over nodes that answer one per pull, in node order, each
    claiming client id ``claims[node]`` (None: the node never answers). ``events`` logs
    each push, each reply made, and what the upload folder held at that moment."""

    def __init__(self, claims: dict[int, int | None], folder):
        self.claims, self.folder = claims, folder
        self.queue: list[Message] = []
        self.events: list[tuple[str, object]] = []

    def get_node_ids(self) -> list[int]:
        return sorted(self.claims)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            self.queue.append(msg)
            ids.append(msg.metadata.message_id)
        self.events.append(("push", len(ids)))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = set(message_ids)
        for i, msg in enumerate(self.queue):
            node = msg.metadata.dst_node_id
            if msg.metadata.message_id in wanted and self.claims[node] is not None:
                del self.queue[i]
                stored = sorted(p.name for p in self.folder.glob("*.npz"))
                self.events.append((f"reply {node}", stored))
                return [marked_upload(msg, self.claims[node], 1 + node * 1e-4)]
        return []


def test_replies_are_decoded_and_stored_one_by_one_as_they_arrive(tmp_path):
    folder = tmp_path / "uploads"
    grid = TrickleGrid({101: 0, 102: 1, 103: 2}, folder)
    writer = UploadWriter(folder, {"seed": 0})
    strategy = FedAvg(TinyNet, num_clients=3, upload_sink=writer, round_timeout=30)
    strategy.start(StreamingGrid(grid, pull_interval=0.01))  # type: ignore[arg-type]
    # each reply is made only after the previous one was decoded and written to disk (then
    # the evaluation round pushes nothing: fedfusion evaluates on the server)
    assert grid.events == [("push", 3), ("reply 101", []),
                           ("reply 102", ["node_101.npz"]),
                           ("reply 103", ["node_101.npz", "node_102.npz"]), ("push", 0)]
    assert sorted(p.name for p in folder.iterdir()) == ["client_0.npz", "client_1.npz",
                                                          "client_2.npz", MANIFEST]
    _, replayed, failures = load_uploads(folder)
    assert failures == []
    assert [(u.client_id, u.node_id) for u in replayed] == [(0, 101), (1, 102), (2, 103)]
    for live, again in zip(strategy.uploads, replayed, strict=True):
        for name, value in live.weights().items():
            np.testing.assert_array_equal(again.weights()[name], value)


def test_a_silent_node_ends_the_round_at_the_timeout_and_its_peers_are_kept(tmp_path):
    folder = tmp_path / "uploads"
    grid = TrickleGrid({101: 0, 102: None, 103: 2}, folder)
    strategy = FedAvg(TinyNet, num_clients=3, upload_sink=UploadWriter(folder, {}),
                      round_timeout=0.5)
    strategy.start(StreamingGrid(grid, pull_interval=0.05))  # type: ignore[arg-type]
    assert [u.client_id for u in strategy.uploads] == [0, 2]
    assert [(e["client"], e["reason"]) for e in strategy.exclusions] == [
        ("node 102", "no reply within 0.5 s")]
    assert sorted(p.name for p in folder.glob("*.npz")) == ["client_0.npz", "client_2.npz"]


def test_an_upload_left_out_of_the_round_after_it_arrived_leaves_no_file(tmp_path):
    """Written on arrival, then not among the round's uploads (excluded once the round's
    replies were in): its file goes; the others take their client id's name, and an upload
    not written yet is written under it."""
    writer = UploadWriter(tmp_path / "uploads", {"seed": 1})
    arrived = [ClientUpload(c, "x", {}, 10, [{"weights": {"a": np.full(2, c, np.float32)}}],
                            node_id=100 + c) for c in range(3)]
    for upload in arrived:
        writer.write(upload)
    late = ClientUpload(7, "x", {}, 10, [{"weights": {"a": np.zeros(2, np.float32)}}])
    writer([arrived[0], arrived[2], late])
    names = sorted(p.name for p in (tmp_path / "uploads").iterdir())
    assert names == ["client_0.npz", "client_2.npz", "client_7.npz", MANIFEST]
    _, replayed, failures = load_uploads(tmp_path / "uploads")
    assert failures == []
    assert [float(u.weights()["a"][0]) for u in replayed] == [0.0, 2.0, 0.0]


def test_the_writer_refuses_a_second_upload_of_one_client(tmp_path):
    writer = UploadWriter(tmp_path / "uploads", {})
    one = ClientUpload(3, "x", {}, 10, [{"weights": {"a": np.zeros(2, np.float32)}}])
    two = ClientUpload(3, "x", {}, 10, [{"weights": {"a": np.ones(2, np.float32)}}])
    with pytest.raises(ValueError, match=r"client id\(s\) \[3\] appear more than once"):
        writer([one, two])
    assert not (tmp_path / "uploads").exists()  # refused before anything was written
