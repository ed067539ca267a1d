"""fedfusion ClientApp: train M members from the broadcast inits, upload what the server asks.

The same ClientApp runs in a simulation (one Ray actor per SuperNode) and on a real
SuperNode. Node config may override a few run-config keys per client (for example
``flower-supernode --node-config "partition-id=0 num-partitions=5 num-members=3"``):
see :data:`NODE_OVERRIDES`. A simulation gives every node the same node config, so
per-client architectures there come from the run-config key ``client-models`` instead
(:func:`client_settings`).

The local objective is the cross-entropy, plus what the server's train config asks for
(:class:`LocalObjective`): FedProx's proximal term to the received global model
(``prox-mu``) and MOON's model-contrastive term (``contrastive-weight``,
``contrastive-temperature``). The contrastive term needs the client's model of its previous
round: the ClientApp keeps it in ``context.state``, which Flower persists per node across
the rounds of a run (:func:`handle_train`).
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
from fedfusion.app.config import Settings
from fedfusion.app.federation import client_for_partition, federated_split
from fedfusion.contrastive import ContrastiveTerm
from fedfusion.curvature import DEFAULT_BACKEND, import_laplace
from fedfusion.curvature.fit import uses_laplace
from fedfusion.payload import WEIGHTS, ClientUpload, NumpyDict, decode_models, encode_upload
from fedfusion.predictors import ModelSpec
from fedfusion.training import LossTerm, ProximalTerm, TrainConfig, train_members
from fedfusion.uploads import CURVATURE_PREFIX, build_section

log = logging.getLogger("fedfusion")

#: run-config keys a SuperNode's node config may override for its own client
NODE_OVERRIDES = ("model", "model-kwargs", "num-members", "local-epochs", "client-threads")

app = ClientApp()


def default_model(settings: Settings, input_shape: Sequence[int]) -> str:
    """The run's model: ``model`` if set, else LeNet for 1-channel and the CNN for 3-channel."""
    return settings.model or ("lenet" if input_shape[0] == 1 else "cnn")


