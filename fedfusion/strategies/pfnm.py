"""PFNM, probabilistic federated neural matching (Yurochkin et al., ICML 2019), one-shot.

Hidden neurons of the clients' MLPs are noisy observations of global neurons drawn from a
Beta-Bernoulli process (BBP): global neuron i has parameters theta_i ~ N(0, sigma0^2 I),
client j's neuron l assigned to it has v_jl ~ N(theta_i, sigma^2 I), and client j picks each
existing global neuron with probability m_i / J (m_i = number of clients using it) plus
Poisson(gamma0 / J) new ones. BBP-MAP inference alternates over clients j: with all other
clients fixed, the assignment of j's neurons is a linear assignment problem
(:func:`scipy.optimize.linear_sum_assignment`, maximising) with gains

    existing i:  sum_d (n_id + p_jd v_jld)^2 / (q_id + p_jd) - n_id^2 / q_id
                 + 2 log(m_i / (J - m_i))
    new (t-th):  sum_d (p_jd v_jld)^2 / (1/sigma0^2 + p_jd) + 2 log(gamma0 / J) - 2 log t

where n_i = sum_{(j,l) -> i} p_j v_jl and q_i = 1/sigma0^2 + sum p_j are global neuron i's
natural parameter and precision from the OTHER clients, and p_jd the precision of client
j's observation of dimension d (1/sigma^2). These are the paper's costs: twice the log
posterior, theta_i at its MAP n_i / q_i (Proposition 1). One greedy pass (clients by
decreasing width) is followed by ``pfnm-iters`` passes in a seeded random order, each
removing a client's neurons from the global model and matching them again. The global
neurons are the MAP theta_i = n_i / q_i, so the global model is as wide as the number of
global neurons: usually wider than every client.

Multilayer (the authors' layer-wise scheme): hidden layers are matched one at a time from
the TOP hidden layer down. A neuron of hidden layer c is the vector of its outgoing weights
to layer c+1 (the output classes for the top layer), its bias (if any), and, for the first
hidden layer only, its incoming weights from the input. Once layer c+1 is matched, every
client's outgoing weights of layer c are re-indexed into the global layer-(c+1) neurons
(the permutation of layer c+1 propagated to the input side of its weight matrix), so layer
c is matched in global coordinates. The global weight matrix into layer c+1 is the
outgoing part of the global layer-c neurons; the first layer's input weights are those of
layer 1.

Hyper-parameters: ``pfnm-sigma`` = sigma^2, ``pfnm-sigma0`` = sigma0^2, ``pfnm-gamma`` =
gamma0, defaults 1, 1, 1 and 5 iterations, as in the authors' experiment script.

Departures, all documented choices:

* A client's re-indexed outgoing weights only observe the global layer-(c+1) neurons that
  client holds: the other coordinates have precision 0 (unobserved) instead of the
  authors' code's zeros with full precision, following the generative model.
* Output-layer coordinates are weighted by class as in the authors' code: client j's weight
  to class k has precision (n_jk / sum_j' n_j'k) / sigma^2 (its share of class k, from the
  ``class-histogram`` of the upload metrics), so a client without class k does not pull that
  class's weights; an output bias is the same precision-weighted posterior mean. Without
  valid histograms on every upload, all clients get precision 1/sigma^2 (the plain model).
* The prior mean is 0 for every coordinate (the authors use 0.1 for biases); biases are
  matched with the weights when the MLP has them (fedfusion's MLPs are bias-free by
  default, then the neuron is its weights only).
* The popularity term is 2 log(m/(J-m)) as in the paper; the authors' code uses
  log(min(m, 10)/(J - min(m, 10))). The global width is not capped (their code caps the
  number of new neurons at 700 - L).
* Clients may have different widths (the same depth and bias); M > 1 members are matched
  index by index, as FedAvg does, into an ensemble.

What PFNM takes: MLPs, i.e. the zoo's ``mlp`` (``ModelSpec("mlp", input_shape, num_classes,
{"hidden_layers": ..., "hidden": ..., "bias": ...})``): a chain of Linear layers joined by
ReLU, after a Flatten; every layer with a bias (as the paper's networks) or every layer
without. Matching permutes hidden neurons, so every parameter must be a neuron's weight or
bias: no normalisation layers (BatchNorm/LayerNorm carry per-channel parameters and running
statistics outside that model), no convolutions, no residual connections. Any other
architecture is refused before anything trains (when the strategy is built, and on each
client before its training: :mod:`fedfusion.core.model_check`, requirement ``"mlp"``), naming the
model's first module that is not a Linear/ReLU/Flatten layer; such models fuse with FedAvg
(``fedavg``), AdaptiveModelSelection (``ams``) or the ensemble (``ensemble``) instead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment
from torch import nn

from fedfusion.constraints import FINITE_POSITIVE, NON_NEGATIVE
from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.predictors import Ensemble
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.strategies.alignment.graph import Layer, layer_chain
from fedfusion.wire import ClientUpload, UploadError

log = logging.getLogger("fedfusion")

#: the modules of an MLP that PFNM matches
MLP_MODULES = (nn.Linear, nn.ReLU, nn.Flatten)
#: what PFNM takes, for its refusals
TAKES = ("pfnm matches MLPs only: a chain of Linear layers joined by ReLU (every layer with a "
         "bias, or none), no normalisation layers, no convolutions")
#: what to use instead
ALTERNATIVES = ("fuse this model with another strategy, e.g. FedAvg ('fedavg'), "
                "AdaptiveModelSelection ('ams') or the ensemble ('ensemble')")


def first_non_mlp_module(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first module of ``model`` (in ``named_modules`` order) that is not one of
    :data:`MLP_MODULES`, among the leaves and the modules holding parameters or buffers of
    their own (containers are skipped); None if there is none."""
    for name, module in model.named_modules():
        holds = (next(module.parameters(recurse=False), None) is not None
                 or next(module.buffers(recurse=False), None) is not None)
        leaf = next(module.children(), None) is None
        if (leaf or holds) and not isinstance(module, MLP_MODULES):
            return name, module
    return None


