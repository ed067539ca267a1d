"""fedfusion ClientApp: train M members from the broadcast inits, upload what the server asks.

The same ClientApp runs in a simulation (one Ray actor per SuperNode) and on a real
SuperNode. Node config may override a few run-config keys per client (for example
``flower-supernode --node-config "partition-id=0 num-partitions=5 num-members=3"``):
see :data:`fedfusion.app.config.NODE_OVERRIDES`. A simulation gives every node the same
node config, so per-client architectures there come from the run-config key
``client-models`` instead (:func:`client_settings`).

The local objective is the cross-entropy, plus what the server's train config asks for
(:class:`LocalObjective`): FedProx's proximal term to the received global model
(``prox-mu``) and MOON's model-contrastive term (``contrastive-weight``,
``contrastive-temperature``). The contrastive term needs the client's model of its previous
round: the ClientApp keeps it in ``context.state``, which Flower persists per node across
the rounds of a run (:func:`handle_train`).

Where a client computes: run-config ``client-device`` (``auto``: the GPU Flower gave its
process, else the CPU; :func:`fedfusion.device.client_device`). Its members train, its
curvature and Grams are fitted and FENS' aggregator rounds run there; the data stays on the
CPU and moves a batch at a time, and the upload is built from CPU copies.

Where a client's training data comes from (run-config ``client-data``, :func:`training_data`):

* ``partition`` (the default; simulations and demos): every process derives the same split
  of a built-in dataset (or reads the same ``partition-file``) and node ``partition-id``
  trains those rows; the number of clients is fixed by ``num-clients``.
* ``local`` (real devices): the node trains on its own file, ``data-path`` in its node
  config (:mod:`fedfusion.datasets.local_file`), and nothing else; its client id is its
  node config's ``client-id`` (else ``partition-id``), any number >= 0 that stays with the
  device. The server sends the image shape, class count and normalisation of its test set in
  the train config (:data:`DATA_DESCRIPTION_KEYS`). Devices can join and leave between runs
  without changing anyone else's data.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fedfusion import setup_logging
from fedfusion.app.config import NODE_OVERRIDES, ConfigError, Settings, default_model
from fedfusion.app.federation import client_for_partition, federated_split, holdout_split
from fedfusion.client import broadcast_states, make_upload, requested_sections
from fedfusion.constraints import FINITE_NON_NEGATIVE, FINITE_POSITIVE, Constraint
from fedfusion.contrastive import ContrastiveTerm
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.model_check import DRY_ROWS, check_received
from fedfusion.datasets.local_file import LocalDataError, normalise, read_local_data
from fedfusion.device import client_device
from fedfusion.flower.train_config import ROUND_KEY
from fedfusion.strategies.fens import HOLDOUT_KEY
from fedfusion.strategies.fens import client as fens_client
from fedfusion.strategies.requirements import ALL_REQUIREMENTS
from fedfusion.training import LossTerm, ProximalTerm, TrainConfig, train_members
from fedfusion.wire import WEIGHTS, ClientUpload, NumpyDict, encode_upload

log = logging.getLogger("fedfusion")

#: train-config keys by which a server with ``client-data='local'`` describes its data to the
#: devices: the image shape ``[C, H, W]``, the class count and the per-channel normalisation
#: of its test set (the devices' own files hold raw pixels)
DATA_DESCRIPTION_KEYS = ("data.input-shape", "data.num-classes", "data.input-mean",
                         "data.input-std")
#: the largest client id a node config may give (ids go into uploads and file names)
MAX_CLIENT_ID = 2**31 - 1

app = ClientApp()


@dataclass(frozen=True)
class LocalObjective:
    """The client-side loss terms a strategy asks for in the train config (0 = off)."""

    prox_mu: float = 0.0
    contrastive_weight: float = 0.0
    contrastive_temperature: float = 0.5

    #: train-config key -> field; the rules are the run-config keys' of the same names
    KEYS: ClassVar[dict[str, str]] = {
        "prox-mu": "prox_mu", "contrastive-weight": "contrastive_weight",
        "contrastive-temperature": "contrastive_temperature"}
    RULES: ClassVar[dict[str, Constraint]] = {
        "prox-mu": FINITE_NON_NEGATIVE, "contrastive-weight": FINITE_NON_NEGATIVE,
        "contrastive-temperature": FINITE_POSITIVE}

    def __post_init__(self) -> None:
        for key, name in self.KEYS.items():
            self.RULES[key].check(f"train config {key!r}", getattr(self, name))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LocalObjective:
        values = {}
        for key, name in cls.KEYS.items():
            if key in config:
                value = config[key]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"train config {key!r} must be a number, got {value!r}")
                values[name] = float(value)
        return cls(**values)


def loss_terms(model: nn.Module, objective: LocalObjective, previous: NumpyDict | None,
               stack: ExitStack) -> list[LossTerm]:
    """The objective's terms for ``model``, which holds the received global weights now.

    The contrastive term is left out without a previous model of the same architecture."""
    terms: list[LossTerm] = []
    if objective.prox_mu > 0:
        terms.append(ProximalTerm(model, objective.prox_mu))
    if objective.contrastive_weight > 0 and previous is not None and _same_shapes(
            previous, model.state_dict()):
        terms.append(stack.enter_context(ContrastiveTerm(
            model, model.state_dict(), previous, objective.contrastive_weight,
            objective.contrastive_temperature)))
    return terms


@dataclass(frozen=True)
class TrainingData:
    """What a client trains on: normalised images, labels, and the dataset's shape."""

    x: torch.Tensor
    y: torch.Tensor
    input_shape: tuple[int, ...]
    num_classes: int


