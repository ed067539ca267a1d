"""The Flower side of every fedfusion strategy.

A :class:`FusionStrategy` is a Flower Message-API strategy
(:class:`flwr.serverapp.strategy.Strategy`) on the fusion core
(:class:`~fedfusion.core.fusion.Fusion`). Its round: broadcast the current global
weights (M initial models in round 1, made and seeded by the strategy) with the upload
sections the strategy needs -> decode and validate every reply into a
:class:`~fedfusion.wire.ClientUpload`, attributed to the node the message went to and given
the client id the server decides (:mod:`fedfusion.flower.identity`) -> the core's
validate, screen and :meth:`~fedfusion.core.fusion.Fusion.fuse`. A reply that fails
validation, a client error and a node that does not answer in time are each excluded with
the reason recorded in :attr:`exclusions`; the round goes on with the rest.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

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

from fedfusion.constraints import SECONDS
from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.fusion import FUSION_PARAMETERS, Fusion, expect, summarise_reason
from fedfusion.core.predictors import Ensemble
from fedfusion.core.state import state_arrays
from fedfusion.flower.client_errors import infrastructure_error, parse_client_error
from fedfusion.flower.identity import (
    SERVER,
    Assignment,
    NodeIdentities,
    check_client_registry,
    read_client_registry,
)
from fedfusion.flower.sampling import round_generator, sample_nodes, wait_for_nodes
from fedfusion.flower.streaming import StreamingGrid
from fedfusion.flower.train_config import (
    MODEL_KEY,
    MODEL_KWARGS_KEY,
    OPTIONAL_SECTIONS_KEY,
    REQUIREMENTS_KEY,
    ROUND_KEY,
    SECTIONS_KEY,
    STRATEGY_KEY,
)
from fedfusion.wire import ClientUpload, UploadError, decode_upload, encode_models

log = logging.getLogger("fedfusion")


#: numpy-style documentation of the Flower-side arguments every strategy shares
FLOWER_PARAMETERS = """
    num_clients : int, optional
        Shorthand for ``min_available_nodes = min_train_nodes = num_clients``.
    fraction_train : float, default 1.0
        As Flower's strategies: the fraction of available nodes sampled for training.
    min_train_nodes : int, default 2
        As Flower's strategies: the fewest nodes sampled for training.
    min_available_nodes : int, default 2
        As Flower's strategies: the nodes to wait for before a round starts.
    round_timeout : float, default 3600.0
        Seconds to wait for the replies of a round; a node that does not reply in time is
        excluded with "no reply within N s".
    node_wait_timeout : float, default 600.0
        Seconds a round waits for ``min_available_nodes`` (and ``min_train_nodes``) nodes to
        connect before it sends anything; fewer by then raise
        :class:`~fedfusion.flower.sampling.NodeWaitTimeout` naming how many connected
        of how many were required (``math.inf`` waits forever, as Flower's strategies do).
    extra_sections : sequence of str, default ()
        Upload sections asked of the clients beyond the strategy's own (e.g. ``["gram"]``),
        so one client run can be replayed into other strategies.
    client_config : mapping, optional
        Entries added to every train config, read by the client's local objective
        (``prox-mu``, ``contrastive-weight``, ``contrastive-temperature``).
    client_registry : mapping or path, optional
        Node id -> client id of an authenticated fleet (a mapping, or a JSON file
        ``{"<node id>": <client id>}``): a node's upload is fused under its registered id
        whatever it claims, a node not in it is excluded. Without it the server keeps its
        own registry: a node's claimed id is honoured only while no other node owns it; a
        colliding node is fused under a fresh server-assigned id, its claim kept as a
        label (:mod:`fedfusion.flower.identity`).
"""


@dataclass
class FusionResult(Result):
    """Flower's :class:`~flwr.serverapp.strategy.Result` of a fedfusion run.

    ``arrays``: where the fusion is ONE model (FedAvg, FedFisher, RegMean, Fisher merging,
    OTFusion, DENSE, SWA, PFNM with one member), its plain ``state_dict`` as an ``ArrayRecord``
    (``model.load_state_dict(result.arrays.to_torch_state_dict())``, as any Flower code does);
    where it is several (FedBEns' modes, ``member_fusion="each"``, the ensemble, AMS), every
    model in fedfusion's ``"<m>/<param>"`` encoding (:func:`fedfusion.wire.decode_models`).
    ``predictor``: the fused predictor itself (log-probabilities, :mod:`fedfusion.core.predictors`),
    also :attr:`FusionStrategy.predictor`."""

    predictor: nn.Module | None = None


class FusionStrategy(Fusion, Strategy):
    """Broadcast -> collect validated uploads -> fuse. Subclasses implement :meth:`fuse`.

    Parameters
    ----------
    """

    parameters_doc: ClassVar[str] = FUSION_PARAMETERS + FLOWER_PARAMETERS

    def __init__(
        self,
        model_fn: ModelFn | nn.Module | ModelSpec,
        *,
        num_clients: int | None = None,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        round_timeout: float = 3600.0,
        node_wait_timeout: float = 600.0,
        extra_sections: Sequence[str] = (),
        client_config: Mapping[str, float] | None = None,
        client_registry: Mapping[int, int] | str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ):
        super().__init__(model_fn, **kwargs)
        if num_clients is not None:
            min_train_nodes = min_available_nodes = num_clients
        expect("fraction_train", fraction_train, 0.0 < fraction_train <= 1.0, "in (0, 1]")
        expect("min_train_nodes", min_train_nodes, min_train_nodes >= 1, ">= 1")
        expect("min_available_nodes", min_available_nodes, min_available_nodes >= 1, ">= 1")
        SECONDS.check("round_timeout", round_timeout)
        SECONDS.check("node_wait_timeout", node_wait_timeout)
        self.fraction_train = fraction_train
        self.min_train_nodes, self.min_available_nodes = min_train_nodes, min_available_nodes
        self.round_timeout, self.node_wait_timeout = float(round_timeout), float(node_wait_timeout)
        #: sections asked of the clients beyond ``required_sections`` (kept for replays)
        self.extra_sections = tuple(extra_sections)
        #: entries added to every round's train config: the client-side objective
        self.client_config: dict[str, float] = dict(client_config or {})
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
        required = max(min_available_nodes, min_train_nodes)
        if client_registry is not None and len(client_registry) < required:
            raise ValueError(f"the client registry names {len(client_registry)} node(s), fewer "
                             f"than the {required} a round waits for (num_clients / "
                             "min_available_nodes / min_train_nodes): no round could start")


    @property
    def num_clients(self) -> int:
        """The nodes a round waits for (``min_available_nodes``)."""
        return self.min_available_nodes

    # ------------------------------------------------------- Flower Message API
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
        ``state_dict``), and ``round_timeout`` as the timeout. ``evaluate_fn`` gets what
        :class:`FusionResult` holds: one model as a plain ``state_dict`` record (Flower's
        ``arrays.to_torch_state_dict()`` loads it), several as ``"<m>/<param>"``. Returns a
        :class:`FusionResult`: a one-model fusion as a plain ``state_dict`` record, the
        predictor beside it. A one-shot strategy (:attr:`one_shot_only`) refuses
        ``num_rounds > 1``."""
        if self.one_shot_only and num_rounds > 1:
            raise ValueError(f"{self.name} is one-shot: it fuses once, so num_rounds must be 1, "
                             f"got {num_rounds} (FedAvg, FedProx, FedFisher, Fisher merging "
                             "and SWA take several rounds)")
        if initial_arrays is None:
            initial_arrays = encode_models(self.initial_models())
        elif initial_arrays and not all("/" in key for key in initial_arrays):
            # a plain Flower ArrayRecord(model.state_dict()): one model, member 0
            if self.num_members > 1:
                raise ValueError(
                    f"initial_arrays is one model's state_dict but num_members="
                    f"{self.num_members}: pass the {self.num_members} initial models as "
                    "fedfusion.wire.encode_models([...]), or leave initial_arrays out for the "
                    "strategy's own seeded ones")
            initial_arrays = encode_models([{k: a.numpy() for k, a in initial_arrays.items()}])
        if not getattr(grid, "streams_replies", False):
            grid = StreamingGrid(grid)
        if evaluate_fn is not None:
            evaluate_fn = functools.partial(_evaluate_plain, evaluate_fn)
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

    def diagnostics(self, num_rounds: int = 1) -> dict[str, Any]:
        """:meth:`Fusion.diagnostics`, its ``timing`` with ``client_round_s``
        (:attr:`client_round_seconds`)."""
        diagnostics = super().diagnostics(num_rounds)
        diagnostics["timing"]["client_round_s"] = self.client_round_seconds
        return diagnostics

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global arrays, the wanted upload sections and the server's architecture
        to the sampled nodes: once ``min_available_nodes`` (at least ``min_train_nodes``)
        are connected, or :class:`~fedfusion.flower.sampling.NodeWaitTimeout` after
        ``node_wait_timeout`` seconds; sampled by a generator seeded by ``seed`` and the
        round (:mod:`fedfusion.flower.sampling`)."""
        required = max(self.min_available_nodes, self.min_train_nodes)
        available = wait_for_nodes(grid, required, self.node_wait_timeout,
                                   where=f"[{self.name}] round {server_round}",
                                   admits=self.identities.admits)
        # an operator registry names the fleet: a node outside it is neither sampled nor
        # sent the model
        for node in sorted(n for n in available if not self.identities.admits(n)):
            self.exclude(server_round, node, f"node {node} is not in the client "
                         "registry; not sent the round", node=node)
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
        # the client checks its model against them before it trains (fedfusion.core.model_check)
        config[STRATEGY_KEY] = self.name
        config[REQUIREMENTS_KEY] = list(self.requirements)
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
        (:mod:`fedfusion.flower.identity`), then fuse.

        Each reply is attributed to the node its message was sent to, matched by
        ``reply_to_message_id`` to the messages :meth:`configure_train` sent: Flower's own
        error replies (a node whose heartbeat stopped, an expired message) come from the
        SuperLink (``src_node_id`` 1), not from the node. Every sent node gives exactly one
        outcome: an upload, or one exclusion with its reason (a client error, a lost node,
        an expired message, an invalid upload, or no reply)."""
        sent_at, self._sent_at = self._sent_at, None

        def elapsed() -> float | None:
            # replies stream in (StreamingGrid): the round lasts until the last one
            return None if sent_at is None else time.perf_counter() - sent_at

        sent = {md.message_id: md.dst_node_id for md in self._sent_metadata if md.message_id}
        store = getattr(self.upload_sink, "write", None)
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
                             f"not send; ignored ({summarise_reason(reason, 200)})")
                continue
            if node in replied:
                self.exclude(server_round, node, "a second reply to one message; "
                             "ignored (the first was kept)", node=node)
                continue
            replied.add(node)
            if reply.has_error():
                reason, detail = self._error_reason(reply, elapsed())
                self.exclude(server_round, node, reason, detail=detail, node=node)
                continue
            try:
                upload = decode_upload(reply.content, f"node {node}", self._declared_shapes,
                                       self.required_sections, limits=self.upload_limits,
                                       table=self.section_table)
                self.check_upload(upload)
            except UploadError as exc:
                self.exclude(server_round, exc.client, exc.problem, node=node)
                continue
            upload.node_id = node
            log.info("[%s] round %d: node %d (claims client %d): %d member(s), %d examples, "
                     "%.2f MB", self.name, server_round, node, upload.client_id,
                     upload.num_members, upload.num_examples, upload.nbytes / 1e6)
            if store is not None:
                try:  # on disk as it arrives; a failed write is retried with the round's
                    store(upload)
                except OSError as exc:
                    log.warning("[%s] round %d: node %d's upload not stored yet: %s",
                                self.name, server_round, node, exc)
            valid.append(upload)
        round_seconds = elapsed()
        if round_seconds is not None:
            self.client_round_seconds += round_seconds
        for node in self._sent_to:
            if node not in replied:
                self.exclude(server_round, node, self._silence_reason(round_seconds),
                             node=node)
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

    def client_of_node(self, node: int) -> int | None:
        """The client id the operator's registry, or an earlier round, gave ``node``."""
        return self.identities.nodes.get(node)

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
                self.exclude(server_round, upload.node_id, outcome, node=upload.node_id)
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


def _evaluate_plain(evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None],
                    server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
    """``evaluate_fn`` called as Flower's strategies call it: a broadcast of one model
    (``"0/<param>"`` keys only) is passed as that model's plain ``state_dict`` record."""
    if arrays and all(key.startswith("0/") for key in arrays):
        arrays = ArrayRecord({key[2:]: array for key, array in arrays.items()})
    return evaluate_fn(server_round, arrays)