def not_an_mlp(model: nn.Module, name: str) -> str | None:
    """Why the network ``model`` (architecture ``name``) is no model PFNM can match: what PFNM
    takes, the first module that is not an MLP layer, and the alternatives; None for the
    zoo's ``mlp`` (the one PFNM builds its wider fused model as). Run on every model by
    :func:`fedfusion.core.model_check.check_model` (requirement ``"mlp"``)."""
    if name == "mlp":
        return None
    found = first_non_mlp_module(model)
    if found is None:
        what = ("its modules are Linear/ReLU/Flatten layers, but pfnm builds the fused (wider) "
                "model as fedfusion's zoo MLP: give the strategy ModelSpec('mlp', input_shape, "
                "num_classes, {'hidden_layers': ..., 'hidden': ..., 'bias': ...})")
    else:
        module_name, module = found
        where = f"module {module_name!r}" if module_name else "the model itself"
        what = (f"its first module that is not a Linear/ReLU layer is {where} "
                f"({type(module).__name__})")
    return f"{TAKES}; the model {name!r} is not one: {what}; {ALTERNATIVES}"


@dataclass
class GlobalLayer:
    """BBP-MAP state of one layer: natural parameters, precisions, popularity, assignments."""

    natural: np.ndarray  # [L, d]  sum of p_j * v_jl over the neurons assigned
    precision: np.ndarray  # [L, d]  1/sigma0^2 + sum of p_j
    counts: np.ndarray  # [L]  clients using each global neuron
    assignment: list[np.ndarray] = field(default_factory=list)  # per client: neuron -> global

    @property
    def theta(self) -> np.ndarray:
        """MAP global neurons n_i / q_i."""
        return self.natural / self.precision


