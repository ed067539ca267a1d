"""One train message -> the App client's reply, built on the library's client API.

The members start from the server's broadcast (:func:`fedfusion.client.initial_models`:
an init that does not fit the node's network, or a model the strategy cannot fuse, is
refused before anything trains), train on the client's data
(:func:`fedfusion.training.train_members`, with the loss terms of
:mod:`fedfusion.app.local_objective`), and :func:`fedfusion.client.reply` builds the upload
of exactly the sections the server asks for. FENS' aggregator rounds go to
:func:`fedfusion.client.aggregator_reply`.

Where a client computes: run-config ``client-device`` (``auto``: the GPU Flower gave its
process, else the CPU; :func:`fedfusion.device.client_device`). Its members train, its
curvature and Grams are fitted and FENS' aggregator rounds run there; the data stays on the
CPU and moves a batch at a time, and the upload is built from CPU copies.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from torch import nn

from fedfusion import client
from fedfusion.app.client_data import TrainingData, training_data
from fedfusion.app.config import Settings, default_model
from fedfusion.app.federation import holdout_split
from fedfusion.app.local_objective import (
    LocalObjective,
    keep_previous,
    loss_terms,
    previous_models,
)
from fedfusion.contrastive import ContrastiveTerm
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.model_check import DRY_ROWS, check_received
from fedfusion.device import client_device
from fedfusion.flower.local import ensure_task_identity
from fedfusion.flower.train_config import (
    MODEL_KEY,
    MODEL_KWARGS_KEY,
    OPTIONAL_SECTIONS_KEY,
    ROUND_KEY,
    SECTIONS_KEY,
)
from fedfusion.seeding import seeded
from fedfusion.strategies.fens import HOLDOUT_KEY
from fedfusion.strategies.requirements import ALL_REQUIREMENTS
from fedfusion.training import LossTerm, TrainConfig, train_members
from fedfusion.wire import WEIGHTS, ClientUpload, NumpyDict, decode_upload, encode_models

log = logging.getLogger("fedfusion")


def member_seed(settings: Settings, client_id: int, member: int, server_round: int) -> int:
    """The seed of member ``member``'s own init and training in round ``server_round``."""
    return (settings.seed * 1_000_003 + server_round * 10_007 + client_id * 101 + member) % 2**62


def section_options(settings: Settings) -> dict[str, Any]:
    """The run config's keyword arguments of :func:`fedfusion.client.make_upload`."""
    return {"curvature_backend": settings.curvature_backend,
            "curvature_batch_size": settings.curvature_batch_size,
            "curvature_rank": settings.curvature_rank, "curvature_half": settings.curvature_half,
            "temperature": settings.temperature, "prior_var": settings.prior_var,
            "seed": settings.seed, "accelerate": settings.accelerate}


def client_spec(settings: Settings, data: TrainingData) -> ModelSpec:
    """The architecture this node trains, on its data's shape and classes."""
    return ModelSpec(default_model(settings, data.input_shape), data.input_shape,
                     data.num_classes, settings.parsed_model_kwargs())