@dataclass(frozen=True)
class LocalObjective:
    """The client-side loss terms a strategy asks for in the train config (0 = off)."""

    prox_mu: float = 0.0
    contrastive_weight: float = 0.0
    contrastive_temperature: float = 0.5

    #: train-config key -> field
    KEYS: ClassVar[dict[str, str]] = {
        "prox-mu": "prox_mu", "contrastive-weight": "contrastive_weight",
        "contrastive-temperature": "contrastive_temperature"}

    def __post_init__(self) -> None:
        for key, name in self.KEYS.items():
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"train config {key!r} must be a finite number >= 0, got {value}")
        if self.contrastive_temperature == 0:
            raise ValueError("train config 'contrastive-temperature' must be > 0")

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
) -> ClientUpload:
    """Train ``settings.num_members`` members and compute the requested upload sections.

    A failing ``optional_sections`` entry (asked for replays by other strategies) is left out
    of the upload with a warning; a failing required section fails the client.
    ``previous[m]`` is member m's model after this client's previous round (for the
    contrastive term of ``objective``)."""
    torch.set_num_threads(settings.client_threads)
    started = time.perf_counter()
    split = federated_split(settings)
    x, y = split.client_data(client_id)
    load_s = time.perf_counter() - started  # ~0 after this process's first client
    bundle = split.bundle
    spec = ModelSpec(default_model(settings, bundle.input_shape), bundle.input_shape,
                     bundle.num_classes, settings.parsed_model_kwargs())
    train_config = TrainConfig(settings.local_epochs, settings.lr, settings.momentum,
                               settings.batch_size)
    members: list[dict[str, NumpyDict]] = []
    train_s = 0.0
    optional = [s for s in optional_sections if s not in sections]
    section_s = dict.fromkeys([*sections, *optional], 0.0)
    failed: dict[str, str] = {}
    contrastive_members = 0
    probe, backend = spec.build(), settings.curvature_backend or DEFAULT_BACKEND
    if any(section.startswith(CURVATURE_PREFIX) and uses_laplace(
            probe, section.removeprefix(CURVATURE_PREFIX), backend) for section in section_s):
        # once per process, before the timed fits (else member 0's fit carries it)
        import_s = import_laplace()
        if import_s > 0:
            log.info("client %d: laplace-torch imported in %.1f s", client_id, import_s)
    models, seeds, member_terms = [], [], []
    with ExitStack() as stack:
        for m in range(settings.num_members):
            seeds.append(member_seed(settings, client_id, m, server_round))
            torch.manual_seed(seeds[-1])
            models.append(model := spec.build())
            if m < len(inits) and _same_shapes(inits[m], model.state_dict()):
                model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in inits[m].items()})
            member_terms.append(loss_terms(model, objective,
                                           previous[m] if m < len(previous) else None, stack))
        # all members in one computation where the model allows it (fedfusion.stacked)
        all_stats = train_members(models, x, y, train_config, seeds, member_terms)
    for m, (model, terms, stats) in enumerate(zip(models, member_terms, all_stats, strict=True)):
        contrastive_members += any(isinstance(t, ContrastiveTerm) for t in terms)
        extra = f" (+ {', '.join(type(t).__name__ for t in terms)})" if terms else ""
        member: dict[str, NumpyDict] = {}
        for section in [*sections, *optional]:
            if section in failed:
                continue
            start = time.perf_counter()
            try:
                member[section] = build_section(section, model, x, y, settings, member)
            except Exception as exc:
                if section in sections:
                    raise
                failed[section] = f"{type(exc).__name__}: {exc}"
                log.warning("client %d: optional section %s left out: %s", client_id, section,
                            failed[section])
            section_s[section] += time.perf_counter() - start
        members.append(member)
        train_s += stats.seconds
        log.info("client %d member %d/%d: %d samples, %.1f s (%.0f samples/s), loss %.3f%s",
                 client_id, m + 1, settings.num_members, len(y), stats.seconds,
                 stats.samples_per_s, stats.final_loss, extra)
    for member in members:  # every member carries the same sections
        for section in failed:
            member.pop(section, None)
    return ClientUpload(
        client_id=client_id,
        model=spec.name,
        model_kwargs=spec.kwargs,
        num_examples=len(y),
        members=members,
        metrics={
            "train-time-s": train_s,
            "stats-time-s": sum(section_s.values()),
            "load-time-s": load_s,
            "client-time-s": time.perf_counter() - started,
            **{f"time-s/{section}": t for section, t in section_s.items()},
            "class-histogram": [int(v) for v in split.histogram[client_id]],
            **({"contrastive-members": contrastive_members}
               if objective.contrastive_weight > 0 else {}),
        },
    )


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
        settings = client_settings(
            settings, client_for_partition(settings, int(node_config["partition-id"])))
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
    objective = LocalObjective.from_config(config)
    contrastive = objective.contrastive_weight > 0
    previous = []
    while contrastive and previous_key(len(previous)) in state:
        previous.append({k: v.numpy() for k, v in state[previous_key(len(previous))].items()})
    upload = run_client(settings, client_id, decode_models(content["arrays"]),
                        list(config.get("sections", [WEIGHTS])),
                        int(config.get("server-round", 1)),
                        list(config.get("optional-sections", [])), objective, previous)
    if contrastive:
        for m in range(upload.num_members):
            state[previous_key(m)] = ArrayRecord(
                {k: Array(np.ascontiguousarray(v)) for k, v in upload.weights(m).items()})
    return encode_upload(upload)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Flower entry point: one round of local training and the upload."""
    setup_logging()
    settings = settings_for_node(context.run_config, context.node_config)
    # largest client first (fedfusion.app.federation.client_for_partition)
    client_id = client_for_partition(settings, int(context.node_config["partition-id"]))
    return Message(content=handle_train(settings, client_id, msg.content, context.state),
                   reply_to=msg)
