"""A claimed client id cannot displace another client.

Identity comes from what the server knows, the Flower node id of the message a reply answers,
never from the ``client-id`` a reply writes (:mod:`fedfusion.flower.identity`). The rounds
here are driven through the strategy's own ``configure_train`` / ``aggregate_train`` with
replies built as Flower builds them (``Message(content, reply_to=msg)``), so node ids can be
chosen: an attacker with a LOWER node id than the honest owner, the case that used to win.
"""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest
import torch
from conftest import TinyNet
from flwr.app import ConfigRecord, Message
from helpers.node_replies import marked_upload

from fedfusion import LocalGrid, client
from fedfusion.app.config import Settings, build_strategy
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.diagnostics import client_table
from fedfusion.flower.identity import (
    MAX_REGISTRY_BYTES,
    SERVER_ID_BASE,
    NodeIdentities,
    RegistryError,
    read_client_registry,
)
from fedfusion.flower.sampling import NodeWaitTimeout
from fedfusion.strategies import FedAvg
from fedfusion.upload_store import load_uploads, save_uploads
from fedfusion.wire import encode_models


class NodesGrid:
    """Only what ``configure_train`` asks of a grid: the connected node ids."""

    def __init__(self, node_ids: list[int]):
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def play_round(strategy: FedAvg, claims: dict[int, int], server_round: int = 1) -> None:
    """One round: the strategy sends to ``claims``' nodes (ids given as a grid gives them),
    node n replies claiming ``claims[n]`` with weights marked ``1 + n * 1e-4``."""
    messages = strategy.configure_train(server_round, encode_models(strategy.initial_models()),
                                        ConfigRecord(), NodesGrid(sorted(claims)))  # type: ignore[arg-type]
    replies = []
    for msg in messages:
        msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())  # as the grid's push does
        node = msg.metadata.dst_node_id
        replies.append(marked_upload(msg, claims[node], 1 + node * 1e-4))
    strategy.aggregate_train(server_round, replies)


def fused(strategy: FedAvg) -> dict[int, tuple[int | None, int | None, str, float]]:
    """client id -> (node id, claimed id, source, the node whose weights the upload holds)."""
    return {u.client_id: (u.node_id, u.claimed_client_id, u.client_id_source,
                          round((float(u.weights()["fc.bias"][0]) - 1) * 1e4))
            for u in strategy.uploads}


def test_a_lower_node_id_cannot_take_an_owned_client_id():
    """Round 1: nodes 500 and 600 are clients 0 and 1. Round 2: a new node 400 (lower id)
    claims 1. Node 600 stays client 1 with its own upload; node 400 is fused too, under a
    server-assigned id, its claim kept as a label; nobody is excluded."""
    strategy = FedAvg(TinyNet, min_train_nodes=2, min_available_nodes=2)
    play_round(strategy, {500: 0, 600: 1}, 1)
    assert fused(strategy) == {0: (500, 0, "claimed", 500), 1: (600, 1, "claimed", 600)}
    play_round(strategy, {400: 1, 500: 0, 600: 1}, 2)
    assert strategy.exclusions == []
    assert fused(strategy) == {0: (500, 0, "registered", 500),
                               1: (600, 1, "registered", 600),
                               SERVER_ID_BASE: (400, 1, "server", 400)}


def test_an_id_claimed_by_two_new_nodes_at_once_goes_to_neither():
    """Both claim id 1 in the first round: who is honest cannot be told, so neither gets it
    (the lower node id used to win and push the other out); both are fused."""
    strategy = FedAvg(TinyNet, min_train_nodes=3, min_available_nodes=3)
    play_round(strategy, {100: 1, 101: 1, 102: 2})
    assert strategy.exclusions == []
    assert fused(strategy) == {2: (102, 2, "claimed", 102),
                               SERVER_ID_BASE: (100, 1, "server", 100),
                               SERVER_ID_BASE + 1: (101, 1, "server", 101)}