def broadcast_architecture(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The architecture the server broadcast, as its train ``config`` names it (None where it
    names none: a server that is not a fedfusion strategy)."""
    if MODEL_KEY not in config:
        return None
    return str(config[MODEL_KEY]), json.loads(str(config.get(MODEL_KWARGS_KEY, "{}")))


def member_models(settings: Settings, spec: ModelSpec, msg: Message, client_id: int,
                  server_round: int, x: torch.Tensor) -> list[nn.Module]:
    """The node's ``settings.num_members`` members, on the CPU.

    Where the node trains the architecture the server broadcast, member m is the server's
    init m (:func:`fedfusion.client.initial_models`, which refuses an init that does not fit
    and a model the strategy cannot fuse). A node configured with its own architecture
    (run-config ``client-models``, node config ``model``: ensembles and AMS fuse those)
    and the members beyond the broadcast start from their own init, seeded by
    :func:`member_seed`, checked for the strategy the same way."""
    content = msg.content
    config = content["config"] if "config" in content else {}
    broadcast = broadcast_architecture(config)
    if broadcast is None or spec.same_architecture(*broadcast):
        models = client.initial_models(msg, spec.build, x)[:settings.num_members]
    else:
        log.info("client %d trains its own architecture %s%s (the server broadcast %s%s)",
                 client_id, spec.name, spec.kwargs, *broadcast)
        models = []
    checked = bool(models)  # initial_models checked what it loaded
    for m in range(len(models), settings.num_members):
        with seeded(member_seed(settings, client_id, m, server_round)):  # not the process
            models.append(spec.build())
    if not checked and models:
        check_received(models[0], config, x[:DRY_ROWS], spec.name, checks=ALL_REQUIREMENTS)
    return models


def handle_train(settings: Settings, client_id: int, msg: Message, state: RecordDict
                 ) -> Message:
    """One train message -> the reply; keeps the trained members in ``state`` (the node's
    ``context.state``) when the contrastive term needs them next round."""
    config = msg.content["config"]
    if config.get("partition-sha256"):
        # the server's partition file: refuse to train on a copy that differs from it
        settings = settings.replace(partition_sha256=str(config["partition-sha256"]))
    if client.is_aggregator_round(msg):
        return aggregator_round(settings, client_id, msg, state)
    objective = LocalObjective.from_config(config)
    contrastive = objective.contrastive_weight > 0
    previous = previous_models(state) if contrastive else []
    torch.set_num_threads(settings.client_threads)
    device = client_device(settings.client_device, client_id)  # refused before any work
    started = time.perf_counter()
    data = training_data(settings, client_id, config)
    x, y = data.x, data.y
    holdout = float(config.get(HOLDOUT_KEY, 0.0))
    if holdout:  # rows kept for a later phase (FENS' aggregator), not trained on
        keep, _ = holdout_split(len(y), holdout, settings.data_seed, client_id)
        x, y = x[keep], y[keep]
    load_s = time.perf_counter() - started  # ~0 after this process's first client
    spec = client_spec(settings, data)
    server_round = int(config.get(ROUND_KEY, 1))
    # what the server's strategy cannot fuse is refused here, before any member trains
    models = member_models(settings, spec, msg, client_id, server_round, x)
    seeds = [member_seed(settings, client_id, m, server_round) for m in range(len(models))]
    metrics = train(settings, client_id, models, x, y, seeds, objective, previous, device)
    reply = client.reply(
        msg, models, x, y, client_id=client_id, model_name=spec.name,
        model_kwargs=spec.kwargs, num_classes=data.num_classes,
        metrics={"load-time-s": load_s, **metrics}, started=started,
        **section_options(settings))
    if contrastive:
        keep_previous(state, models)
    return reply


def train(settings: Settings, client_id: int, models: Sequence[nn.Module], x: torch.Tensor,
          y: torch.Tensor, seeds: Sequence[int], objective: LocalObjective,
          previous: Sequence[Mapping[str, Any]], device: torch.device) -> dict[str, float]:
    """Train ``models`` on ``device`` (moved there before the loss terms, which keep
    references to their weights), all in one computation where the model allows it
    (:mod:`fedfusion.accel.stacked`); the metrics of the upload: ``train-time-s`` summed
    over members, and ``contrastive-members`` where the term was asked for."""
    train_config = TrainConfig(settings.local_epochs, settings.lr, settings.momentum,
                               settings.batch_size)
    member_terms: list[list[LossTerm]] = []
    with ExitStack() as stack:
        for m, model in enumerate(models):
            model.to(device)
            member_terms.append(loss_terms(model, objective,
                                           previous[m] if m < len(previous) else None, stack))
        all_stats = train_members(list(models), x, y, train_config, list(seeds), member_terms,
                                  accelerate=settings.accelerate)
    train_s = 0.0
    contrastive_members = 0
    for m, (terms, stats) in enumerate(zip(member_terms, all_stats, strict=True)):
        contrastive_members += any(isinstance(t, ContrastiveTerm) for t in terms)
        extra = f" (+ {', '.join(type(t).__name__ for t in terms)})" if terms else ""
        train_s += stats.seconds
        log.info("client %d member %d/%d on %s: %d samples, %.1f s (%.0f samples/s), "
                 "loss %.3f%s", client_id, m + 1, len(models), device, len(y),
                 stats.seconds, stats.samples_per_s, stats.final_loss, extra)
    return {"train-time-s": train_s,
            **({"contrastive-members": contrastive_members}
               if objective.contrastive_weight > 0 else {})}


def aggregator_round(settings: Settings, client_id: int, msg: Message, state: RecordDict
                     ) -> Message:
    """FENS' aggregator round on the rows this client held out of its local training."""
    config = msg.content["config"]
    data = training_data(settings, client_id, config)
    _, held = holdout_split(len(data.y), float(config[HOLDOUT_KEY]), settings.data_seed,
                            client_id)
    spec = client_spec(settings, data)
    return client.aggregator_reply(msg, state, spec.build, data.x[held], data.y[held],
                                   seed=member_seed(settings, client_id, 0, 0),
                                   device=client_device(settings.client_device, client_id))


def run_client(settings: Settings, client_id: int, inits: Sequence[NumpyDict] = (),
               sections: Sequence[str] = (WEIGHTS,), *, server_round: int = 1,
               optional_sections: Sequence[str] = (),
               server_config: Mapping[str, Any] | None = None,
               state: RecordDict | None = None) -> ClientUpload:
    """The App's client without a federation: :func:`handle_train` on the train message a
    fedfusion strategy would send (the broadcast ``inits``, the ``sections`` asked for, the
    round and the entries of ``server_config``: ``model``/``model-kwargs`` naming the inits'
    architecture, the local objective's keys, a data description), its reply decoded.
    ``state`` is the node's ``context.state`` (the previous round's models of the
    contrastive term)."""
    ensure_task_identity()
    config = ConfigRecord({ROUND_KEY: server_round, SECTIONS_KEY: list(sections),
                           **({OPTIONAL_SECTIONS_KEY: list(optional_sections)}
                              if optional_sections else {}),
                           **dict(server_config or {})})
    msg = Message(content=RecordDict({"arrays": encode_models(inits), "config": config}),
                  dst_node_id=client_id, message_type=MessageType.TRAIN)
    reply = handle_train(settings, client_id, msg, RecordDict() if state is None else state)
    spec = client_spec(settings, training_data(settings, client_id, config))
    return decode_upload(reply.content, client_id,
                         lambda name, kwargs: spec.variant(name, kwargs).param_shapes(), sections)
