"""fedfusion ClientApp: train M members from the broadcast inits, upload what the server asks.

The same ClientApp runs in a simulation (one Ray actor per SuperNode) and on a real
SuperNode. Node config may override a few run-config keys per client (for example
``flower-supernode --node-config "partition-id=0 num-partitions=5 num-members=3"``):
see :data:`fedfusion.app.config.NODE_OVERRIDES`. A simulation gives every node the same
node config, so per-client architectures there come from the run-config key
``client-models`` instead (:func:`client_settings`).

This module decides which client a node is and the settings it trains under; one round's
work (local objective, training data, the reply through :mod:`fedfusion.client`) is
:func:`fedfusion.app.client_round.handle_train`. With ``client-data='local'`` (real
devices) a node's client id is its node config's ``client-id`` (else ``partition-id``), any
number >= 0 that stays with the device (:func:`node_client_id`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedfusion import setup_logging
from fedfusion.app.client_round import handle_train
from fedfusion.app.config import NODE_OVERRIDES, ConfigError, Settings
from fedfusion.app.federation import client_for_partition

#: the largest client id a node config may give (ids go into uploads and file names)
MAX_CLIENT_ID = 2**31 - 1

app = ClientApp()


def node_client_id(settings: Settings, node_config: Mapping[str, Any]) -> int:
    """The client id a node trains as: ``partition-id`` (an index of the shared split), or
    with ``client-data='local'`` its ``client-id`` (else ``partition-id``): the device's own
    id, which stays the same whichever devices join or leave."""
    key = "client-id" if settings.client_data == "local" and "client-id" in node_config \
        else "partition-id"
    if key not in node_config:
        raise ConfigError("the node config has no 'client-id' or 'partition-id': start the "
                          "SuperNode with --node-config \"client-id=<id> ...\"")
    value = node_config[key]
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CLIENT_ID:
        raise ConfigError(f"node config {key}={value!r} must be an integer in "
                          f"0..{MAX_CLIENT_ID}")
    return value


def client_settings(settings: Settings, client_id: int) -> Settings:
    """The settings client ``client_id`` trains under: the run's, with its ``client-models``
    entry (per-client architecture) applied where that key is set."""
    entries = settings.parsed_client_models()
    if entries is None or not 0 <= client_id < len(entries) or not entries[client_id]:
        return settings  # (an out-of-range id fails with a clear message in the split)
    return settings.replace(**{k.replace("-", "_"): v for k, v in entries[client_id].items()})


def settings_for_node(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> Settings:
    """A node's settings: run config < its ``client-models`` entry < its node config."""
    settings = Settings.from_mapping(run_config)
    if "partition-id" in node_config:
        settings = client_settings(settings, int(node_config["partition-id"]))
    overrides = {k: node_config[k] for k in NODE_OVERRIDES if k in node_config}
    if not overrides:
        return settings
    return Settings.from_mapping({**settings.to_mapping(), **overrides})


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Flower entry point: one round of local training and the upload."""
    setup_logging()
    node_config = dict(context.node_config)
    run_settings = Settings.from_mapping(context.run_config)
    if run_settings.largest_client_first:
        # simulations only: node p trains the p-th largest client (client_for_partition)
        node_config["partition-id"] = client_for_partition(
            run_settings, int(node_config["partition-id"]))
    client_id = node_client_id(run_settings, node_config)
    node_config["partition-id"] = client_id  # its client-models entry, with client-data='local'
    settings = settings_for_node(context.run_config, node_config)
    return handle_train(settings, client_id, msg, context.state)