def test_a_node_keeps_its_id_whatever_it_claims_later():
    strategy = FedAvg(TinyNet, min_train_nodes=2, min_available_nodes=2)
    play_round(strategy, {500: 0, 600: 1}, 1)
    play_round(strategy, {500: 1, 600: 0}, 2)  # both now claim the other's id
    assert fused(strategy) == {0: (500, 1, "registered", 500),
                               1: (600, 0, "registered", 600)}
    assert strategy.exclusions == []


def test_an_absent_owner_keeps_its_id():
    """Node 600 (client 1) misses round 2; node 700 claiming 1 there still gets a fresh id:
    an id belongs to its node for the strategy's life, not only while it is online."""
    strategy = FedAvg(TinyNet, min_train_nodes=2, min_available_nodes=2)
    play_round(strategy, {500: 0, 600: 1}, 1)
    play_round(strategy, {500: 0, 700: 1}, 2)
    assert fused(strategy)[SERVER_ID_BASE][:3] == (700, 1, "server")
    play_round(strategy, {500: 0, 600: 1, 700: 1}, 3)
    assert {k: v[:3] for k, v in fused(strategy).items()} == {
        0: (500, 0, "registered"), 1: (600, 1, "registered"),
        SERVER_ID_BASE: (700, 1, "registered")}


def test_server_ids_skip_ids_that_are_owned_or_claimed():
    identities = NodeIdentities()
    first = identities.assign([(1, SERVER_ID_BASE), (2, 5), (3, 5)])
    assert {n: (a.client_id, a.source) for n, a in first.items()} == {  # type: ignore[union-attr]
        1: (SERVER_ID_BASE, "claimed"), 2: (SERVER_ID_BASE + 1, "server"),
        3: (SERVER_ID_BASE + 2, "server")}


