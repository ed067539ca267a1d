"""Largest client first: which client a simulation node trains."""

from types import SimpleNamespace

import pytest
from flwr.app import Context, RecordDict

from fedfusion import client_app
from fedfusion.app.config import Settings
from fedfusion.app.federation import client_for_partition, federated_split


def test_partitions_take_the_clients_in_decreasing_size(small_settings: Settings) -> None:
    settings = small_settings.replace(alpha=0.1, num_clients=4, seed=3)
    sizes = [len(rows) for rows in federated_split(settings).client_indices]
    order = [client_for_partition(settings, p) for p in range(4)]
    assert sorted(order) == [0, 1, 2, 3] != order  # every client trained once, reordered
    assert [sizes[c] for c in order] == sorted(sizes, reverse=True)
    assert client_for_partition(settings, 7) == 7  # out of range: the split reports it


@pytest.mark.parametrize("largest_first", [True, False])
def test_the_clientapp_trains_the_mapped_client_with_its_own_settings(
        small_settings: Settings, monkeypatch, largest_first: bool) -> None:
    """With the flag, Flower's entry point maps the node to its client, then takes that
    client's settings (a per-client model) and trains it under its own id; without it,
    partition-id is the client id (real SuperNodes)."""
    settings = small_settings.replace(alpha=0.1, num_clients=3, seed=3,  # sizes: 1 > 2 > 0
                                      client_models='[{"model": "mlp"}, {}, {}]',
                                      largest_client_first=largest_first)
    calls = []

    def fake_handle_train(node_settings, client, msg, state):
        calls.append((node_settings.model, client))
        return msg

    monkeypatch.setattr(client_app, "handle_train", fake_handle_train)
    for node in range(3):
        context = Context(run_id=1, node_id=node, node_config={"partition-id": node},
                          state=RecordDict(), run_config=settings.to_mapping())
        client_app.train(SimpleNamespace(content=RecordDict()), context)
    assert [client for _, client in calls] == ([1, 2, 0] if largest_first else [0, 1, 2])
    assert all((model == "mlp") == (client == 0) for model, client in calls)