def match_layer(features: Sequence[np.ndarray], precisions: Sequence[np.ndarray],
                sigma0: float, gamma: float, iters: int, rng: np.random.Generator
                ) -> GlobalLayer:
    """BBP-MAP matching of J clients' neurons (``features[j]`` is ``[L_j, d]``, observed
    with per-dimension precision ``precisions[j]`` ``[d]``) into global neurons."""
    num_clients = len(features)
    dim = features[0].shape[1]
    prior = 1.0 / sigma0
    state = GlobalLayer(np.zeros((0, dim)), np.zeros((0, dim)), np.zeros(0, dtype=np.int64),
                        [np.zeros(0, dtype=np.int64) for _ in range(num_clients)])

    def add(j: int) -> None:
        v, p = features[j], precisions[j]
        vp = v * p
        size = len(v)
        existing = state.natural.shape[0]
        inv = 1.0 / (state.precision + p)  # [L, d]
        gain_old = ((state.natural ** 2 * inv).sum(1) - (state.natural ** 2 / state.precision)
                    .sum(1))[None, :] + 2.0 * vp @ (state.natural * inv).T + (vp ** 2) @ inv.T
        gain_old += 2.0 * np.log(state.counts / (num_clients - state.counts))[None, :]
        gain_new = ((vp ** 2) / (prior + p)).sum(1)[:, None] + 2.0 * np.log(gamma / num_clients)
        gain_new = gain_new - 2.0 * np.log(np.arange(1, size + 1))[None, :]
        _, cols = linear_sum_assignment(np.hstack([gain_old, gain_new]), maximize=True)
        # every row is assigned (L_j rows <= L + L_j columns); rows come back in order
        is_new = cols >= existing
        target = cols.astype(np.int64)
        target[is_new] = existing + np.arange(int(is_new.sum()))
        added = int(is_new.sum())
        state.natural = np.vstack([state.natural, np.zeros((added, dim))])
        state.precision = np.vstack([state.precision, np.full((added, dim), prior)])
        state.counts = np.concatenate([state.counts, np.zeros(added, dtype=np.int64)])
        state.natural[target] += vp
        state.precision[target] += p
        state.counts[target] += 1
        state.assignment[j] = target

    def remove(j: int) -> None:
        target = state.assignment[j]
        state.natural[target] -= features[j] * precisions[j]
        state.precision[target] -= precisions[j]
        state.counts[target] -= 1
        keep = state.counts > 0
        if not keep.all():
            new_index = np.cumsum(keep) - 1
            state.natural, state.precision = state.natural[keep], state.precision[keep]
            state.counts = state.counts[keep]
            for other in range(num_clients):
                if other != j:
                    state.assignment[other] = new_index[state.assignment[other]]
        state.assignment[j] = np.zeros(0, dtype=np.int64)

    for j in sorted(range(num_clients), key=lambda j: -len(features[j])):
        add(j)
    for _ in range(iters):
        for j in rng.permutation(num_clients):
            remove(int(j))
            add(int(j))
    return state


@dataclass(frozen=True)
class ClientMLP:
    """One client's MLP as float64 layers (weights ``[out, in]``, biases or None)."""

    weights: list[np.ndarray]
    biases: list[np.ndarray | None]
    class_share: np.ndarray | None  # [K] share of each class held by this client


