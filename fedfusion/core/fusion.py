"""The fusion core every fedfusion strategy stands on, without Flower.

A :class:`Fusion` turns client uploads (:class:`~fedfusion.wire.ClientUpload`) into a global
predictor: validate each upload against the server's architecture, keep one upload per
client id, screen the rest (:mod:`fedfusion.core.screening`: weight norms and the
curvature/Gram traces of the sections the strategy fuses against the clients' median, every
member against chance on the validation data, claimed example counts capped),
:meth:`~Fusion.fuse` them
(the one method a strategy implements), apply the normalisation-statistics rule
(:mod:`fedfusion.core.normalization`), and check the predictor (finite, above chance: the one
place every strategy's result is checked and, at chance, warned about). Before any of that,
the constructor checks the model itself (:mod:`fedfusion.core.model_check`: a dry forward and the
strategy's requirements), so a model the strategy cannot fuse is refused before any client
trains. Uploads
made without Flower (:func:`fedfusion.client.make_upload`) or cached on disk go through
:meth:`~Fusion.fuse_uploads`; :class:`~fedfusion.flower.strategy.FusionStrategy` adds
Flower's Message API (broadcast, replies, node identity) on top of the same path.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from fedfusion.constraints import (
    AT_LEAST_ONE,
    FINITE_NON_NEGATIVE,
    OFF_OR_AT_LEAST_ONE,
    SEED,
    Constraint,
    is_integer,
)
from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.diagnostics import client_table, client_timing, run_cost
from fedfusion.core.evaluation import (
    Labelled,
    LabelledData,
    as_labelled,
    predict_log_probs,
)
from fedfusion.core.model_check import REQUIREMENTS, Requirement, check_model
from fedfusion.core.normalization import NORM_STATS, recalibrate, running_stat_layers
from fedfusion.core.predictors import Ensemble
from fedfusion.core.screening import capped_reason, chance_check, screen_uploads
from fedfusion.core.state import state_arrays
from fedfusion.device import present_device
from fedfusion.distillation import DistillOptions, distil, pick_start
from fedfusion.grad_mode import gradients_on
from fedfusion.sections import SECTIONS, SectionTable
from fedfusion.seeding import seeded, stream_seed
from fedfusion.wire import (
    DEFAULT_LIMITS,
    MAX_MEMBERS,
    WEIGHTS,
    ClientUpload,
    NumpyDict,
    ParamShapes,
    UploadError,
    UploadLimits,
    validate_upload,
)

#: M, the members a client trains and uploads: at most what an upload may carry
MEMBERS = Constraint(f"an integer in 1..{MAX_MEMBERS} (the members an upload may carry)",
                     lambda v: is_integer(v) and 1 <= v <= MAX_MEMBERS)

log = logging.getLogger("fedfusion")


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


#: numpy-style documentation of the arguments of the fusion core (appended, with
#: :data:`fedfusion.flower.strategy.FLOWER_PARAMETERS`, to each strategy's docstring, so
#: ``help(FedBEns)`` lists them all)
FUSION_PARAMETERS = """
    model_fn : callable, nn.Module or ModelSpec
        The global architecture: ``model_fn() -> nn.Module`` (a fresh network), a template
        module (deep-copied), or a :class:`~fedfusion.core.architecture.ModelSpec` (the zoo).
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
    min_valid_uploads : int, default 1
        Fewer valid uploads than this after a round fails the run, with every exclusion
        listed; otherwise the server fuses what it has.
    member_fusion : {"first", "each", "all"}, optional
        Which client members to fuse: "first" = member 0 of each client (one model per
        client, the default of the single-model baselines); "each" = member m of all clients
        for every m, predicting with the ensemble of the M results (single-model strategies
        only); "all" = every member (the default of FedBEns and the ensembles).
    norm_stats : {"auto", "average", "recalibrate", "client"}, default "auto"
        BatchNorm running statistics of the fused model(s) (:mod:`fedfusion.core.normalization`):
        the sample-weighted average of the clients', re-estimated on ``val``'s inputs, or
        each client's own where the predictor keeps client models. "auto": "client" for
        those predictors, else the strategy's measured default with ``val``, else "average".
    screen_factor : float, default 10.0
        Robust aggregation (:mod:`fedfusion.core.screening`): a client whose weights
        hold a layer with an L2 norm above ``screen_factor`` x the median over clients of
        that layer's norm is excluded, with the layer in the reason (needs >= 3 clients;
        honest clients measured at most 4.1x; 0 = off).
    curvature_screen_factor : float, default 1000.0
        Robust aggregation: a client whose curvature or Gram section (those the strategy
        fuses: FedBEns, FedFisher, Fisher merging, RegMean) holds a layer whose trace per
        example (of its capped count) is above ``curvature_screen_factor`` x the median over
        clients is excluded, with the section and layer in the reason (needs >= 3 clients;
        honest clients measured at most 53x (the digits example with BatchNorm, about 300
        rows per client); sections at the caps are about 1e17x; 0 = off).
    val_screen : bool, default True
        Robust aggregation: with ``val``, every member of every upload predicts the
        validation rows, and a client with a member whose accuracy is below what its own
        predicted-class rates would score by chance (by 3 standard errors, at least 0.02) is
        excluded before fusion, with the member and both accuracies in the reason (direction
        attacks: a negated or permuted last layer).
    num_examples_cap : float, default 3.0
        Robust aggregation: every strategy weights a client by at most ``num_examples_cap``
        x the median of the other clients' claimed example counts; capped claims are
        recorded (:attr:`capped_claims`) (honest partitions measured at most 2.4x; 0 = off).
    upload_sink : callable, optional
        Called with each round's valid uploads before they are fused, so they are kept even
        if fusion fails (e.g. a ``fedfusion.upload_store.UploadWriter`` of a folder). A
        sink with a ``write(upload)`` method (the ``UploadWriter``) is also given each valid
        upload as its reply arrives.
    upload_limits : fedfusion.wire.UploadLimits, default UploadLimits()
        The caps on one client's upload (bytes, counts, name lengths), applied to every
        reply before it is decoded and to every upload fused; an upload over one is excluded
        with the client named.
    section_table : mapping, default fedfusion.sections.SECTIONS
        The upload sections this server accepts, each with its validator and value cap; a
        strategy that asks for a section of a user's own passes a table that holds it.
    distill : {"none", "val", "synthetic"}, default "none"
        One network out of the fused predictor (:mod:`fedfusion.distillation`): "val"
        distils it (the teacher, kept as :attr:`distill_teacher`) into one network of the broadcast
        architecture on ``val``'s inputs (augmented; labels only pick the best iterate),
        "synthetic" on DENSE's generator's images; the student starts from the
        best-validated of the FedAvg of the clients' first members and the teacher's
        networks of the broadcast architecture, else a seeded init.
        Integer inputs (token ids): "val" without augmentation; "synthetic" is refused
        (it generates float images).
    distill_epochs : int, default 30
        Distillation epochs (passes over ``val``'s inputs); 0 returns the student's start.
    distill_lr : float, default 0.001
        Adam learning rate of the student.
    distill_temperature : float, default 1.0
        T of the loss T^2 KL(softmax(log p_teacher / T) || softmax(student / T)).
    distill_augment : bool, default True
        "val": random shifts of images and mixup of half of each batch (off: the plain
        validation inputs; always off for integer or bool inputs).
"""


class Fusion(ABC):
    """Validate -> screen -> fuse client uploads. Subclasses implement :meth:`fuse`.

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
    #: the ``norm_stats`` rule "auto" picks: for a fused model with a validation set
    #: (benchmarks/real_models.py replays FedAvg and FedBEns under both rules), "client"
    #: where the predictor keeps the client models (whatever the validation set)
    default_norm_stats: ClassVar[str] = "recalibrate"
    #: what a model must satisfy to be fused by this strategy, by name
    #: (:data:`fedfusion.core.model_check.REQUIREMENTS`), checked before anything trains
    model_requirements: ClassVar[tuple[str, ...]] = ()
    #: the functions of this strategy's own requirements, beside
    #: :data:`fedfusion.core.model_check.REQUIREMENTS`
    requirement_checks: ClassVar[Mapping[str, Requirement]] = {}

    #: True where :meth:`fuse` applies the ``norm_stats`` rule itself (RegMean scores each
    #: candidate with the statistics it will keep) and sets :attr:`recalibrated_layers`
    applies_norm_stats: ClassVar[bool] = False
    #: False where the predictor is finished later than :meth:`fuse` (FENS' aggregator
    #: rounds), which then distils it itself
    distils_after_fuse: ClassVar[bool] = True
    #: the argument documentation appended to a subclass's ``Parameters`` section
    parameters_doc: ClassVar[str] = FUSION_PARAMETERS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and "Parameters\n    ----------" in cls.__doc__:
            cls.__doc__ = cls.__doc__.rstrip() + "\n" + cls.parameters_doc
        if cls.keeps_client_models != (cls.default_norm_stats == "client"):
            raise TypeError(f"{cls.__name__}: default_norm_stats must be 'client' exactly where "
                            "the predictor keeps the client models (keeps_client_models)")
        if "report" in cls.__dict__:  # every strategy's report says what all of them share
            cls.report = _with_shared_report(cls.__dict__["report"])  # type: ignore[method-assign]

    def __init__(
        self,
        model_fn: ModelFn | nn.Module | ModelSpec,
        *,
        num_members: int = 1,
        val: LabelledData | None = None,
        device: str | torch.device = "auto",
        seed: int = 0,
        init_perturbation: float = 0.0,
        min_valid_uploads: int = 1,
        member_fusion: str | None = None,
        norm_stats: str = "auto",
        screen_factor: float = 10.0,
        curvature_screen_factor: float = 1000.0,
        val_screen: bool = True,
        num_examples_cap: float = 3.0,
        upload_sink: Callable[[list[ClientUpload]], None] | None = None,
        upload_limits: UploadLimits = DEFAULT_LIMITS,
        section_table: SectionTable = SECTIONS,
        distill: str = "none",
        distill_epochs: int = 30,
        distill_lr: float = 1e-3,
        distill_temperature: float = 1.0,
        distill_augment: bool = True,
    ):
        val_data = as_labelled(val, "val") if val is not None else None
        spec = ModelSpec.from_model_fn(model_fn)
        if val_data is not None and len(val_data) and spec.model_fn is not None:
            # a user's model_fn: what DENSE's generator and PFNM need, from the validation set
            spec.input_shape = spec.input_shape or tuple(val_data.x.shape[1:])
        SEED.check("seed", seed)
        self.context = FusionContext(spec, present_device(device, self.name), val_data,
                                     int(seed))
        MEMBERS.check("num_members", num_members)
        AT_LEAST_ONE.check("min_valid_uploads", min_valid_uploads)
        FINITE_NON_NEGATIVE.check("init_perturbation", init_perturbation)
        self.init_perturbation = float(init_perturbation)
        expect("norm_stats", norm_stats, norm_stats in NORM_STATS, f"one of {NORM_STATS}")
        expect("norm_stats", norm_stats, (norm_stats == "client") <= self.keeps_client_models,
               f"'average' or 'recalibrate' for {type(self).__name__}, which fuses the client "
               "models ('client' keeps each client's statistics: ensemble and AMS only)")
        expect("norm_stats", norm_stats, norm_stats in ("auto", "client")
               or not self.keeps_client_models,
               f"'client' or 'auto' for {type(self).__name__}, whose predictor keeps every "
               "client model with its own statistics")
        has_val = val_data is not None and len(val_data) > 0
        self.norm_stats_requested = norm_stats
        #: the rule in force (``norm_stats`` with "auto" resolved), and why it is
        self.norm_stats = norm_stats if norm_stats != "auto" else (
            self.default_norm_stats if has_val or self.keeps_client_models else "average")
        self.norm_stats_reason = (
            "as requested (norm_stats)" if norm_stats != "auto" else
            "auto: the predictor keeps every client model with its own statistics"
            if self.keeps_client_models else
            f"auto: {self.name}'s default with a validation set to re-estimate them on"
            if has_val else "auto: no validation set to re-estimate them on")
        #: which members of each upload are fused ("first", "each" or "all")
        self.member_fusion = member_fusion or self.member_fusions[0]
        expect("member_fusion", self.member_fusion, self.member_fusion in self.member_fusions,
               f"one of {self.member_fusions} for {type(self).__name__}")
        self.num_members, self.min_valid_uploads = num_members, min_valid_uploads
        OFF_OR_AT_LEAST_ONE.check("screen_factor", screen_factor)
        OFF_OR_AT_LEAST_ONE.check("curvature_screen_factor", curvature_screen_factor)
        expect("val_screen", val_screen, isinstance(val_screen, bool), "True or False")
        #: the curvature/Gram screen's factor (0 = off) and whether the validation screen runs
        self.curvature_screen_factor = float(curvature_screen_factor)
        self.val_screen = val_screen
        OFF_OR_AT_LEAST_ONE.check("num_examples_cap", num_examples_cap)
        #: robust aggregation (:mod:`fedfusion.core.screening`): the norm-screen
        #: factor and the cap on claimed counts relative to the other clients (0 = off)
        self.screen_factor, self.num_examples_cap = float(screen_factor), float(num_examples_cap)
        #: every capped claim, with its round (claimed and capped counts, the others' median)
        self.capped_claims: list[dict[str, Any]] = []
        #: what screening could not do (e.g. fewer than 3 clients), with its round
        self.screen_notes: list[dict[str, Any]] = []
        #: the last fused predictor's validation accuracy against chance
        #: (:func:`~fedfusion.core.screening.chance_check`); None without ``val``
        self.chance: dict[str, Any] | None = None
        self.uploads: list[ClientUpload] = []
        self.exclusions: list[dict[str, Any]] = []
        self.predictor: nn.Module | None = None
        #: called with the valid uploads before fusing, so they are kept even if fusion fails
        self.upload_sink = upload_sink
        expect("upload_limits", upload_limits, isinstance(upload_limits, UploadLimits),
               "a fedfusion.wire.UploadLimits")
        #: the caps on one client's upload (decoding and validation)
        self.upload_limits = upload_limits
        #: the sections an upload may hold, with their validators and value caps
        self.section_table = section_table
        self.fuse_seconds = 0.0
        #: BatchNorm layers whose statistics the last fusion re-estimated (``norm_stats``)
        self.recalibrated_layers = 0
        #: distillation of the fused predictor into one network (:mod:`fedfusion.distillation`)
        self.distill_options = DistillOptions(distill, distill_epochs, distill_lr,
                                              distill_temperature, augment=distill_augment,
                                              seed=seed)
        self.distill_options.check()
        expect("distill", distill, distill != "val" or (val_data is not None and len(val_data)),
               "'none' or 'synthetic' without a validation set ('val' distils on its inputs: "
               "pass val=...)")
        #: what a model must satisfy for this strategy (:mod:`fedfusion.core.model_check`): the
        #: class's requirements and its options'; sent to the clients with every round
        self.requirements: tuple[str, ...] = (
            *self.model_requirements, *(("synthetic-distill",) if distill == "synthetic" else ()))
        # refused here, before any client trains: a dry forward (the validation inputs, else
        # zeros of the spec's input shape) and the requirements, on a fresh network
        network = spec.build()
        #: what the model check ran on (rows, dtype, output shape, requirements)
        self.model_check = check_model(
            network, self.requirements, x=val_data.x if has_val else None,
            input_shape=spec.input_shape, num_classes=spec.num_classes, name=spec.name,
            strategy=self.name, checks={**REQUIREMENTS, **self.requirement_checks})
        if not spec.num_classes and self.model_check["output_shape"]:
            # a user's model_fn: its scores per input, not the validation labels (which may
            # lack the last class), say how many classes there are
            spec.num_classes = int(self.model_check["output_shape"][1])
        if has_val and spec.num_classes and len(val_data.y):
            labels = (int(val_data.y.min()), int(val_data.y.max()))
            if labels[0] < 0 or labels[1] >= spec.num_classes:
                raise ValueError(
                    f"{self.name}: the validation labels run from {labels[0]} to {labels[1]}, "
                    f"but model {spec.name!r} has {spec.num_classes} classes (0..."
                    f"{spec.num_classes - 1}): give the model at least {labels[1] + 1} outputs, "
                    "or relabel the data as 0..K-1")
        if {"float-inputs", "synthetic-distill"} & set(self.requirements) and not (
                spec.input_shape and spec.num_classes):
            raise ValueError(
                f"{self.name} generates its inputs, so it needs the model's input shape and "
                "number of classes: pass val=(x, y), or a ModelSpec that names them "
                "(ModelSpec.from_model_fn(model_fn, input_shape=..., num_classes=...))")
        #: BatchNorm layers with running statistics in the server's network: what
        #: ``norm_stats`` acts on (0: the rule changes nothing)
        self.running_stat_layers = len(running_stat_layers(network))
        log.info("[%s] BatchNorm statistics of the fused model(s): %r (%s); %d layer(s) with "
                 "running statistics", self.name, self.norm_stats, self.norm_stats_reason,
                 self.running_stat_layers)
        #: the fused predictor before distillation (None without ``distill``)
        self.distill_teacher: nn.Module | None = None
        #: the last distillation's report (teacher's and student's validation metrics, trace)
        self.distill_report: dict[str, Any] = {}

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
                self.check_upload(upload)
                validate_upload(upload, self.context.param_shapes, self.required_sections,
                                limits=self.upload_limits, table=self.section_table)
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
        if self.upload_sink is not None and received:  # kept even when the round fails
            self.upload_sink(received)
        if len(uploads) < self.min_valid_uploads:
            reasons = "".join(f"\n  - client {e['client']}: {summarise_reason(e['reason'])}"
                              for e in self.exclusions if e["round"] == server_round)
            raise RuntimeError(
                f"round {server_round}: {len(uploads)} valid upload(s), need at least "
                f"{self.min_valid_uploads} (min_valid_uploads); excluded:{reasons or ' none'}")
        self.uploads = uploads
        uploads = weighted
        if self.member_fusion == "first":
            uploads = [dataclasses.replace(u, members=u.members[:1]) for u in uploads]
        log.info("[%s] fusing %d client upload(s)", self.name, len(uploads))
        start = time.perf_counter()
        # the server's optimisations, whatever the caller's grad mode; any draw from torch's
        # global generator (a dropout layer in a distilled student) from the run's seed and
        # the round (not the stream the student's init is drawn from)
        with gradients_on(), seeded(stream_seed(self.context.seed, server_round, 0xF05E),
                                    self.context.device):
            self.predictor = self.fuse(uploads)
            if not self.applies_norm_stats:
                self.recalibrated_layers = self._apply_norm_stats(self.predictor)
            if self.distill_options.mode != "none" and self.distils_after_fuse:
                self.distill_teacher, self.predictor = self.predictor, self._distil(
                    self.predictor, uploads)
        self.fuse_seconds += time.perf_counter() - start
        self._check_predictor(self.predictor)
        self._check_chance(self.predictor, server_round)
        return self.predictor

    def _distil(self, teacher: nn.Module, uploads: Sequence[ClientUpload]) -> nn.Module:
        """``teacher`` distilled into one network of the broadcast architecture
        (:func:`fedfusion.distillation.distil`); the report in :attr:`distill_report`.

        The student starts from the best-validated of (:func:`~fedfusion.distillation.pick_start`):
        the sample-weighted FedAvg of the clients' first members on that architecture, and
        each network of an ensemble teacher on it (FedBEns' modes, the members), copied; a
        fresh init seeded by ``seed`` when there is none of them."""
        from fedfusion.core.state import weighted_average

        spec = self.context.model_spec
        same = [u for u in uploads if spec.same_architecture(u.model, u.model_kwargs)]
        candidates: list[tuple[str, nn.Module]] = []
        with seeded(self.context.seed):
            if same:
                candidates.append(("fedavg", spec.build(weighted_average(
                    [u.weights(0) for u in same], [u.num_examples for u in same]))))
            if isinstance(teacher, Ensemble):  # scored in place; only the pick is copied
                candidates += [(f"teacher network {i}", network)
                               for i, (network, network_spec) in enumerate(
                                   zip(teacher.members, teacher.specs, strict=True))
                               if spec.same_architecture(network_spec.name,
                                                         network_spec.kwargs)]
            if not candidates:
                candidates.append(("random", spec.build(None)))
        init, start, scores = pick_start(candidates, self.context.val, self.context.device)
        student = spec.build(state_arrays(start))  # a copy: the teacher's networks stay as they are
        result = distil(teacher, student, self.context.val, self.distill_options,
                        self.context.device, spec.input_shape)
        self.distill_report = {"student_init": init, "student_init_val": scores,
                               **result.report}
        return Ensemble([result.student], [spec])

    def _screen(self, uploads: list[ClientUpload], server_round: int
                ) -> tuple[list[ClientUpload], list[ClientUpload]]:
        """:func:`~fedfusion.core.screening.screen_uploads` at this strategy's
        ``screen_factor``, ``curvature_screen_factor`` (over its required sections),
        ``val_screen`` and ``num_examples_cap``: outliers excluded (:meth:`exclude`), capped
        claims and what could not be screened recorded and logged. Returns the kept uploads
        as received and as fused (capped counts)."""
        val = self.context.val
        on_val = self.val_screen and val is not None and len(val) > 0
        result = screen_uploads(
            uploads, screen_factor=self.screen_factor, num_examples_cap=self.num_examples_cap,
            curvature_screen_factor=self.curvature_screen_factor,
            sections=self.required_sections,
            predict=self._member_predictions if on_val else None,
            val_labels=val.y if on_val else None,
            num_classes=max(self.context.model_spec.num_classes or 0,
                            int(val.y.max()) + 1) if on_val else 0)
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

    def _member_predictions(self, upload: ClientUpload) -> list[torch.Tensor]:
        """The class each member of ``upload`` predicts for every validation row (the
        validation screen's input), on the server's device."""
        val = self.context.val
        assert val is not None
        return [predict_log_probs(model, val.x, self.context.device).argmax(dim=1)
                for model in self.context.member_models(upload)]

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

    def check_upload(self, upload: ClientUpload) -> None:
        """What this strategy needs of one upload beyond :func:`~fedfusion.wire.
        validate_upload`, checked as it arrives (an :class:`~fedfusion.wire.UploadError`
        excludes that client alone): here, for strategies with one architecture, the declared
        one against the server's, before anything is built from it."""
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
                detail: str = "", node: int | None = None) -> None:
        """Record that ``client`` is left out of ``server_round`` (in :attr:`exclusions` and
        the log), e.g. a cached upload that did not load; ``detail`` (a client's traceback)
        is kept beside the one-line ``reason`` where given. ``node``: the Flower node id, for
        an operator to find the device: the entry gets ``node_id``, and ``client_id`` where
        the server knows which client that node is (:meth:`client_of_node`)."""
        known = None if node is None else self.client_of_node(node)
        if node is not None:
            client = f"node {node}" + (f" (client {known})" if known is not None else "")
        log.warning("[%s] round %d: excluding client %s: %s", self.name, server_round, client,
                    summarise_reason(reason))
        entry: dict[str, Any] = {"round": server_round, "client": str(client), "reason": reason}
        if node is not None:
            entry.update(node_id=node, client_id=known)
        if detail:
            entry["detail"] = detail
        self.exclusions.append(entry)

    def client_of_node(self, node: int) -> int | None:
        """The client id of Flower node ``node`` where known (a node registry), else None."""
        return None

    def report(self) -> dict[str, Any]:
        """Strategy-specific diagnostics saved in results.json (e.g. optimisation traces).

        A subclass's ``report`` is wrapped (``__init_subclass__``) so that every report also
        holds what all strategies share (:meth:`shared_report`)."""
        return self.shared_report()

    def shared_report(self) -> dict[str, Any]:
        """``norm_stats``: the normalisation-statistics rule in force (``rule``), what was
        asked (``requested``), why (``reason``), the layers it acts on
        (``running_stat_layers``) and those the last fusion re-estimated
        (``recalibrated_layers``); ``model_check``: what :mod:`fedfusion.core.model_check` ran on
        when the strategy was built."""
        return {"norm_stats": {"rule": self.norm_stats, "requested": self.norm_stats_requested,
                               "reason": self.norm_stats_reason,
                               "running_stat_layers": self.running_stat_layers,
                               "recalibrated_layers": self.recalibrated_layers},
                "model_check": self.model_check}

    def diagnostics(self, num_rounds: int = 1) -> dict[str, Any]:
        """What this strategy's last fusion reports, as plain data under the keys of
        results.json (docs/results-format.md): ``num_members`` and ``clients`` (a row per
        fused upload), ``excluded``, ``strategy_report`` (:meth:`report`), ``cost`` over
        ``num_rounds`` rounds, ``capped_claims``, ``screening``, ``chance``, ``at_chance``,
        ``norm_stats`` and ``timing`` (the clients' training and statistics seconds, the
        server's fusion seconds)."""
        report = self.report()
        clients = client_table(self.uploads, self.capped_claims)
        predictor = self.predictor
        model_bytes = sum(a.nbytes for a in state_arrays(self.context.model_spec.build()).values())
        return {
            "num_members": [u.num_members for u in self.uploads],
            "clients": clients,
            "excluded": list(self.exclusions),
            "strategy_report": report,
            "cost": run_cost(
                self.uploads, self.required_sections, self.member_fusion != "first",
                len(predictor.members) if isinstance(predictor, Ensemble) else 1,
                model_bytes, self.num_members, report, num_rounds),
            "capped_claims": list(self.capped_claims),
            "screening": {"screen_factor": self.screen_factor,
                          "curvature_screen_factor": self.curvature_screen_factor,
                          "val_screen": self.val_screen,
                          "num_examples_cap": self.num_examples_cap,
                          "notes": list(self.screen_notes)},
            "chance": self.chance,
            "at_chance": None if self.chance is None else self.chance["at_chance"],
            # the BatchNorm-statistics rule in force, as in the report
            "norm_stats": report["norm_stats"],
            "timing": {**client_timing(clients), "server_fuse_s": self.fuse_seconds},
        }

    def _declared_shapes(self, model: str, kwargs: dict[str, object]) -> ParamShapes:
        """Shapes of a client's declared architecture, refused before anything is built when
        this strategy needs the server's own."""
        if self.same_architecture and not self.context.model_spec.same_architecture(model,
                                                                                  kwargs):
            spec = self.context.model_spec
            raise ValueError(f"model {model}{kwargs} differs from the server's "
                             f"{spec.name}{spec.kwargs}; {self.name} needs one architecture")
        return self.context.param_shapes(model, kwargs)

    def initial_models(self) -> list[NumpyDict]:
        """The M initial models the strategy broadcasts (FedBEns Algorithm 1, line 1), seeded
        by ``seed``: member m from ``torch.manual_seed(seed * 7919 + m)``, or with
        ``init_perturbation`` s > 0 member 0's init plus that seed's N(0, s^2) noise."""
        models: list[NumpyDict] = []
        # a module's constructor draws from the global RNG: seeded inside a forked state, so
        # the caller's RNG is left as it was
        for m in range(self.num_members):
            with seeded((self.context.seed * 7919 + m) % 2**63):
                if self.init_perturbation and m > 0:
                    models.append({k: (v + self.init_perturbation * torch.randn(
                        v.shape, dtype=torch.float64).numpy()).astype(v.dtype)
                        if v.dtype.kind == "f" else v.copy() for k, v in models[0].items()})
                    continue
                models.append(state_arrays(self.context.model_spec.build()))
        return models


Fusion.__doc__ = (Fusion.__doc__ or "").rstrip() + "\n" + FUSION_PARAMETERS


def _with_shared_report(report: Callable[[Fusion], dict[str, Any]]
                        ) -> Callable[[Fusion], dict[str, Any]]:
    """A subclass's ``report`` followed by :meth:`Fusion.shared_report`."""
    @functools.wraps(report)
    def wrapped(self: Fusion) -> dict[str, Any]:
        return {**report(self), **self.shared_report()}
    return wrapped


def expect(name: str, value: object, ok: bool, expected: str) -> None:
    """Raise ValueError "``name`` must be ``expected``, got ``value``" unless ``ok``: the
    constructors' argument checks, worded alike."""
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def summarise_reason(reason: str, limit: int = 400) -> str:
    """A long reason (e.g. a Ray-wrapped client traceback) cut to its first line and its root
    cause, the last ``SomethingError: ...`` line, instead of its first ``limit`` characters."""
    if len(reason) <= limit:
        return reason
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b", line)]
    cause = causes[-1] if causes else lines[-1]
    return f"{lines[0][:150]} ... {cause[:limit]}"
