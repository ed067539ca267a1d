"""The base every fedfusion strategy stands on.

A :class:`FusionStrategy` is a Flower Message-API strategy
(:class:`flwr.serverapp.strategy.Strategy`) whose round is: broadcast the current global
weights (M initial models in round 1, made and seeded by the strategy) with the upload
sections the strategy needs -> decode and validate every reply into a
:class:`~fedfusion.wire.ClientUpload` -> :meth:`fuse` the valid uploads into a global
predictor. A reply that fails validation, a client error and a node that does not answer in
time are each excluded with the reason recorded in :attr:`exclusions`; the round goes on
with the rest.

:meth:`fuse` sees only uploads, never messages, so uploads made without Flower
(:func:`fedfusion.client.make_upload`) or cached on disk replay into any strategy
(:meth:`fuse_uploads`) with the same validation and the same result as a live run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import nn

from fedfusion.architecture import ModelFn, ModelSpec
from fedfusion.evaluation import Labelled, LabelledData, as_labelled, resolve_device
from fedfusion.normalization import NORM_STATS, recalibrate
from fedfusion.predictors import Ensemble
from fedfusion.state import state_arrays
from fedfusion.strategies.client_errors import infrastructure_error, parse_client_error
from fedfusion.strategies.identity import (
    SERVER,
    Assignment,
    NodeIdentities,
    check_client_registry,
    read_client_registry,
)
from fedfusion.strategies.sampling import round_generator, sample_nodes, wait_for_nodes
from fedfusion.strategies.screening import capped_reason, chance_check, screen_uploads
from fedfusion.wire import (
    WEIGHTS,
    ClientUpload,
    NumpyDict,
    ParamShapes,
    UploadError,
    decode_upload,
    encode_models,
    validate_upload,
)

log = logging.getLogger("fedfusion")

#: train-config keys the strategy sets (the client helpers read them)
SECTIONS_KEY, OPTIONAL_SECTIONS_KEY, ROUND_KEY = "sections", "optional-sections", "server-round"
MODEL_KEY, MODEL_KWARGS_KEY = "model", "model-kwargs"


@dataclass
class FusionContext:
    """What the server knows besides the uploads (built by the strategy's constructor)."""

    model_spec: ModelSpec  # the architecture the server broadcasts
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    val: Labelled | None = None  # server validation set for model selection (may be empty)
    seed: int = 0

    def spec_for(self, upload: ClientUpload) -> ModelSpec:
        return self.model_spec.variant(upload.model, upload.model_kwargs)

    def param_shapes(self, model: str, kwargs: dict[str, object]) -> ParamShapes:
        """Expected parameter shapes of architecture ``model(**kwargs)`` on this server."""
        return self.model_spec.variant(model, kwargs).param_shapes()

    def member_models(self, upload: ClientUpload) -> list[nn.Module]:
        spec = self.spec_for(upload)
        return [spec.build(member[WEIGHTS]) for member in upload.members]


#: numpy-style documentation of the arguments every strategy shares (appended to each
#: strategy's docstring, so ``help(FedBEns)`` lists them all)
COMMON_PARAMETERS = """
    model_fn : callable, nn.Module or ModelSpec
        The global architecture: ``model_fn() -> nn.Module`` (a fresh network), a template
        module (deep-copied), or a :class:`~fedfusion.architecture.ModelSpec` (the zoo).
    num_clients : int, optional
        Shorthand for ``min_available_nodes = min_train_nodes = num_clients``.
    num_members : int, default 1
        M, the initial models the strategy broadcasts in round 1 (seeded by ``seed``); each
        client trains one member from each (FedBEns' M).
    val : (x, y) tensors, DataLoader or an object with .x and .y, optional
        Server validation set, used for model selection where a strategy has a choice.
    device : str or torch.device, default "auto"
        Where the server fuses: "auto" = CUDA when present, else the CPU.
    seed : int, default 0
        Seeds the initial models and every random choice of the server.
    init_perturbation : float, default 0.0
        0: every member gets its own seeded init (FedBEns). s > 0: member m > 0 starts from
        member 0's init plus N(0, s^2) noise, a local ensemble around one init (the FedBEns
        paper's Table 7 clients with M = 3, s = 0.001).
    fraction_train : float, default 1.0
        As Flower's strategies: the fraction of available nodes sampled for training.
    min_train_nodes : int, default 2
        As Flower's strategies: the fewest nodes sampled for training.
    min_available_nodes : int, default 2
        As Flower's strategies: the nodes to wait for before a round starts.
    min_valid_uploads : int, default 1
        Fewer valid uploads than this after a round fails the run, with every exclusion
        listed; otherwise the server fuses what it has.
    round_timeout : float, default 3600.0
        Seconds to wait for the replies of a round; a node that does not reply in time is
        excluded with "no reply within N s".
    node_wait_timeout : float, default 600.0
        Seconds a round waits for ``min_available_nodes`` (and ``min_train_nodes``) nodes to
        connect before it sends anything; fewer by then raise
        :class:`~fedfusion.strategies.sampling.NodeWaitTimeout` naming how many connected
        of how many were required (``math.inf`` waits forever, as Flower's strategies do).
    extra_sections : sequence of str, default ()
        Upload sections asked of the clients beyond the strategy's own (e.g. ``["gram"]``),
        so one client run can be replayed into other strategies.
    member_fusion : {"first", "each", "all"}, optional
        Which client members to fuse: "first" = member 0 of each client (one model per
        client, the default of the single-model baselines); "each" = member m of all clients
        for every m, predicting with the ensemble of the M results (single-model strategies
        only); "all" = every member (the default of FedBEns and the ensembles).
    client_config : mapping, optional
        Entries added to every train config, read by the client's local objective
        (``prox-mu``, ``contrastive-weight``, ``contrastive-temperature``).
    norm_stats : {"auto", "average", "recalibrate", "client"}, default "auto"
        BatchNorm running statistics of the fused model(s) (:mod:`fedfusion.normalization`):
        the sample-weighted average of the clients', re-estimated on ``val``'s inputs, or
        each client's own where the predictor keeps client models. "auto": "client" for
        those predictors, else the strategy's measured default with ``val``, else "average".
    screen_factor : float, default 10.0
        Robust aggregation (:mod:`fedfusion.strategies.screening`): a client whose weights
        hold a layer with an L2 norm above ``screen_factor`` x the median over clients of
        that layer's norm is excluded, with the layer in the reason (needs >= 3 clients;
        honest clients measured at most 4.1x; 0 = off).
    num_examples_cap : float, default 3.0
        Robust aggregation: every strategy weights a client by at most ``num_examples_cap``
        x the median of the other clients' claimed example counts; capped claims are
        recorded (:attr:`capped_claims`) (honest partitions measured at most 2.4x; 0 = off).
    upload_sink : callable, optional
        Called with each round's valid uploads before they are fused, so they are kept even
        if fusion fails (e.g. ``fedfusion.upload_store.save_uploads`` to a folder).
    client_registry : mapping or path, optional
        Node id -> client id of an authenticated fleet (a mapping, or a JSON file
        ``{"<node id>": <client id>}``): a node's upload is fused under its registered id
        whatever it claims, a node not in it is excluded. Without it the server keeps its
        own registry: a node's claimed id is honoured only while no other node owns it; a
        colliding node is fused under a fresh server-assigned id, its claim kept as a
        label (:mod:`fedfusion.strategies.identity`).
"""


@dataclass
class FusionResult(Result):
    """Flower's :class:`~flwr.serverapp.strategy.Result` of a fedfusion run.

    ``arrays``: where the fusion is ONE model (FedAvg, FedFisher, RegMean, Fisher merging,
    OTFusion, DENSE, SWA, PFNM with one member), its plain ``state_dict`` as an ``ArrayRecord``
    (``model.load_state_dict(result.arrays.to_torch_state_dict())``, as any Flower code does);
    where it is several (FedBEns' modes, ``member_fusion="each"``, the ensemble, AMS), every
    model in fedfusion's ``"<m>/<param>"`` encoding (:func:`fedfusion.wire.decode_models`).
    ``predictor``: the fused predictor itself (log-probabilities, :mod:`fedfusion.predictors`),
    also :attr:`FusionStrategy.predictor`."""

    predictor: nn.Module | None = None


class FusionStrategy(Strategy, ABC):
    """Broadcast -> collect validated uploads -> fuse. Subclasses implement :meth:`fuse`.

    Parameters
    ----------
    """

    name: ClassVar[str]
    #: sections every client must upload (the server asks for them in the train config)
    required_sections: tuple[str, ...] = (WEIGHTS,)
    #: True where fusing twice makes no sense (ensembles): the App refuses num-rounds > 1
    one_shot_only: ClassVar[bool] = True
    #: True where all clients must share the broadcast architecture
    same_architecture: ClassVar[bool] = True
    #: the accepted ``member_fusion`` values, the default first
    member_fusions: ClassVar[tuple[str, ...]] = ("first", "each")
    #: True where the predictor keeps the client models whole (their own BatchNorm statistics)
    keeps_client_models: ClassVar[bool] = False
    #: the ``norm_stats`` rule "auto" picks when a validation set is given (benchmarks/
    #: real_models.py replays FedAvg and FedBEns under both rules)
    default_norm_stats: ClassVar[str] = "recalibrate"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and "Parameters\n    ----------" in cls.__doc__:
            cls.__doc__ = cls.__doc__.rstrip() + "\n" + COMMON_PARAMETERS

    def __init__(
        self,
        model_fn: ModelFn | nn.Module | ModelSpec,
        *,
        num_clients: int | None = None,
        num_members: int = 1,
        val: LabelledData | None = None,
        device: str | torch.device = "auto",
        seed: int = 0,
        init_perturbation: float = 0.0,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        min_valid_uploads: int = 1,
        round_timeout: float = 3600.0,
        node_wait_timeout: float = 600.0,
        extra_sections: Sequence[str] = (),
        member_fusion: str | None = None,
        client_config: Mapping[str, float] | None = None,
        norm_stats: str = "auto",
        screen_factor: float = 10.0,
        num_examples_cap: float = 3.0,
        upload_sink: Callable[[list[ClientUpload]], None] | None = None,
        client_registry: Mapping[int, int] | str | os.PathLike[str] | None = None,
    ):
        val_data = as_labelled(val, "val") if val is not None else None
        spec = ModelSpec.from_model_fn(model_fn)
        if val_data is not None and len(val_data) and spec.model_fn is not None:
            # a user's model_fn: what DENSE's generator and PFNM need, from the validation set
            spec.input_shape = spec.input_shape or tuple(val_data.x.shape[1:])
            spec.num_classes = spec.num_classes or int(val_data.y.max()) + 1
        self.context = FusionContext(spec, resolve_device(device), val_data, seed)
        if num_clients is not None:
            min_train_nodes = min_available_nodes = num_clients
        _check("num_members", num_members, num_members >= 1, ">= 1")
        _check("fraction_train", fraction_train, 0.0 < fraction_train <= 1.0, "in (0, 1]")
        _check("min_train_nodes", min_train_nodes, min_train_nodes >= 1, ">= 1")
        _check("min_available_nodes", min_available_nodes, min_available_nodes >= 1, ">= 1")
        _check("min_valid_uploads", min_valid_uploads, min_valid_uploads >= 1, ">= 1")
        _check("round_timeout", round_timeout, round_timeout > 0, "> 0 seconds")
        _check("node_wait_timeout", node_wait_timeout, node_wait_timeout > 0, "> 0 seconds")
        _check("init_perturbation", init_perturbation,
               math.isfinite(init_perturbation) and init_perturbation >= 0, "a number >= 0")
        self.init_perturbation = float(init_perturbation)
        _check("norm_stats", norm_stats, norm_stats in NORM_STATS, f"one of {NORM_STATS}")
        _check("norm_stats", norm_stats, (norm_stats == "client") <= self.keeps_client_models,
               f"'average' or 'recalibrate' for {type(self).__name__}, which fuses the client "
               "models ('client' keeps each client's statistics: ensemble and AMS only)")
        _check("norm_stats", norm_stats, norm_stats in ("auto", "client")
               or not self.keeps_client_models,
               f"'client' or 'auto' for {type(self).__name__}, whose predictor keeps every "
               "client model with its own statistics")
        #: the rule in force (``norm_stats`` with "auto" resolved)
        self.norm_stats = norm_stats if norm_stats != "auto" else (
            "client" if self.keeps_client_models else
            self.default_norm_stats if val_data is not None and len(val_data) else "average")
        #: which members of each upload are fused ("first", "each" or "all")
        self.member_fusion = member_fusion or self.member_fusions[0]
        _check("member_fusion", self.member_fusion, self.member_fusion in self.member_fusions,
               f"one of {self.member_fusions} for {type(self).__name__}")
        self.num_members, self.fraction_train = num_members, fraction_train
        self.min_train_nodes, self.min_available_nodes = min_train_nodes, min_available_nodes
        self.min_valid_uploads, self.round_timeout = min_valid_uploads, float(round_timeout)
        self.node_wait_timeout = float(node_wait_timeout)
        _check("screen_factor", screen_factor, math.isfinite(screen_factor)
               and (screen_factor == 0 or screen_factor >= 1), "0 (off) or a number >= 1")
        _check("num_examples_cap", num_examples_cap, math.isfinite(num_examples_cap)
               and (num_examples_cap == 0 or num_examples_cap >= 1), "0 (off) or a number >= 1")
        #: robust aggregation (:mod:`fedfusion.strategies.screening`): the norm-screen
        #: factor and the cap on claimed counts relative to the other clients (0 = off)
        self.screen_factor, self.num_examples_cap = float(screen_factor), float(num_examples_cap)
        #: every capped claim, with its round (claimed and capped counts, the others' median)
        self.capped_claims: list[dict[str, Any]] = []
        #: what screening could not do (e.g. fewer than 3 clients), with its round
        self.screen_notes: list[dict[str, Any]] = []
        #: the last fused predictor's validation accuracy against chance
        #: (:func:`~fedfusion.strategies.screening.chance_check`); None without ``val``
        self.chance: dict[str, Any] | None = None
        #: sections asked of the clients beyond ``required_sections`` (kept for replays)
        self.extra_sections = tuple(extra_sections)
        #: entries added to every round's train config: the client-side objective
        self.client_config: dict[str, float] = dict(client_config or {})
        self.uploads: list[ClientUpload] = []
        self.exclusions: list[dict[str, Any]] = []
        self.predictor: nn.Module | None = None
        #: called with the valid uploads before fusing, so they are kept even if fusion fails
        self.upload_sink = upload_sink
        self.fuse_seconds = 0.0
        #: BatchNorm layers whose statistics the last fusion re-estimated (``norm_stats``)
        self.recalibrated_layers = 0
        #: wall seconds from sending the train messages to holding every reply, summed over
        #: rounds: the client phase as the server sees it (training, statistics, transfer)
        self.client_round_seconds = 0.0
        self._sent_at: float | None = None
        self._sent_to: list[int] = []
        #: wall-clock time (time.time(), as Flower's message timestamps) of the last send
        self._sent_wall = 0.0
        #: the metadata of the messages last sent: Flower's grids write each message's id
        #: into it when they push it, and replies name that id (``reply_to_message_id``)
        self._sent_metadata: list[Metadata] = []
        if isinstance(client_registry, (str, os.PathLike)):
            client_registry = read_client_registry(client_registry)
        elif client_registry is not None:
            client_registry = check_client_registry(client_registry)
        #: the server-side registry node id -> client id (:mod:`fedfusion.strategies.
        #: identity`): kept across rounds; the operator's ``client_registry`` when given
        self.identities = NodeIdentities(client_registry)

    @property
    def num_clients(self) -> int:
        """The nodes a round waits for (``min_available_nodes``)."""
        return self.min_available_nodes

    # ------------------------------------------------------------------ fusion
    @abstractmethod
    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        """Fuse valid uploads into a global predictor returning log-probabilities."""

    def fuse_uploads(self, uploads: Sequence[ClientUpload], server_round: int = 1) -> nn.Module:
        """Validate (excluding bad uploads, recorded) and fuse uploads made without Flower
        (:func:`fedfusion.client.make_upload`) or cached ones: the replay entry point."""
        valid = []
        for upload in uploads:
            try:
                self._check_architecture(upload)
                validate_upload(upload, self.context.param_shapes, self.required_sections)
            except UploadError as exc:
                self.exclude(server_round, exc.client, exc.problem)
                continue
            valid.append(upload)
        return self._fuse_valid(self._unique_clients(valid, server_round), server_round)

    def _fuse_valid(self, uploads: list[ClientUpload], server_round: int) -> nn.Module:
        # robust aggregation, once for every strategy: outliers excluded, claimed counts
        # capped in the copies fused (``weighted``); the sink keeps every valid upload
        received = sorted(uploads, key=lambda u: u.client_id)
        uploads, weighted = self._screen(received, server_round)
        if len(uploads) < self.min_valid_uploads:
            reasons = "".join(f"\n  - client {e['client']}: {_summarise_reason(e['reason'])}"
                              for e in self.exclusions if e["round"] == server_round)
            raise RuntimeError(
                f"round {server_round}: {len(uploads)} valid upload(s), need at least "
                f"{self.min_valid_uploads} (min_valid_uploads); excluded:{reasons or ' none'}")
        self.uploads = uploads
        if self.upload_sink is not None:
            self.upload_sink(received)
        uploads = weighted
        if self.member_fusion == "first":
            uploads = [dataclasses.replace(u, members=u.members[:1]) for u in uploads]
        log.info("[%s] fusing %d client upload(s)", self.name, len(uploads))
        start = time.perf_counter()
        self.predictor = self.fuse(uploads)
        self.recalibrated_layers = self._apply_norm_stats(self.predictor)
        self.fuse_seconds += time.perf_counter() - start
        self._check_predictor(self.predictor)
        self._check_chance(self.predictor, server_round)
        return self.predictor

    def _screen(self, uploads: list[ClientUpload], server_round: int
                ) -> tuple[list[ClientUpload], list[ClientUpload]]:
        """:func:`~fedfusion.strategies.screening.screen_uploads` at this strategy's
        ``screen_factor`` and ``num_examples_cap``: outliers excluded (:meth:`exclude`),
        capped claims and what could not be screened recorded and logged. Returns the kept
        uploads as received and as fused (capped counts)."""
        result = screen_uploads(uploads, screen_factor=self.screen_factor,
                                num_examples_cap=self.num_examples_cap)
        for upload, reason in result.excluded:
            self.exclude(server_round, f"node {upload.node_id}" if upload.node_id is not None
                         else upload.client_id, reason)
        for note in result.notes:
            log.warning("[%s] round %d: %s", self.name, server_round, note)
            self.screen_notes.append({"round": server_round, "note": note})
        for record in result.capped:
            log.warning("[%s] round %d: %s", self.name, server_round, capped_reason(record))
            self.capped_claims.append({"round": server_round, **record})
        return result.kept, result.weighted

    def _check_chance(self, predictor: nn.Module, server_round: int) -> None:
        """Record (:attr:`chance`) and warn when the fused predictor is no better than
        chance on the validation data."""
        self.chance = chance_check(predictor, self.context.val, self.context.device)
        if self.chance is not None and self.chance["at_chance"]:
            log.warning("[%s] round %d: the fused model is at chance on the validation data: "
                        "accuracy %.3f, chance %.3f (+ margin %.3f)", self.name, server_round,
                        self.chance["accuracy"], self.chance["chance"], self.chance["margin"])

    def _apply_norm_stats(self, predictor: nn.Module) -> int:
        """The ``norm_stats`` rule on the fused models (the average is what :meth:`fuse`
        leaves): BatchNorm layers re-estimated on the validation inputs; returns how many."""
        val = self.context.val
        if self.norm_stats != "recalibrate" or val is None or not len(val):
            return 0
        models = predictor.members if isinstance(predictor, Ensemble) else [predictor]
        return sum(recalibrate(model, val.x) for model in models)

    def _check_predictor(self, predictor: nn.Module) -> None:
        """A predictor that outputs NaN or Inf on the validation inputs is an error, not a
        result (hostile but finite uploads can drive the fusion there)."""
        val = self.context.val
        if val is None or not len(val):
            return
        with torch.no_grad():
            out = predictor.to(self.context.device)(val.x[:256].to(self.context.device))
        if not torch.isfinite(out).all():
            raise FloatingPointError(
                f"[{self.name}] the fused predictor outputs NaN/Inf on the validation inputs; "
                f"clients fused: {[u.client_id for u in self.uploads]}")

    def _check_architecture(self, upload: ClientUpload) -> None:
        """Strategies with one architecture compare the declared one with the server's before
        anything is built from it."""
        spec = self.context.model_spec
        if self.same_architecture and not spec.same_architecture(upload.model,
                                                                  upload.model_kwargs):
            raise UploadError(
                upload.client_id,
                f"model {upload.model}{upload.model_kwargs} differs from the server's "
                f"{spec.name}{spec.kwargs}; {self.name} needs one architecture",
            )

    def _unique_clients(self, uploads: list[ClientUpload], server_round: int
                        ) -> list[ClientUpload]:
        """One upload per client id: a later upload of an id (in the order given) is
        excluded, so no client's upload can replace another's. Uploads made without Flower
        and replays rely on it; in a live round :meth:`_identify` has already given every
        node its own id, so nothing is excluded here."""
        owner: dict[int, ClientUpload] = {}
        for upload in uploads:
            first = owner.setdefault(upload.client_id, upload)
            if first is not upload:
                who = f"node {upload.node_id}" if upload.node_id is not None else "a duplicate"
                self.exclude(server_round, who,
                              f"claims client id {upload.client_id}, already uploaded by "
                              + (f"node {first.node_id}" if first.node_id is not None
                                 else "an earlier upload"))
        return list(owner.values())

    def exclude(self, server_round: int, client: str | int, reason: str,
                detail: str = "") -> None:
        """Record that ``client`` is left out of ``server_round`` (in :attr:`exclusions` and
        the log), e.g. a cached upload that did not load; ``detail`` (a client's traceback)
        is kept beside the one-line ``reason`` where given."""
        log.warning("[%s] round %d: excluding client %s: %s", self.name, server_round, client,
                    _summarise_reason(reason))
        entry: dict[str, Any] = {"round": server_round, "client": str(client), "reason": reason}
        if detail:
            entry["detail"] = detail
        self.exclusions.append(entry)

    def report(self) -> dict[str, Any]:
        """Strategy-specific diagnostics saved in results.json (e.g. optimisation traces)."""
        return {}

    # ------------------------------------------------------- Flower Message API
    def initial_models(self) -> list[NumpyDict]:
        """The M initial models the strategy broadcasts (FedBEns Algorithm 1, line 1), seeded
        by ``seed``: member m from ``torch.manual_seed(seed * 7919 + m)``, or with
        ``init_perturbation`` s > 0 member 0's init plus that seed's N(0, s^2) noise."""
        models: list[NumpyDict] = []
        # a module's constructor draws from the global RNG: seeded inside a forked state, so
        # the caller's RNG is left as it was
        with torch.random.fork_rng(devices=[]):
            for m in range(self.num_members):
                torch.manual_seed(self.context.seed * 7919 + m)
                if self.init_perturbation and m > 0:
                    models.append({k: (v + self.init_perturbation * torch.randn(
                        v.shape, dtype=torch.float64).numpy()).astype(v.dtype)
                        if v.dtype.kind == "f" else v.copy() for k, v in models[0].items()})
                    continue
                models.append(state_arrays(self.context.model_spec.build()))
        return models

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord | None = None,
        num_rounds: int = 1,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> FusionResult:
        """Flower's ``Strategy.start`` with fedfusion's defaults: one round, the strategy's
        own seeded initial models (:meth:`initial_models`) unless ``initial_arrays`` is given
        (fedfusion's ``"<m>/<param>"`` broadcast, or a plain ``ArrayRecord`` of one model's
        ``state_dict``), and ``round_timeout`` as the timeout. Returns a :class:`FusionResult`:
        a one-model fusion as a plain ``state_dict`` record, the predictor beside it."""
        if initial_arrays is None:
            initial_arrays = encode_models(self.initial_models())
        elif initial_arrays and not all("/" in key for key in initial_arrays):
            # a plain Flower ArrayRecord(model.state_dict()): one model, member 0
            initial_arrays = encode_models([{k: a.numpy() for k, a in initial_arrays.items()}])
        result = super().start(grid, initial_arrays, num_rounds,
                               timeout=self.round_timeout if timeout is None else timeout,
                               train_config=train_config, evaluate_config=evaluate_config,
                               evaluate_fn=evaluate_fn)
        arrays = result.arrays
        if isinstance(self.predictor, Ensemble) and len(self.predictor.members) == 1:
            arrays = ArrayRecord(self.predictor.members[0].state_dict())
        return FusionResult(arrays, result.train_metrics_clientapp,
                            result.evaluate_metrics_clientapp,
                            result.evaluate_metrics_serverapp, predictor=self.predictor)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global arrays, the wanted upload sections and the server's architecture
        to the sampled nodes: once ``min_available_nodes`` (at least ``min_train_nodes``)
        are connected, or :class:`~fedfusion.strategies.sampling.NodeWaitTimeout` after
        ``node_wait_timeout`` seconds; sampled by a generator seeded by ``seed`` and the
        round (:mod:`fedfusion.strategies.sampling`)."""
        required = max(self.min_available_nodes, self.min_train_nodes)
        available = wait_for_nodes(grid, required, self.node_wait_timeout,
                                   where=f"[{self.name}] round {server_round}")
        # an operator registry names the fleet: a node outside it is neither sampled nor
        # sent the model
        for node in sorted(n for n in available if not self.identities.admits(n)):
            self.exclude(server_round, f"node {node}", f"node {node} is not in the client "
                         "registry; not sent the round")
        available = [n for n in available if self.identities.admits(n)]
        sample_size = min(max(int(len(available) * self.fraction_train), self.min_train_nodes),
                          len(available))
        # none admitted: nothing is sent, and the round fails listing the exclusions
        node_ids = sample_nodes(available, sample_size, round_generator(
            self.context.seed, server_round)) if available else []
        spec = self.context.model_spec
        config[ROUND_KEY] = server_round
        config[SECTIONS_KEY] = list(self.required_sections)
        config[MODEL_KEY] = spec.name
        config[MODEL_KWARGS_KEY] = json.dumps(spec.kwargs, sort_keys=True)
        for key, value in self.client_config.items():
            config[key] = value
        optional = [s for s in self.extra_sections if s not in self.required_sections]
        if optional:
            config[OPTIONAL_SECTIONS_KEY] = optional
        record = RecordDict({"arrays": arrays, "config": config})
        log.info("[%s] round %d: sending to %d client(s)", self.name, server_round, len(node_ids))
        self._sent_at, self._sent_wall = time.perf_counter(), time.time()
        self._sent_to = list(node_ids)
        messages = [Message(content=record, dst_node_id=node, message_type=MessageType.TRAIN)
                    for node in node_ids]
        # the grid writes each message's id into this metadata as it pushes the message
        self._sent_metadata = [msg.metadata for msg in messages]
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode + validate each reply, decide each upload's client id from its node
        (:mod:`fedfusion.strategies.identity`), then fuse.

        Each reply is attributed to the node its message was sent to, matched by
        ``reply_to_message_id`` to the messages :meth:`configure_train` sent: Flower's own
        error replies (a node whose heartbeat stopped, an expired message) come from the
        SuperLink (``src_node_id`` 1), not from the node. Every sent node gives exactly one
        outcome: an upload, or one exclusion with its reason (a client error, a lost node,
        an expired message, an invalid upload, or no reply)."""
        round_seconds: float | None = None
        if self._sent_at is not None:
            round_seconds = time.perf_counter() - self._sent_at
            self.client_round_seconds += round_seconds
            self._sent_at = None
        sent = {md.message_id: md.dst_node_id for md in self._sent_metadata if md.message_id}
        valid: list[ClientUpload] = []
        replied: set[int] = set()
        for reply in replies:
            node = self._reply_node(reply, sent)
            if node is None:
                reason = (f"client error: {parse_client_error(reply.error.reason)}"
                          if reply.has_error() else "an upload")
                self.exclude(server_round, f"unknown node (reply from node "
                             f"{reply.metadata.src_node_id})", f"answers message "
                             f"{reply.metadata.reply_to_message_id!r}, which this round did "
                             f"not send; ignored ({_summarise_reason(reason, 200)})")
                continue
            if node in replied:
                self.exclude(server_round, f"node {node}", "a second reply to one message; "
                             "ignored (the first was kept)")
                continue
            replied.add(node)
            if reply.has_error():
                reason, detail = self._error_reason(reply, round_seconds)
                self.exclude(server_round, f"node {node}", reason, detail=detail)
                continue
            try:
                upload = decode_upload(reply.content, f"node {node}", self._declared_shapes,
                                       self.required_sections)
                self._check_architecture(upload)
            except UploadError as exc:
                self.exclude(server_round, exc.client, exc.problem)
                continue
            upload.node_id = node
            log.info("[%s] round %d: node %d (claims client %d): %d member(s), %d examples, "
                     "%.2f MB", self.name, server_round, node, upload.client_id,
                     upload.num_members, upload.num_examples, upload.nbytes / 1e6)
            valid.append(upload)
        for node in self._sent_to:
            if node not in replied:
                self.exclude(server_round, f"node {node}", self._silence_reason(round_seconds))
        valid = self._identify(valid, server_round)
        predictor = self._fuse_valid(self._unique_clients(valid, server_round), server_round)
        metrics = MetricRecord({"num-valid-uploads": len(self.uploads),
                                "num-examples": sum(u.num_examples for u in self.uploads)})
        return self.broadcast_arrays(predictor), metrics

    def _reply_node(self, reply: Message, sent: Mapping[str, int]) -> int | None:
        """The node a reply is from, as the server knows it: the destination of the message
        it answers (``reply_to_message_id``); else, for a grid that gives its messages no
        ids, its ``src_node_id`` when this round was sent there (or when nothing was sent
        through :meth:`configure_train`: replies handed to :meth:`aggregate_train` directly);
        else None (unattributable)."""
        node = sent.get(reply.metadata.reply_to_message_id)
        if node is not None:
            return node
        src = reply.metadata.src_node_id
        return src if src in self._sent_to or not self._sent_to else None

    def _error_reason(self, reply: Message, round_seconds: float | None) -> tuple[str, str]:
        """(reason, detail) of an error reply: what the SuperLink reports in a node's place
        (node lost, message or reply expired), timed from the send by the reply's own
        timestamp where it has one; else the ClientApp's exception (its traceback as the
        detail)."""
        seconds = round_seconds
        created = reply.metadata.created_at
        if self._sent_wall and created > self._sent_wall:
            # when the SuperLink declared it (the round may have gone on for other nodes)
            seconds = created - self._sent_wall
            if round_seconds is not None:
                seconds = min(seconds, round_seconds)
        reason = infrastructure_error(reply.error.code, seconds)
        if reason is not None:
            return reason, reply.error.reason or ""
        # under Ray the reason is a wrapped traceback: name the ClientApp's exception
        error = parse_client_error(reply.error.reason)
        return f"client error: {error}", error.traceback

    def _silence_reason(self, round_seconds: float | None) -> str:
        """Why a node that sent nothing back is excluded: the round timeout, or (a grid
        that returned before it) how long the grid waited."""
        if round_seconds is None or round_seconds >= 0.99 * self.round_timeout:
            return f"no reply within {self.round_timeout:g} s"
        return (f"no reply: the grid returned after {round_seconds:.0f} s, before the "
                f"{self.round_timeout:g} s round timeout, without a reply or an error for "
                "this node")

    def _identify(self, uploads: list[ClientUpload], server_round: int) -> list[ClientUpload]:
        """Give each live upload the client id the server decides from its node
        (:attr:`identities`): the claim becomes the label ``claimed_client_id``; a node the
        operator's registry lacks is excluded; a colliding claim is fused under a fresh
        server-assigned id, with a warning, never in another node's place."""
        decided = self.identities.assign([(u.node_id, u.client_id) for u in uploads
                                          if u.node_id is not None])
        kept = []
        for upload in sorted(uploads, key=lambda u: (u.node_id is None, u.node_id or 0)):
            outcome = decided.get(upload.node_id) if upload.node_id is not None else None
            if isinstance(outcome, str):
                self.exclude(server_round, f"node {upload.node_id}", outcome)
                continue
            if isinstance(outcome, Assignment):
                upload.claimed_client_id = upload.client_id
                upload.client_id, upload.client_id_source = outcome.client_id, outcome.source
                if outcome.note:
                    log.log(logging.WARNING if outcome.source == SERVER else logging.INFO,
                            "[%s] round %d: node %d %s", self.name, server_round,
                            upload.node_id, outcome.note)
            kept.append(upload)
        return kept

    def _declared_shapes(self, model: str, kwargs: dict[str, object]) -> ParamShapes:
        """Shapes of a client's declared architecture, refused before anything is built when
        this strategy needs the server's own."""
        if self.same_architecture and not self.context.model_spec.same_architecture(model,
                                                                                  kwargs):
            spec = self.context.model_spec
            raise ValueError(f"model {model}{kwargs} differs from the server's "
                             f"{spec.name}{spec.kwargs}; {self.name} needs one architecture")
        return self.context.param_shapes(model, kwargs)

    def broadcast_arrays(self, predictor: nn.Module) -> ArrayRecord:
        """What the next round (if any) broadcasts: the predictor's member weights."""
        members = predictor.members if isinstance(predictor, Ensemble) else [predictor]
        return encode_models([state_arrays(m) for m in members])

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
        log.info("\t├──> %s: %d client(s), %d member(s), sections %s", self.name,
                 self.num_clients, self.num_members,
                 [*self.required_sections, *self.extra_sections])


FusionStrategy.__doc__ = (FusionStrategy.__doc__ or "").rstrip() + "\n" + COMMON_PARAMETERS


def _check(name: str, value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _summarise_reason(reason: str, limit: int = 400) -> str:
    """A long reason (e.g. a Ray-wrapped client traceback) cut to its first line and its root
    cause, the last ``SomethingError: ...`` line, instead of its first ``limit`` characters."""
    if len(reason) <= limit:
        return reason
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b", line)]
    cause = causes[-1] if causes else lines[-1]
    return f"{lines[0][:150]} ... {cause[:limit]}"
