"""The base every fedfusion strategy stands on.

A :class:`FusionStrategy` is a Flower Message-API strategy
(:class:`flwr.serverapp.strategy.Strategy`) whose round is: broadcast the current global
weights (M initial models in round 1) with the upload sections the strategy needs ->
decode and validate every reply into a :class:`~fedfusion.payload.ClientUpload` ->
:meth:`fuse` the valid uploads into a global predictor. A reply that fails validation is
excluded with its reason recorded in :attr:`exclusions`; the round goes on with the rest.

:meth:`fuse` sees only uploads, never messages, so cached uploads replay into any strategy
(:meth:`fuse_uploads`) with the same validation and the same result as a live run.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from torch import nn

from fedfusion.datasets import ImageData
from fedfusion.payload import (
    WEIGHTS,
    ClientUpload,
    ParamShapes,
    UploadError,
    decode_upload,
    encode_models,
    validate_upload,
)
from fedfusion.predictors import Ensemble, ModelSpec

log = logging.getLogger("fedfusion")


@dataclass
class FusionContext:
    """What the server knows besides the uploads."""

    model_spec: ModelSpec  # the architecture the server broadcast
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    val: ImageData | None = None  # server validation set for model selection (may be empty)
    seed: int = 0

    def spec_for(self, upload: ClientUpload) -> ModelSpec:
        return ModelSpec(upload.model, self.model_spec.input_shape, self.model_spec.num_classes,
                         upload.model_kwargs)

    def param_shapes(self, model: str, kwargs: dict[str, object]) -> ParamShapes:
        """Expected parameter shapes of ``model(**kwargs)`` on this server's data."""
        return _param_shapes(model, self.model_spec.input_shape, self.model_spec.num_classes,
                             json.dumps(kwargs, sort_keys=True))

    def member_models(self, upload: ClientUpload) -> list[nn.Module]:
        spec = self.spec_for(upload)
        return [spec.build(member[WEIGHTS]) for member in upload.members]


@functools.lru_cache(maxsize=64)
def _param_shapes(
    model: str, input_shape: tuple[int, ...], num_classes: int, kwargs_json: str
) -> ParamShapes:
    with torch.device("meta"):  # shapes only: no memory even for a large model
        net = ModelSpec(model, input_shape, num_classes, json.loads(kwargs_json)).build()
    return {name: tuple(t.shape) for name, t in net.state_dict().items()}


