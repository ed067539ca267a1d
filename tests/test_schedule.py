"""Largest client first: which client a simulation node trains."""

from fedfusion.app.config import Settings
from fedfusion.app.federation import client_for_partition, federated_split
from fedfusion.client_app import settings_for_node


def test_partitions_take_the_clients_in_decreasing_size(small_settings: Settings) -> None:
    settings = small_settings.replace(alpha=0.1, num_clients=4)
    sizes = [len(rows) for rows in federated_split(settings).client_indices]
    order = [client_for_partition(settings, p) for p in range(4)]
    assert sorted(order) == [0, 1, 2, 3]  # every client trained once
    assert [sizes[c] for c in order] == sorted(sizes, reverse=True)
    assert client_for_partition(settings, 7) == 7  # out of range: the split reports it


def test_a_nodes_per_client_model_follows_the_client_it_trains(small_settings: Settings) -> None:
    settings = small_settings.replace(alpha=0.1, num_clients=3,
                                      client_models='[{"model": "mlp"}, {}, {}]')
    node = next(p for p in range(3) if client_for_partition(settings, p) == 0)
    mapping = settings.to_mapping()
    assert settings_for_node(mapping, {"partition-id": node}).model == "mlp"
    others = [p for p in range(3) if p != node]
    assert all(settings_for_node(mapping, {"partition-id": p}).model != "mlp" for p in others)
