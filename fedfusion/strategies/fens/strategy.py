"""FENS (Allouah et al., NeurIPS 2024, "Revisiting Ensembling in One-Shot Federated
Learning"): one-shot uploads, then a small aggregator over the uploaded models' outputs
trained by a few cheap federated rounds.

Round 1 is any one-shot round: every client trains its M members on all but a held-out
fraction ``holdout_fraction`` of its rows (sent in the train config as ``holdout-fraction``)
and uploads them. The K = sum_c M_c uploaded models then go to every client once; each
computes their log-probabilities z(x) ``[K, C]`` on its held-out rows, keeps them, and from
then on each aggregator round moves only the aggregator g
(:class:`~fedfusion.strategies.fens.predictor.LogitAggregator`: a per-class mixture and a
per-class product of the models, plus FENS' shallow network over the concatenated outputs
when ``hidden > 0``) by local SGD and a server step
(:mod:`fedfusion.strategies.fens.training`). g starts as the uniform ensemble (the mean of
the models' probabilities); the server scores it on its validation set after every round and keeps
the best, stopping after ``patience`` rounds without improvement (or ``rounds`` in all;
without a validation set every round runs and the last aggregator is kept).
Prediction: softmax(g(z(x))), one forward pass of every uploaded model.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from torch import nn

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.evaluation import classification_metrics
from fedfusion.core.predictors import Ensemble
from fedfusion.core.screening import capped_counts, capped_reason
from fedfusion.core.state import state_arrays
from fedfusion.flower.client_errors import parse_client_error
from fedfusion.flower.strategy import FusionResult, FusionStrategy
from fedfusion.flower.train_config import MODEL_KEY, MODEL_KWARGS_KEY, ROUND_KEY
from fedfusion.reasons import describe
from fedfusion.sections import MAX_ABS_WEIGHT
from fedfusion.seeding import seeded
from fedfusion.strategies.fedbens import FedBEns
from fedfusion.strategies.fens.predictor import AggregatedEnsemble, LogitAggregator
from fedfusion.strategies.fens.training import (
    AGGREGATOR_RECORD,
    HIDDEN_KEY,
    MODELS_RECORD,
    NUM_CLASSES_KEY,
    NUM_MODELS_KEY,
    PHASE_AGGREGATOR,
    PHASE_KEY,
    LocalTraining,
    ServerOptimizer,
    decode_aggregator,
    features,
)
from fedfusion.wire import ClientUpload, encode_models

#: the widest aggregator hidden layer FENS builds (a typo must not allocate without end)
MAX_HIDDEN = 65_536
log = logging.getLogger("fedfusion")

#: the train-config key of round 1 by which the server asks the clients to hold rows out
HOLDOUT_KEY = "holdout-fraction"
#: the FENS paper's proxy ratio: the fraction of each client's rows held out
FENS_HOLDOUT = 0.1
#: what the aggregator combines: the uploaded members, or FedBEns' modes of them
BASES = ("members", "fedbens")


class FENS(FusionStrategy):
    """One-shot uploads, then an aggregator over their outputs trained federatedly.

    Parameters
    ----------
    holdout_fraction : float, default 0.1
        Fraction of each client's rows kept out of local training for the aggregator (the
        FENS paper's proxy ratio); sent to the clients in round 1.
    hidden : int, default 0
        Width of the aggregator's shallow network over the concatenated outputs (FENS'
        own aggregator: 2K); 0 keeps the per-class mixture and product of the models alone.
    rounds : int, default 100
        At most this many aggregator rounds.
    patience : int, default 10
        Stop once the validation score has not improved in this many rounds (0: never;
        without a validation set every one of ``rounds`` runs).
    server_optimizer : {"fedadam", "fedavg"}, default "fedadam"
        The server's step on the aggregator.
    server_lr : float, default 0.05
        FedAdam's step size.
    local_epochs, local_lr, local_batch_size :
        Each client's SGD (momentum 0.9) per aggregator round.
    base : {"members", "fedbens"}, default "members"
        The models the aggregator combines: every uploaded member (FENS), or FedBEns'
        modes of the same uploads (its defaults; the clients then upload its curvature).
    """

    name = "fens"
    member_fusions = ("all", "first")
    keeps_client_models = True
    default_norm_stats = "client"  # the base models keep their clients' statistics
    distils_after_fuse = False  # the predictor is finished by the aggregator rounds

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 holdout_fraction: float = FENS_HOLDOUT, hidden: int = 0, rounds: int = 100,
                 patience: int = 10, server_optimizer: str = "fedadam",
                 server_lr: float = 0.05, local_epochs: int = 1, local_lr: float = 0.1,
                 local_batch_size: int = 64, base: str = "members", **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        if base not in BASES:
            raise ValueError(f"base must be one of {BASES}, got {base!r}")
        self.base = base
        #: FedBEns on the same context, whose modes are the base models (base="fedbens")
        self.fedbens: FedBEns | None = None
        if base == "fedbens":
            self.fedbens = FedBEns(self.context.model_spec, num_members=self.num_members)
            self.fedbens.context = self.context
            self.required_sections = self.fedbens.required_sections
        if not 0 < holdout_fraction < 1:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction!r}")
        if hidden < 0 or rounds < 0 or patience < 0:
            raise ValueError(f"hidden, rounds and patience must be >= 0, got {hidden}, "
                             f"{rounds}, {patience}")
        if hidden > MAX_HIDDEN:  # the aggregator's (K x classes) x hidden layer
            raise ValueError(f"hidden must be at most {MAX_HIDDEN}, got {hidden}")
        self.holdout_fraction, self.hidden = float(holdout_fraction), int(hidden)
        self.rounds, self.patience = int(rounds), int(patience)
        self.server_optimizer = ServerOptimizer(server_optimizer, server_lr)
        self.local_training = LocalTraining(local_epochs, local_lr, 0.9, local_batch_size)
        self.client_config[HOLDOUT_KEY] = self.holdout_fraction
        self.aggregator: LogitAggregator | None = None
        #: per aggregator round: clients, held-out rows, validation accuracy and NLL
        self.trace: list[dict[str, Any]] = []
        self.best_round = 0
        #: the temperature the trained aggregator was divided by (:meth:`calibrate`)
        self.temperature = 1.0
        self.aggregator_seconds = 0.0
        #: bytes each node received and sent in the aggregator rounds
        self.bytes_down: dict[int, int] = {}
        self.bytes_up: dict[int, int] = {}
        self._served: set[int] = set()
        self._val_features: torch.Tensor | None = None
        #: what :meth:`start` was given for round 1 beyond the strategy's own keys (e.g. the
        #: data description of client-data='local'), sent in every aggregator round too
        self._train_config: dict[str, Any] = {}

    # ------------------------------------------------------------------ round 1
    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        """The uploaded models under the initial aggregator (their uniform ensemble);
        :meth:`train_aggregator` trains it."""
        models: list[nn.Module] = []
        specs: list[ModelSpec] = []
        if self.fedbens is not None:
            modes = self.fedbens.fuse(uploads)
            assert isinstance(modes, Ensemble)
            models, specs = list(modes.members), list(modes.specs)
        for upload in uploads if self.fedbens is None else ():
            models += self.context.member_models(upload)
            specs += [self.context.spec_for(upload)] * upload.num_members
        # a model_fn that no dry forward could size (no input shape, no validation set): the
        # classes from the clients' histograms (one per model output), the median length so
        # that no single client decides it
        num_classes = self.context.model_spec.num_classes or statistics.median_low(
            len(u.metrics.get("class-histogram", [])) for u in uploads)
        if num_classes < 1:
            raise ValueError("fens: the number of classes is unknown (no validation set, no "
                             "input shape, no class histograms): give the model spec "
                             "num_classes or pass val=(x, y)")
        with seeded(self.context.seed):
            self.aggregator = LogitAggregator(len(models), num_classes, self.hidden)
        self._val_features = None
        log.info("[fens] %d models under the initial aggregator (their uniform ensemble) "
                 "until train_aggregator(grid) trains it; start() does both", len(models))
        return AggregatedEnsemble(models, specs, self.aggregator)

    def start(self, grid: Grid, *args: Any, evaluate_fn: Callable[[int, ArrayRecord],
              MetricRecord | None] | None = None, **kwargs: Any) -> FusionResult:
        """Round 1 (the one-shot uploads, :meth:`FusionStrategy.start`), then
        :meth:`train_aggregator` on the same grid; ``evaluate_fn`` sees both results."""
        self._train_config = dict(kwargs.get("train_config") or {})
        result = super().start(grid, *args, evaluate_fn=evaluate_fn, **kwargs)
        used = self.train_aggregator(grid)
        members = self.predictor.members if isinstance(self.predictor, Ensemble) else []
        result.arrays = (ArrayRecord(members[0].state_dict()) if len(members) == 1
                         else self.broadcast_arrays(self.predictor))
        if evaluate_fn is not None:
            metrics = evaluate_fn(1 + used, result.arrays)
            if metrics is not None:
                result.evaluate_metrics_serverapp[1 + used] = metrics
        result.predictor = self.predictor
        return result

    # ------------------------------------------------------------------ aggregator rounds
    def train_aggregator(self, grid: Grid, nodes: Sequence[int] | None = None) -> int:
        """Train the aggregator of the last :meth:`fuse` with the clients of ``grid``: the
        nodes whose uploads were fused, else (a replay) every connected node. Returns the
        aggregator rounds run; the predictor keeps the best-validated aggregator."""
        if self.aggregator is None or self.predictor is None:
            raise RuntimeError("FENS trains its aggregator after fusing uploads: call start() "
                               "or fuse_uploads() first")
        if nodes is None:
            nodes = [u.node_id for u in self.uploads if u.node_id is not None] or sorted(
                grid.get_node_ids())
        for node in [n for n in nodes if not self.identities.admits(n)]:
            self.exclude(1, node, f"node {node} is not in the client registry; not sent the "
                         "uploaded models", node=node)
        nodes = [n for n in nodes if self.identities.admits(n)]
        assert isinstance(self.predictor, AggregatedEnsemble)
        models = list(self.predictor.members)
        model_record = encode_models([state_arrays(m) for m in models])
        model_bytes = sum(a.numpy().nbytes for a in model_record.values())
        start = time.perf_counter()
        best = self._score()
        best_state = _clone(self.aggregator.state_dict())
        self.trace = [{"round": 0, **best}]
        self.best_round, stale, used = 0, 0, 0
        trained = [name for name, _ in self.aggregator.named_parameters()]
        log.info("[fens] training the aggregator (%d models, hidden %d) with %d client(s): at "
                 "most %d rounds, patience %d", len(models), self.hidden, len(nodes),
                 self.rounds, self.patience)
        for used in range(1, self.rounds + 1):
            state = _clone(self.aggregator.state_dict())
            record = ArrayRecord({k: Array(v.numpy()) for k, v in state.items()})
            state_bytes = sum(v.numel() * v.element_size() for v in state.values())
            messages = []
            for node in nodes:
                content = RecordDict({AGGREGATOR_RECORD: record,
                                      "config": self._round_config(1 + used)})
                self.bytes_down[node] = self.bytes_down.get(node, 0) + state_bytes
                if node not in self._served:
                    content[MODELS_RECORD] = model_record
                    self.bytes_down[node] += model_bytes
                messages.append(Message(content=content, dst_node_id=node,
                                        message_type=MessageType.TRAIN))
            replies = grid.send_and_receive(messages, timeout=self.round_timeout)
            client_states, weights = self._collect(1 + used, replies, messages, state,
                                                   state_bytes)
            # the clients train the parameters; the buffers (the temperature) stay the server's
            new_state = {**state, **self.server_optimizer.step(
                {k: state[k] for k in trained}, [{k: c[k] for k in trained}
                                                 for c in client_states], weights)}
            self.aggregator.load_state_dict(new_state)
            score = self._score()
            self.trace.append({"round": used, "clients": len(client_states),
                               "rows": int(sum(weights)), **score})
            if score and self._better(score, best):
                best, best_state, self.best_round, stale = score, _clone(new_state), used, 0
            elif score:  # without validation nothing is stale: every round runs
                stale += 1
            if score:
                log.info("[fens] round %d: %d client(s), validation accuracy %.4f, NLL %.4f",
                         used, len(client_states), score["val_accuracy"], score["val_nll"])
            if not client_states:
                log.warning("[fens] aggregator round %d: no client trained it; stopping", used)
                break
            if self.patience and stale >= self.patience:
                break
        if self.rounds and not any(entry.get("clients") for entry in self.trace[1:]):
            log.warning("[fens] no client trained the aggregator (see the exclusions): FENS "
                        "predicts with the initial aggregator, the uniform ensemble of the %d "
                        "models", len(models))
        if best:  # with validation: the best round's aggregator, else the last one
            self.aggregator.load_state_dict(best_state)
            self.calibrate()
        else:
            self.best_round = used
        self.aggregator_seconds += time.perf_counter() - start
        if self.distill_options.mode != "none":
            self.distill_teacher, self.predictor = self.predictor, self._distil(self.predictor,
                                                                        self.uploads)
        self._check_chance(self.predictor, 1 + used)
        return used

    def calibrate(self) -> float:
        """Temperature scaling of the trained aggregator on the validation set: g <- g / T
        with T minimising the validation NLL (a grid over log T, kept as the aggregator's
        ``scale`` = 1/T); the arg-max, so the accuracy, is unchanged. Returns T (1 without
        a validation set)."""
        if self._val_features is None or self.aggregator is None:
            return 1.0
        labels = self.context.val.y.long()  # type: ignore[union-attr]
        with torch.no_grad():
            logits = self.aggregator(self._val_features) / self.aggregator.scale
            grid = torch.logspace(-1.5, 1.5, 61, dtype=torch.float64)
            nll = torch.stack([torch.nn.functional.cross_entropy(logits.double() / t, labels)
                               for t in grid])
            temperature = float(grid[int(nll.argmin())])
            self.aggregator.scale.fill_(1.0 / temperature)
        self.temperature = temperature
        return temperature

    def _round_config(self, server_round: int) -> ConfigRecord:
        spec = self.context.model_spec
        assert self.aggregator is not None
        return ConfigRecord({
            **self._train_config, ROUND_KEY: server_round, PHASE_KEY: PHASE_AGGREGATOR,
            MODEL_KEY: spec.name,
            MODEL_KWARGS_KEY: json.dumps(spec.kwargs, sort_keys=True),
            HIDDEN_KEY: self.hidden, NUM_MODELS_KEY: self.aggregator.num_models,
            NUM_CLASSES_KEY: self.aggregator.num_classes, HOLDOUT_KEY: self.holdout_fraction,
            **self.local_training.to_config(), **self.client_config})

    def _collect(self, server_round: int, replies: Iterable[Message],
                 sent: Sequence[Message], state: dict[str, torch.Tensor], state_bytes: int
                 ) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
        """Each reply's aggregator and row count, checked: the arrays decoded as an upload's
        are (:func:`~fedfusion.wire.decode_array`), the global one's names and shapes, finite
        and within the weights' magnitude cap, rows a whole number, then capped at
        ``num_examples_cap`` x the median of the other nodes' rows (as round 1 caps
        ``num_examples``); a bad reply, and a node that sends none, is excluded for the
        round. A reply is the node's its message was sent to (the grid writes each message's
        id as it pushes it)."""
        client_states, weights, weighted_nodes = [], [], []
        replied: set[int] = set()
        owner = {m.metadata.message_id: m.metadata.dst_node_id for m in sent
                 if m.metadata.message_id}
        addressed = {m.metadata.dst_node_id for m in sent}
        for reply in replies:
            node = owner.get(reply.metadata.reply_to_message_id)
            if node is None and not owner and reply.metadata.src_node_id in addressed:
                node = reply.metadata.src_node_id  # a grid that gives messages no ids
            if node is None or node in replied:
                continue  # not an answer to this round's messages
            replied.add(node)
            if reply.has_error():
                self.exclude(server_round, node, node=node, reason="client error: "
                             f"{parse_client_error(reply.error.reason)}")
                self._served.discard(node)  # a restarted node lost its features: resend
                continue
            try:
                client_state = decode_aggregator(
                    reply.content[AGGREGATOR_RECORD],
                    {k: tuple(v.shape) for k, v in state.items()}, self.upload_limits)
                rows = reply.content["metrics"]["num-examples"]
            except Exception as exc:  # the last net, as round 1's: one reply never sinks it
                self.exclude(server_round, node, f"malformed aggregator reply: "
                             f"{describe(exc)}", node=node)
                continue
            problem = _check_state(client_state, rows, self.upload_limits.num_examples)
            if problem:
                self.exclude(server_round, node, problem, node=node)
                continue
            self._served.add(node)
            self.bytes_up[node] = self.bytes_up.get(node, 0) + state_bytes
            if rows:
                client_states.append(client_state)
                weights.append(float(rows))
                weighted_nodes.append(node)
        counts, medians = capped_counts([int(w) for w in weights], self.num_examples_cap)
        for i, median in medians.items():
            node = weighted_nodes[i]
            record = {"client_id": self.client_of_node(node), "node_id": node,
                      "claimed": int(weights[i]),
                      "capped_to": counts[i], "median_of_others": median,
                      "factor": self.num_examples_cap}
            # every round's claim is recorded; the same claim capped again is not news
            again = any(c["node_id"] == node and c["claimed"] == record["claimed"]
                        and c["capped_to"] == record["capped_to"] for c in self.capped_claims)
            log.log(logging.DEBUG if again else logging.WARNING,
                    "[fens] aggregator round %d: %s", server_round, capped_reason(record))
            self.capped_claims.append({"round": server_round, **record})
        for message in sent:
            if message.metadata.dst_node_id not in replied:
                node = message.metadata.dst_node_id
                self.exclude(server_round, node, f"no aggregator reply within "
                             f"{self.round_timeout:g} s", node=node)
        return client_states, [float(n) for n in counts]

    def _score(self) -> dict[str, float]:
        """Validation accuracy and NLL of the current aggregator (empty without ``val``)."""
        val = self.context.val
        if val is None or not len(val) or self.aggregator is None:
            return {}
        if self._val_features is None:
            assert isinstance(self.predictor, AggregatedEnsemble)
            self._val_features = features(list(self.predictor.members), val.x)
        with torch.no_grad():
            log_probs = torch.log_softmax(self.aggregator(self._val_features), -1)
        metrics = classification_metrics(log_probs, val.y)
        return {"val_accuracy": metrics["accuracy"], "val_nll": metrics["nll"]}

    @staticmethod
    def _better(score: dict[str, float], best: dict[str, float]) -> bool:
        return (score["val_accuracy"], -score["val_nll"]) > (best["val_accuracy"],
                                                             -best["val_nll"])

    def report(self) -> dict[str, Any]:
        nodes = sorted(self.bytes_down)
        return {
            "holdout_fraction": self.holdout_fraction, "hidden": self.hidden,
            "base": self.base,
            **({"fedbens": self.fedbens.report()} if self.fedbens is not None else {}),
            "server_optimizer": self.server_optimizer.kind,
            "server_lr": self.server_optimizer.lr,
            "local_training": self.local_training.to_config(),
            "aggregator_rounds": len(self.trace) - 1 if self.trace else 0,
            "rounds": 1 + (len(self.trace) - 1 if self.trace else 0),
            "best_round": self.best_round, "temperature": self.temperature,
            "aggregator_seconds": self.aggregator_seconds,
            "forward_passes": self.aggregator.num_models if self.aggregator else 0,
            # the aggregator rounds' traffic, per client (round 1's is the upload's)
            "aggregator_download_bytes_per_client": float(np.mean(
                [self.bytes_down[n] for n in nodes])) if nodes else 0.0,
            "aggregator_upload_bytes_per_client": float(np.mean(
                [self.bytes_up.get(n, 0) for n in nodes])) if nodes else 0.0,
            "trace": self.trace,
        }


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def _check_state(client: dict[str, torch.Tensor], rows: object, cap: int) -> str:
    """Why a client's aggregator reply (decoded in the global one's shapes) cannot be
    averaged ('' when it can); ``cap``: the strategy's cap on ``num-examples`` (its upload
    limits)."""
    if isinstance(rows, bool) or not isinstance(rows, int | float) or not (
            0 <= rows <= cap) or int(rows) != rows:
        return f"num-examples must be a whole number in 0..{cap}, got {rows!r}"
    for name, value in client.items():
        if not torch.isfinite(value).all():
            return f"aggregator entry {name!r} holds NaN or Inf"
        largest = float(value.abs().max()) if value.numel() else 0.0
        if largest > MAX_ABS_WEIGHT:  # the cap on uploaded weights: FedAdam squares it
            return (f"aggregator entry {name!r} has values up to {largest:.3g} in magnitude, "
                    f"above the cap {MAX_ABS_WEIGHT:.0e} on weights")
    return ""