class FusionStrategy(Strategy, ABC):
    """Broadcast -> collect validated uploads -> fuse. Subclasses implement :meth:`fuse`."""

    name: ClassVar[str]
    #: sections every client must upload (the server asks for them in the train config)
    required_sections: tuple[str, ...] = (WEIGHTS,)
    #: True where fusing twice makes no sense (ensembles): the server refuses num-rounds > 1
    one_shot_only: ClassVar[bool] = True
    #: True where all clients must share the broadcast architecture
    same_architecture: ClassVar[bool] = True

    def __init__(self, context: FusionContext, num_clients: int, min_valid_uploads: int = 1):
        self.context = context
        self.num_clients = num_clients
        self.min_valid_uploads = min_valid_uploads
        #: sections asked of the clients beyond ``required_sections`` (kept for replays)
        self.extra_sections: tuple[str, ...] = ()
        #: entries added to every round's train config: the client-side objective
        #: (``prox-mu``, ``contrastive-weight``, ``contrastive-temperature``, read by the
        #: ClientApp, see :class:`fedfusion.client_app.LocalObjective`)
        self.client_config: dict[str, float] = {}
        self.uploads: list[ClientUpload] = []
        self.exclusions: list[dict[str, Any]] = []
        self.predictor: nn.Module | None = None
        #: called with the valid uploads before fusing, so they are kept even if fusion fails
        self.upload_sink: Callable[[list[ClientUpload]], None] | None = None
        self.fuse_seconds = 0.0
        #: wall seconds from sending the train messages to holding every reply, summed over
        #: rounds: the client phase as the server sees it (training, statistics, transfer)
        self.client_round_seconds = 0.0
        self._sent_at: float | None = None

    @classmethod
    def from_settings(cls, context: FusionContext, settings: Any) -> FusionStrategy:
        """Build from :class:`fedfusion.app.config.Settings`; strategies with knobs override."""
        return cls(context, num_clients=settings.num_clients)

    # ------------------------------------------------------------------ fusion
    @abstractmethod
    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        """Fuse valid uploads into a global predictor returning log-probabilities."""

    def fuse_uploads(self, uploads: Sequence[ClientUpload], server_round: int = 1) -> nn.Module:
        """Validate (excluding bad uploads, recorded) and fuse: the replay entry point."""
        valid = []
        for upload in uploads:
            try:
                validate_upload(upload, self.context.param_shapes, self.required_sections)
                self._check_architecture(upload)
            except UploadError as exc:
                self._exclude(server_round, exc.client, exc.problem)
                continue
            valid.append(upload)
        return self._fuse_valid(valid, server_round)

    def _fuse_valid(self, uploads: list[ClientUpload], server_round: int) -> nn.Module:
        if len(uploads) < self.min_valid_uploads:
            reasons = sorted({e["reason"][:300] for e in self.exclusions})
            raise RuntimeError(
                f"round {server_round}: {len(uploads)} valid upload(s), need at least "
                f"{self.min_valid_uploads}; {len(self.exclusions)} excluded, because: "
                + " | ".join(reasons)
            )
        uploads = sorted(uploads, key=lambda u: u.client_id)
        self.uploads = uploads
        if self.upload_sink is not None:
            self.upload_sink(uploads)
        log.info("[%s] fusing %d client upload(s)", self.name, len(uploads))
        start = time.perf_counter()
        self.predictor = self.fuse(uploads)
        self.fuse_seconds += time.perf_counter() - start
        return self.predictor

    def _check_architecture(self, upload: ClientUpload) -> None:
        spec = self.context.model_spec
        same = (upload.model, upload.model_kwargs) == (spec.name, spec.kwargs)
        if self.same_architecture and not same:
            raise UploadError(
                upload.client_id,
                f"model {upload.model}{upload.model_kwargs} differs from the server's "
                f"{spec.name}{spec.kwargs}; {self.name} needs one architecture",
            )

    def _exclude(self, server_round: int, client: str | int, reason: str) -> None:
        log.warning("[%s] round %d: excluding client %s: %s", self.name, server_round, client,
                    reason)
        self.exclusions.append({"round": server_round, "client": str(client), "reason": reason})

    def report(self) -> dict[str, Any]:
        """Strategy-specific diagnostics saved in results.json (e.g. optimisation traces)."""
        return {}

    # ------------------------------------------------------- Flower Message API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global arrays and the list of wanted upload sections to every client."""
        node_ids, _ = sample_nodes(grid, self.num_clients, self.num_clients)
        config["server-round"] = server_round
        config["sections"] = list(self.required_sections)
        for key, value in self.client_config.items():
            config[key] = value
        optional = [s for s in self.extra_sections if s not in self.required_sections]
        if optional:
            config["optional-sections"] = optional
        record = RecordDict({"arrays": arrays, "config": config})
        log.info("[%s] round %d: sending to %d client(s)", self.name, server_round, len(node_ids))
        self._sent_at = time.perf_counter()
        return [Message(content=record, dst_node_id=node, message_type=MessageType.TRAIN)
                for node in node_ids]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode + validate each reply (excluding bad ones), then fuse."""
        if self._sent_at is not None:
            self.client_round_seconds += time.perf_counter() - self._sent_at
            self._sent_at = None
        valid: list[ClientUpload] = []
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                self._exclude(server_round, f"node {node}", f"client error: {reply.error.reason}")
                continue
            try:
                upload = decode_upload(reply.content, f"node {node}", self.context.param_shapes,
                                       self.required_sections)
                self._check_architecture(upload)
            except UploadError as exc:
                self._exclude(server_round, exc.client, exc.problem)
                continue
            log.info("[%s] round %d: client %d: %d member(s), %d examples, %.2f MB", self.name,
                     server_round, upload.client_id, upload.num_members, upload.num_examples,
                     upload.nbytes / 1e6)
            valid.append(upload)
        predictor = self._fuse_valid(valid, server_round)
        metrics = MetricRecord({"num-valid-uploads": len(valid),
                                "num-examples": sum(u.num_examples for u in valid)})
        return self.broadcast_arrays(predictor), metrics

    def broadcast_arrays(self, predictor: nn.Module) -> ArrayRecord:
        """What the next round (if any) broadcasts: the predictor's member weights."""
        members = predictor.members if isinstance(predictor, Ensemble) else [predictor]
        return encode_models(
            [{k: v.detach().cpu().numpy() for k, v in m.state_dict().items()} for m in members]
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No federated evaluation: the server evaluates centrally on the test set."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info("\t├──> %s: %d clients, sections %s", self.name, self.num_clients,
                 list(self.required_sections))