def test_the_operator_registry_is_enforced(tmp_path):
    """With a registry: each node is fused under its registered id whatever it claims; a
    node outside it is not sent the round and is excluded, named, with the reason."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"500": 3, "600": 4}))
    strategy = FedAvg(TinyNet, min_train_nodes=2, min_available_nodes=2, client_registry=path)
    play_round(strategy, {400: 3, 500: 4, 600: 4})
    assert fused(strategy) == {3: (500, 4, "registry", 500), 4: (600, 4, "registry", 600)}
    assert strategy.exclusions == [{"round": 1, "client": "node 400", "node_id": 400,
                                    "client_id": None, "reason":
                                    "node 400 is not in the client registry; not sent the "
                                    "round"}]


def test_only_registered_nodes_count_towards_the_nodes_a_round_waits_for():
    """A stranger connected beside two of three registered nodes made the round go with two,
    below min_train_nodes; now the round waits for the third, and then leaves the stranger
    out, named."""
    registry = {500: 3, 600: 4, 700: 5}
    strategy = FedAvg(TinyNet, min_train_nodes=3, min_available_nodes=3,
                      client_registry=registry, node_wait_timeout=0.05)
    with pytest.raises(NodeWaitTimeout, match="2 node.s. connected of the 3 required"):
        strategy.configure_train(1, encode_models(strategy.initial_models()), ConfigRecord(),
                                 NodesGrid([500, 600, 999]))  # type: ignore[arg-type]
    messages = strategy.configure_train(1, encode_models(strategy.initial_models()),
                                        ConfigRecord(), NodesGrid([500, 600, 700, 999]))  # type: ignore[arg-type]
    assert [m.metadata.dst_node_id for m in messages] == [500, 600, 700]
    assert [e["node_id"] for e in strategy.exclusions] == [999]


def test_a_round_of_unregistered_nodes_fails_naming_them():
    strategy = FedAvg(TinyNet, min_train_nodes=2, min_available_nodes=2,
                      client_registry={500: 0, 600: 1}, node_wait_timeout=0.05)
    with pytest.raises(NodeWaitTimeout, match=r"0 node\(s\) connected of the 2 required .*; 2 "
                       r"more connected but not in the client registry: \['7', '8'\]"):
        play_round(strategy, {7: 0, 8: 1})
    with pytest.raises(ValueError, match="the client registry names 1 node.s., fewer than the 2"):
        FedAvg(TinyNet, min_train_nodes=2, min_available_nodes=2, client_registry={500: 0})


def test_an_unregistered_node_that_replies_anyway_is_excluded():
    identities = NodeIdentities({5: 0})
    assert identities.assign([(5, 9), (6, 0)]) == {
        5: identities.assign([(5, 9)])[5],
        6: "node 6 is not in the client registry (it claims client id 0); not fused"}


def test_uploads_without_flower_still_refuse_duplicates():
    """``fuse_uploads`` has no node ids: a second upload of an id is refused, as before."""
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    uploads = [client.make_upload([TinyNet()], x, y, client_id=0) for _ in range(2)]
    strategy = FedAvg(TinyNet)
    strategy.fuse_uploads(uploads)
    assert strategy.exclusions == [{"round": 1, "client": "a duplicate", "reason":
                                    "claims client id 0, already uploaded by an earlier upload"}]
    assert len(strategy.uploads) == 1 and strategy.uploads[0].node_id is None


def test_colliding_uploads_are_cached_apart_and_replay_as_they_were_fused(tmp_path):
    """The upload folder of a round with a collision: one file per fused upload, each the
    bytes of the node it came from, the manifest naming node, claim and source; a replay
    fuses the same clients under the same ids, nothing displaced."""
    folder = tmp_path / "uploads"
    strategy = FedAvg(TinyNet, min_train_nodes=2, min_available_nodes=2,
                      upload_sink=lambda ups: save_uploads(folder, ups, {}))
    play_round(strategy, {400: 1, 600: 1, 700: 2})
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["client_1073741824.npz", "client_1073741825.npz", "client_2.npz",
                     "manifest.json"]
    entries = json.loads((folder / "manifest.json").read_text())["clients"]
    assert [(e["client_id"], e["node_id"], e["claimed_client_id"], e["client_id_source"])
            for e in entries] == [(2, 700, 2, "claimed"), (SERVER_ID_BASE, 400, 1, "server"),
                                  (SERVER_ID_BASE + 1, 600, 1, "server")]
    with np.load(folder / "client_1073741825.npz") as npz:
        assert np.isclose(npz["m0/weights/fc.bias"][0], 1.06)  # node 600's own upload
    table = client_table(strategy.uploads)  # results.json's "clients"
    assert [(c["client_id"], c["node_id"], c["claimed_client_id"], c["client_id_source"])
            for c in table] == [(2, 700, 2, "claimed"), (SERVER_ID_BASE, 400, 1, "server"),
                                (SERVER_ID_BASE + 1, 600, 1, "server")]
    _, uploads, failures = load_uploads(folder)
    assert failures == []
    replay = FedAvg(TinyNet)
    replay.fuse_uploads(uploads)
    assert replay.exclusions == [] and fused(replay) == fused(strategy)


def test_save_uploads_refuses_two_uploads_of_one_id(tmp_path):
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    uploads = [client.make_upload([TinyNet()], x, y, client_id=3) for _ in range(2)]
    with pytest.raises(ValueError, match=r"client id\(s\) \[3\] appear more than once"):
        save_uploads(tmp_path / "uploads", uploads, {})
    assert not (tmp_path / "uploads").exists()  # refused before anything was written


@pytest.mark.parametrize(("field", "value", "message"), [
    ("node_id", -1, "clients[0].node_id is -1, expected 0..18446744073709551615"),
    ("node_id", "7", "clients[0].node_id must be int or null"),
    ("claimed_client_id", True, "clients[0].claimed_client_id must be int or null"),
    ("client_id_source", "mine", "clients[0].client_id_source is 'mine', expected one of"),
])
def test_a_manifest_with_a_bad_identity_field_leaves_that_client_out(tmp_path, field, value,
                                                                     message):
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    folder = save_uploads(tmp_path / "u", [client.make_upload([TinyNet()], x, y, client_id=0)],
                          {})
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["clients"][0][field] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _, uploads, failures = load_uploads(folder)
    assert uploads == [] and failures[0][0] == "0" and message in failures[0][1]


def test_old_manifests_without_identity_fields_still_load(tmp_path):
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    folder = save_uploads(tmp_path / "u", [client.make_upload([TinyNet()], x, y, client_id=0)],
                          {})
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["clients"]:
        for key in ("node_id", "claimed_client_id", "client_id_source"):
            del entry[key]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _, uploads, failures = load_uploads(folder)
    assert failures == [] and uploads[0].node_id is None and uploads[0].client_id_source == ""


@pytest.mark.parametrize(("content", "message"), [
    (b"{not json", "is not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "is not JSON: RecursionError"),
    (b"[1, 2]", "must hold a JSON object"),
    (b'{"abc": 1}', "key 'abc' is not a node id"),
    (b'{"-5": 1}', "key '-5' is not a node id"),
    (b'{"18446744073709551616": 1}', "is not a node id"),
    (b'{"5": true}', "node 5: client id must be an int in 0..2**31-1, got 'True'"),
    (b'{"5": 2147483648}', "node 5: client id must be an int"),
    (b'{"5": 1.0}', "node 5: client id must be an int"),
    (b'{"5": 1, "6": 1}', "client id 1 is given to both node 5 and node 6"),
    (b'{"5": 1, "05": 2}', "node 5 appears twice"),
])
def test_bad_registry_files_are_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "fleet.json"
    path.write_bytes(content)
    with pytest.raises(RegistryError, match=str(path)) as info:
        read_client_registry(path)
    assert message in str(info.value)


def test_a_missing_or_huge_registry_file_is_refused(tmp_path):
    with pytest.raises(RegistryError, match="cannot be read"):
        read_client_registry(tmp_path / "absent.json")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as handle:
        handle.truncate(MAX_REGISTRY_BYTES + 1)
    with pytest.raises(RegistryError, match="above the cap"):
        read_client_registry(huge)
    with pytest.raises(RegistryError, match="cannot be read"):
        FedAvg(TinyNet, client_registry=str(tmp_path / "absent.json"))
    os.mkfifo(tmp_path / "fifo.json")  # opening it would wait for a writer forever
    with pytest.raises(RegistryError, match="fifo.json is a FIFO, not a regular file"):
        read_client_registry(tmp_path / "fifo.json")


def test_the_run_config_key_reaches_the_strategy(tmp_path):
    path = tmp_path / "fleet.json"
    path.write_text('{"11": 0, "22": 1}')
    spec = ModelSpec.from_model_fn(TinyNet)
    strategy = build_strategy(Settings(strategy="fedavg", num_clients=2,
                                       client_registry=str(path)), spec)
    assert strategy.identities.fixed == {11: 0, 22: 1}
    assert build_strategy(Settings(strategy="fedavg"), spec).identities.fixed is None
    # a replay decides no identities (its uploads carry them): a registry gone since is moot
    replay = Settings(strategy="fedavg", client_registry=str(tmp_path / "gone.json"),
                      replay=str(tmp_path))
    assert build_strategy(replay, spec).identities.fixed is None


def test_local_grid_honest_clients_keep_their_claims():
    """The App's case: every node claims its own partition id; nothing changes for it."""
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:  # noqa: ANN001
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        return client.reply(msg, client.initial_models(msg, TinyNet), x, y,
                            client_id=int(context.node_config["partition-id"]))

    strategy = FedAvg(TinyNet, num_clients=3)
    strategy.start(LocalGrid(app, 3))
    assert [(u.client_id, u.node_id, u.claimed_client_id, u.client_id_source)
            for u in strategy.uploads] == [(i, 100 + i, i, "claimed") for i in range(3)]