def data_description(input_shape: Sequence[int], num_classes: int, mean: Sequence[float],
                     std: Sequence[float]) -> dict[str, Any]:
    """The train-config entries (:data:`DATA_DESCRIPTION_KEYS`) a ``client-data='local'``
    server sends: what the devices' files must match, and how to normalise them."""
    return dict(zip(DATA_DESCRIPTION_KEYS, (
        [int(v) for v in input_shape], int(num_classes), [float(v) for v in mean],
        [float(v) for v in std]), strict=True))


def training_data(settings: Settings, client_id: int, config: Mapping[str, Any] | None = None
                  ) -> TrainingData:
    """Client ``client_id``'s training data: its rows of the shared split (``client-data =
    'partition'``) or the node's own file ``data-path`` (``'local'``), normalised as the
    server's description in the train config ``config`` says."""
    if settings.client_data != "local":
        split = federated_split(settings)
        x, y = split.client_data(client_id)
        return TrainingData(x, y, split.bundle.input_shape, split.bundle.num_classes)
    config = config or {}
    if not settings.data_path:
        raise ConfigError(
            f"client {client_id}: the run has client-data='local' but this node has no "
            "data-path: start its SuperNode with --node-config \"data-path='/path/to/data.npz'\"")
    missing = [key for key in DATA_DESCRIPTION_KEYS if key not in config]
    if missing:
        raise ConfigError(f"client {client_id}: the server's train config lacks {missing}: it "
                          "must run fedfusion with client-data='local' as well")
    try:
        shape = tuple(int(v) for v in config["data.input-shape"])
        num_classes = int(config["data.num-classes"])
        mean = [float(v) for v in config["data.input-mean"]]
        std = [float(v) for v in config["data.input-std"]]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"client {client_id}: malformed data description in the train "
                          f"config: {exc}") from exc
    if len(shape) != 3 or min(shape) < 1 or num_classes < 1 or not all(
            math.isfinite(v) for v in mean + std) or not all(v > 0 for v in std):
        raise ConfigError(f"client {client_id}: invalid data description in the train config: "
                          f"shape {shape}, {num_classes} classes, mean {mean}, std {std}")
    try:
        data = normalise(read_local_data(settings.data_path, shape, num_classes), mean, std)
    except LocalDataError as exc:
        raise LocalDataError(f"client {client_id}: {exc}") from exc
    return TrainingData(data.x, data.y, shape, num_classes)


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


def member_seed(settings: Settings, client_id: int, member: int, server_round: int) -> int:
    return (settings.seed * 1_000_003 + server_round * 10_007 + client_id * 101 + member) % 2**62


