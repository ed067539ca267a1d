"""A client's part of FENS' aggregator rounds, for any ClientApp.

The first aggregator message a client gets holds the K uploaded models: it computes their
log-probabilities on its held-out rows once and keeps them (and the labels) in the node's
``context.state``, which Flower keeps across the rounds of a run; every later message holds
only the global aggregator. Each round: load it, take the local epochs the train config
asks for (:class:`~fedfusion.strategies.fens.training.LocalTraining`), send it back with the
row count.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from torch import nn

from fedfusion.core.state import load_models
from fedfusion.device import model_device
from fedfusion.flower.train_config import ROUND_KEY
from fedfusion.strategies.fens.predictor import LogitAggregator
from fedfusion.strategies.fens.training import (
    AGGREGATOR_RECORD,
    HIDDEN_KEY,
    MODELS_RECORD,
    NUM_CLASSES_KEY,
    NUM_MODELS_KEY,
    PHASE_AGGREGATOR,
    PHASE_KEY,
    LocalTraining,
    decode_aggregator,
    features,
    train_locally,
)
from fedfusion.wire import decode_models

#: where ``context.state`` keeps the client's features and labels between rounds
FEATURES_STATE = "fedfusion.fens.features"


def is_aggregator_round(msg: Message | RecordDict) -> bool:
    """True when the server's message is one of FENS' aggregator rounds."""
    content = msg.content if isinstance(msg, Message) else msg
    return "config" in content and content["config"].get(PHASE_KEY) == PHASE_AGGREGATOR


def aggregator_round(content: RecordDict, state: RecordDict,
                     model_fn: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor,
                     seed: int = 0, device: torch.device | str | None = None) -> RecordDict:
    """The reply content of one aggregator round on the held-out rows ``(x, y)``: the
    client's new aggregator and its row count (``x`` is used in the first round only).

    The models' features and the aggregator's training run on ``device`` (default: where
    ``model_fn()`` builds the models), the rows moved there a batch at a time; what is kept
    in ``state`` and sent back are CPU copies."""
    config = content["config"]
    num_models, num_classes = int(config[NUM_MODELS_KEY]), int(config[NUM_CLASSES_KEY])
    if MODELS_RECORD in content:
        models = load_models(decode_models(content[MODELS_RECORD]), model_fn,
                             "FENS: uploaded model")
        if device is not None:
            models = [model.to(device) for model in models]
        if len(models) != num_models:
            raise ValueError(f"FENS: the server sent {len(models)} models for an aggregator "
                             f"over {num_models}")
        z = features(models, x) if len(x) else torch.empty(0, num_models, num_classes)
        state[FEATURES_STATE] = ArrayRecord({
            "z": Array(np.ascontiguousarray(z.numpy())),
            "y": Array(np.ascontiguousarray(y.long().numpy()))})
    if FEATURES_STATE not in state:
        raise ValueError("FENS: an aggregator round without the models, and no features "
                         "kept from an earlier one (was this node restarted mid-run?)")
    kept = state[FEATURES_STATE]
    z, labels = torch.from_numpy(kept["z"].numpy()), torch.from_numpy(kept["y"].numpy())
    if tuple(z.shape[1:]) != (num_models, num_classes):
        raise ValueError(f"FENS: kept features are {tuple(z.shape)}, the server's aggregator "
                         f"takes {num_models} models x {num_classes} classes")
    with torch.random.fork_rng(devices=[]):
        aggregator = LogitAggregator(num_models, num_classes, int(config[HIDDEN_KEY]))
    try:
        received = decode_aggregator(content[AGGREGATOR_RECORD], {
            k: tuple(v.shape) for k, v in aggregator.state_dict().items()})
    except ValueError as exc:
        raise ValueError(f"FENS: the server's aggregator round: {exc}") from exc
    aggregator.load_state_dict(received)
    if device is None:  # where model_fn() builds the models (the first round's models)
        with torch.random.fork_rng(devices=[]):
            device = model_device(model_fn())
    aggregator.to(device)
    loss = 0.0
    if len(labels):
        loss = train_locally(aggregator, z, labels, LocalTraining.from_config(config),
                             (seed * 1_000_003 + int(config.get(ROUND_KEY, 0))) % 2**62)
    return RecordDict({
        AGGREGATOR_RECORD: ArrayRecord({k: Array(v.detach().cpu().numpy().copy())
                                        for k, v in aggregator.state_dict().items()}),
        "metrics": MetricRecord({"num-examples": len(labels), "fens.loss": loss})})


def reply(msg: Message, state: RecordDict, model_fn: Callable[[], nn.Module],
          x: torch.Tensor, y: torch.Tensor, seed: int = 0,
          device: torch.device | str | None = None) -> Message:
    """The Flower reply to an aggregator round (:func:`aggregator_round`)."""
    return Message(content=aggregator_round(msg.content, state, model_fn, x, y, seed, device),
                   reply_to=msg)