def match_mlps(clients: Sequence[ClientMLP], sigma: float, sigma0: float, gamma: float,
               iters: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """Multilayer PFNM (top hidden layer down); returns the global weights and biases."""
    rng = np.random.default_rng(seed)
    depth = len(clients[0].weights)  # linear layers: hidden + output
    if depth < 2:
        raise ValueError("pfnm matches hidden neurons: the MLP needs >= 1 hidden layer")
    has_bias = clients[0].biases[0] is not None
    obs = 1.0 / sigma
    out_weights: list[np.ndarray] = [np.zeros(0)] * depth  # global weights of each layer
    out_biases: list[np.ndarray | None] = [None] * depth
    upper: GlobalLayer | None = None  # matching of the layer above
    for c in range(depth - 2, -1, -1):  # hidden layer c = output of linear layer c
        features, precisions = [], []
        for j, client in enumerate(clients):
            w_next = client.weights[c + 1]  # [L_{c+1}^j, L_c^j]
            if upper is None:  # top hidden layer: outgoing weights to the classes
                outgoing = w_next.T
                p_out = obs * (client.class_share if client.class_share is not None
                               else np.ones(w_next.shape[0]))
            else:  # re-index into the global neurons of layer c+1 (unheld: precision 0)
                outgoing = np.zeros((w_next.shape[1], upper.natural.shape[0]))
                outgoing[:, upper.assignment[j]] = w_next.T
                p_out = np.zeros(upper.natural.shape[0])
                p_out[upper.assignment[j]] = obs
            parts = [client.weights[0]] if c == 0 else []
            p_parts = [np.full(client.weights[0].shape[1], obs)] if c == 0 else []
            if has_bias:
                parts.append(client.biases[c][:, None])
                p_parts.append(np.array([obs]))
            features.append(np.hstack([*parts, outgoing]))
            precisions.append(np.concatenate([*p_parts, p_out]))
        state = match_layer(features, precisions, sigma0, gamma, iters, rng)
        theta = state.theta
        start = clients[0].weights[0].shape[1] if c == 0 else 0
        if c == 0:
            out_weights[0] = theta[:, :start]
        if has_bias:
            out_biases[c] = theta[:, start]
            start += 1
        out_weights[c + 1] = theta[:, start:].T
        upper = state
    if has_bias:
        out_biases[-1] = _output_bias(clients, obs, 1.0 / sigma0)
    return out_weights, out_biases


def _output_bias(clients: Sequence[ClientMLP], obs: float, prior: float) -> np.ndarray:
    """Class-share weighted posterior mean of the output biases (prior mean 0)."""
    num = np.zeros_like(clients[0].biases[-1])
    den = np.full_like(num, prior)
    for client in clients:
        p = obs * (client.class_share if client.class_share is not None else 1.0)
        num += p * client.biases[-1]
        den += p
    return num / den


class PFNM(FusionStrategy):
    """BBP-MAP neuron matching of MLPs into one (wider) global MLP.

    Parameters
    ----------
    sigma : float, default 1.0
        Variance sigma^2 of local neurons around their global neuron.
    sigma0 : float, default 1.0
        Prior variance sigma0^2 of a global neuron.
    gamma : float, default 1.0
        Beta-Bernoulli process mass gamma0 (larger = more new neurons).
    iters : int, default 5
        Passes of re-matching every client after the greedy start.
    """

    name = "pfnm"
    model_requirements = ("mlp",)
    requirement_checks = {"mlp": lambda model, name, x, first, strategy: not_an_mlp(model, name)}

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 sigma: float = 1.0, sigma0: float = 1.0,
                 gamma: float = 1.0, iters: int = 5, **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        context = self.context
        for name, value in (("sigma", sigma), ("sigma0", sigma0), ("gamma", gamma)):
            FINITE_POSITIVE.check(name, value)
        NON_NEGATIVE.check("iters", iters)
        self.sigma, self.sigma0, self.gamma, self.iters = sigma, sigma0, gamma, iters
        self._chain = self._layers(context.model_spec.name, context.model_spec.kwargs)
        if len(self._chain) < 2:
            raise ValueError("pfnm needs an MLP with at least one hidden layer")
        self._report: dict[str, Any] = {}


    def _layers(self, model: str, kwargs: dict[str, object]) -> list[Layer]:
        return layer_chain(self.context.param_shapes(model, kwargs))

    def check_upload(self, upload: ClientUpload) -> None:
        """Any MLP of the server's depth and bias setting; widths may differ."""
        if upload.model != "mlp":
            raise UploadError(upload.client_id, f"model {upload.model!r} is not the zoo's "
                              f"mlp; {TAKES}")
        chain = self._layers(upload.model, upload.model_kwargs)
        ours = [(layer.bias is not None) for layer in self._chain]
        theirs = [(layer.bias is not None) for layer in chain]
        if theirs != ours:
            raise UploadError(upload.client_id, f"mlp{upload.model_kwargs} has {len(chain) - 1}"
                              f" hidden layer(s) (bias {theirs[0]}); pfnm needs "
                              f"{len(self._chain) - 1} (bias {ours[0]}) like the server's")

    def _client(self, upload: ClientUpload, member: int, class_share: np.ndarray | None
                ) -> ClientMLP:
        weights = upload.weights(member)
        chain = self._layers(upload.model, upload.model_kwargs)
        return ClientMLP(
            weights=[np.asarray(weights[layer.weight], dtype=np.float64) for layer in chain],
            biases=[np.asarray(weights[layer.bias], dtype=np.float64) if layer.bias else None
                    for layer in chain],
            class_share=class_share,
        )

    def class_shares(self, uploads: Sequence[ClientUpload]) -> list[np.ndarray] | None:
        """n_jk / sum_j' n_j'k from the uploads' class histograms (0 where no client holds
        class k); None unless every upload carries a valid histogram."""
        num_classes = self.context.model_spec.num_classes
        counts = []
        for upload in uploads:
            histogram = upload.metrics.get("class-histogram")
            if not isinstance(histogram, list) or len(histogram) != num_classes:
                return None
            values = np.asarray(histogram, dtype=np.float64)
            if not np.all(np.isfinite(values) & (values >= 0)):
                return None
            counts.append(values)
        totals = np.maximum(np.sum(counts, axis=0), 1.0)
        return [c / totals for c in counts]

    def fuse_member(self, uploads: Sequence[ClientUpload], member: int
                    ) -> tuple[ModelSpec, dict[str, np.ndarray], dict[str, Any]]:
        """Match member ``member`` of every client holding it into one global MLP."""
        holders = [u for u in uploads if u.num_members > member]
        shares = self.class_shares(holders)
        clients = [self._client(u, member, None if shares is None else shares[i])
                   for i, u in enumerate(holders)]
        weights, biases = match_mlps(clients, self.sigma, self.sigma0, self.gamma, self.iters,
                                     seed=(self.context.seed * 1009 + member) % 2**62)
        server = self.context.model_spec
        spec = ModelSpec("mlp", server.input_shape, server.num_classes,
                         {"hidden_sizes": [int(w.shape[0]) for w in weights[:-1]],
                          "bias": biases[0] is not None})
        state: dict[str, np.ndarray] = {}
        for layer, w, b in zip(self._layers(spec.name, spec.kwargs), weights, biases,
                               strict=True):
            state[layer.weight] = w.astype(np.float32)
            if layer.bias:
                assert b is not None
                state[layer.bias] = b.astype(np.float32)
        info = {"global_hidden_sizes": spec.kwargs["hidden_sizes"],
                "client_hidden_sizes": {str(u.client_id): [len(w) for w in c.weights[:-1]]
                                        for u, c in zip(holders, clients, strict=True)},
                "class_weighted_output": shares is not None}
        return spec, state, info

    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        num_members = max(u.num_members for u in uploads)
        specs, models, infos = [], [], []
        for m in range(num_members):
            spec, state, info = self.fuse_member(uploads, m)
            specs.append(spec)
            models.append(spec.build(state))
            infos.append(info)
            log.info("[pfnm] member %d: global hidden sizes %s (clients: %s)", m,
                     info["global_hidden_sizes"], info["client_hidden_sizes"])
        self._report = {"sigma": self.sigma, "sigma0": self.sigma0, "gamma": self.gamma,
                        "iters": self.iters, "members": infos}
        return Ensemble(models, specs)

    def report(self) -> dict[str, Any]:
        return dict(self._report)