def run_client(
    settings: Settings,
    client_id: int,
    inits: Sequence[NumpyDict],
    sections: Sequence[str] = (WEIGHTS,),
    server_round: int = 1,
    optional_sections: Sequence[str] = (),
    objective: LocalObjective = LocalObjective(),
    previous: Sequence[NumpyDict] = (),
    server_config: Mapping[str, Any] | None = None,
) -> ClientUpload:
    """Train ``settings.num_members`` members (member m from the server's init m where it
    broadcast one, else from its own seeded init) and make the upload
    (:func:`fedfusion.client.make_upload`).

    ``previous[m]`` is member m's model after this client's previous round (for the
    contrastive term of ``objective``); ``server_config`` is the round's train config (it
    describes the data with ``client-data='local'``, :func:`training_data`).

    The members live on ``settings.client_device`` (:func:`fedfusion.device.client_device`)
    from their init on: training, the loss terms, curvature and Grams run there, the data
    stays on the CPU and moves a batch at a time."""
    torch.set_num_threads(settings.client_threads)
    device = client_device(settings.client_device, client_id)  # refused before any work
    started = time.perf_counter()
    data = training_data(settings, client_id, server_config)
    x, y = data.x, data.y
    holdout = float((server_config or {}).get(HOLDOUT_KEY, 0.0))
    if holdout > 0:  # rows kept for a later phase (FENS' aggregator), not trained on
        keep, _ = holdout_split(len(y), holdout, settings.data_seed, client_id)
        x, y = x[keep], y[keep]
    load_s = time.perf_counter() - started  # ~0 after this process's first client
    spec = ModelSpec(default_model(settings, data.input_shape), data.input_shape,
                     data.num_classes, settings.parsed_model_kwargs())
    train_config = TrainConfig(settings.local_epochs, settings.lr, settings.momentum,
                               settings.batch_size)
    models: list[nn.Module] = []
    seeds: list[int] = []
    member_terms: list[list[LossTerm]] = []
    with ExitStack() as stack:
        for m in range(settings.num_members):
            seeds.append(member_seed(settings, client_id, m, server_round))
            with torch.random.fork_rng(devices=[]):  # the init is seeded, the process is not
                torch.manual_seed(seeds[-1])
                models.append(model := spec.build())
            if m < len(inits) and _same_shapes(inits[m], model.state_dict()):
                model.load_state_dict({k: torch.from_numpy(v.copy())
                                       for k, v in inits[m].items()})
            model.to(device)  # before the loss terms, which keep references to its weights
            member_terms.append(loss_terms(model, objective,
                                           previous[m] if m < len(previous) else None, stack))
        # what the server's strategy cannot fuse is refused before any member trains
        check_received(models[0], server_config or {}, x[:DRY_ROWS], spec.name,
                       checks=ALL_REQUIREMENTS)
        # all members in one computation where the model allows it (fedfusion.accel.stacked)
        all_stats = train_members(models, x, y, train_config, seeds, member_terms,
                                  accelerate=settings.accelerate)
    train_s = 0.0
    contrastive_members = 0
    for m, (terms, stats) in enumerate(zip(member_terms, all_stats, strict=True)):
        contrastive_members += any(isinstance(t, ContrastiveTerm) for t in terms)
        extra = f" (+ {', '.join(type(t).__name__ for t in terms)})" if terms else ""
        train_s += stats.seconds
        log.info("client %d member %d/%d on %s: %d samples, %.1f s (%.0f samples/s), "
                 "loss %.3f%s", client_id, m + 1, settings.num_members, device, len(y),
                 stats.seconds, stats.samples_per_s, stats.final_loss, extra)
    return make_upload(
        models, x, y, sections, optional_sections=optional_sections, client_id=client_id,
        model_name=spec.name, model_kwargs=spec.kwargs, num_classes=data.num_classes,
        metrics={"train-time-s": train_s, "load-time-s": load_s,
                 **({"contrastive-members": contrastive_members}
                    if objective.contrastive_weight > 0 else {})},
        **section_options(settings), started=started)


def section_options(settings: Settings) -> dict[str, Any]:
    """The run config's keyword arguments of :func:`fedfusion.client.make_upload`."""
    return {"curvature_backend": settings.curvature_backend,
            "curvature_batch_size": settings.curvature_batch_size,
            "curvature_rank": settings.curvature_rank, "curvature_half": settings.curvature_half,
            "temperature": settings.temperature, "prior_var": settings.prior_var,
            "seed": settings.seed, "accelerate": settings.accelerate}


def _same_shapes(a: Mapping[str, np.ndarray], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(tuple(a[k].shape) == tuple(b[k].shape) for k in a)


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


def previous_key(member: int) -> str:
    """Where ``context.state`` keeps member ``member``'s model of the previous round."""
    return f"fedfusion.previous.m{member}"


def handle_train(settings: Settings, client_id: int, content: RecordDict, state: RecordDict
                 ) -> RecordDict:
    """One train message -> the upload; keeps the trained members in ``state`` when the
    contrastive term needs them next round. Shared by the ClientApp and the in-process grid."""
    config = content["config"]
    if config.get("partition-sha256"):
        # the server's partition file: refuse to train on a copy that differs from it
        settings = settings.replace(partition_sha256=str(config["partition-sha256"]))
    if fens_client.is_aggregator_round(content):
        return aggregator_round(settings, client_id, content, state)
    objective = LocalObjective.from_config(config)
    contrastive = objective.contrastive_weight > 0
    previous = []
    while contrastive and previous_key(len(previous)) in state:
        previous.append({k: v.numpy() for k, v in state[previous_key(len(previous))].items()})
    sections, optional = requested_sections(content)
    upload = run_client(settings, client_id, broadcast_states(content), sections,
                        int(config.get(ROUND_KEY, 1)), optional, objective, previous,
                        server_config=config)
    if contrastive:
        for m in range(upload.num_members):
            state[previous_key(m)] = ArrayRecord(
                {k: Array(np.ascontiguousarray(v)) for k, v in upload.weights(m).items()})
    return encode_upload(upload)


def aggregator_round(settings: Settings, client_id: int, content: RecordDict,
                     state: RecordDict) -> RecordDict:
    """FENS' aggregator round on the rows this client held out of its local training."""
    config = content["config"]
    data = training_data(settings, client_id, config)
    _, held = holdout_split(len(data.y), float(config[HOLDOUT_KEY]), settings.data_seed,
                            client_id)
    spec = ModelSpec(default_model(settings, data.input_shape), data.input_shape,
                     data.num_classes, settings.parsed_model_kwargs())
    return fens_client.aggregator_round(content, state, spec.build, data.x[held],
                                        data.y[held], seed=member_seed(settings, client_id, 0, 0),
                                        device=client_device(settings.client_device, client_id))


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
    return Message(content=handle_train(settings, client_id, msg.content, context.state),
                   reply_to=msg)
