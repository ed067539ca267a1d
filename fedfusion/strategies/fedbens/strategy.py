"""FedBEns (Talpini, Savi, Neglia, ICML 2025): one-shot FL through a Bayesian ensemble.

Each client c uploads M_c members: MAP weights w_m^c and the likelihood curvature H_m^c of a
Laplace approximation (Kronecker-factored, diagonal, or diagonal + full last layer). With
temperature T and prior N(0, sigma^2 I) the member's precision is
Lambda_m^c = H_m^c / T + I / sigma^2. The server maximises the global log posterior (Eq. 5)

    L(w) = sum_c logsumexp_m [ -log M_c + log N(w | w_m^c, (Lambda_m^c)^-1) ]
           - (C - 1) log N(w | 0, sigma^2 I)

from R = max_c M_c starting points, run r starting at the per-parameter median over clients
of member r (Algorithm 1, line 21), with Adam and a per-run gradient-norm clip, the R runs
batched into one computation (each client's logsumexp evaluated on the members that carry
weight at the current point: :class:`~fedfusion.strategies.fedbens.objective.MixtureObjective`),
each keeping its best iterate on the server validation set (or, without one, the
best-objective iterate after ``server-steps-noval`` = 100 steps, the paper's Appendix C.4
protocol): see :mod:`fedfusion.strategies.fedbens.server_optim`. The paper's prediction is
the ensemble of the R modes, p(y|x) = 1/R sum_r softmax(f(x; w_r)) (``prediction="modes"``).

Departures from the reference code: the validation set is held out from the training data
(the reference draws it from the clients' data); the starting iterate (step 0) is a
candidate of the model selection too. And by default (``starts="auto"``, ``patience=4``):
the runs start at 2 max_c M_c representative members (the weighted K-medoids of all
uploaded members) instead of the M medians, or, for a model with BatchNorm, at the
per-member sample-weighted averages; and each run stops once its validation score has not
improved in 4 evaluations, keeping its best iterate; and the prediction
(``prediction="selected"``) is the ensemble of R networks that greedy ensemble selection
(:mod:`fedfusion.core.selection`) picks on the validation set from the R modes and the
uploaded members: the modes are better one by one but agree with each other more than the
members do, and the selection trades the two at the same R forward passes.
``starts="median", patience=0, prediction="modes"`` is the paper's algorithm.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfusion.constraints import FINITE_POSITIVE, Constraint
from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.normalization import has_running_stats
from fedfusion.core.predictors import Ensemble
from fedfusion.core.selection import select_networks
from fedfusion.curvature import (
    STRUCTURES,
    StackedGaussians,
    curvature_blocks,
    curvature_from_arrays,
)
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.sections import curvature_section
from fedfusion.strategies.fedbens.objective import MixtureObjective
from fedfusion.strategies.fedbens.server_optim import ServerOptimiser
from fedfusion.strategies.fedbens.starts import clustered_starts, member_starts, per_index_starts
from fedfusion.wire import WEIGHTS, ClientUpload

#: where FedBEns' server runs start (see ``starts``)
STARTS = ("auto", "median", "mean", "members", "clustered")
#: ``starts="clustered"`` with ``num_starts=0`` runs this many times max_c M_c runs
CLUSTERED_RUNS_PER_MEMBER = 2
#: the rules of the run-count arguments, which the App's keys for them share
PATIENCE = Constraint(">= 0 (0 = run every step)", lambda v: v >= 0)
#: runs are optimised side by side, R copies of the model: a bound keeps a typo from
#: allocating without end
MAX_RUNS = 10_000
NUM_STARTS = Constraint(f"in 0..{MAX_RUNS} (0 = {CLUSTERED_RUNS_PER_MEMBER} x the members per "
                        "client)", lambda v: 0 <= v <= MAX_RUNS)
MODES = Constraint(f"in 0..{MAX_RUNS} (0 = every run)", lambda v: 0 <= v <= MAX_RUNS)
#: what FedBEns predicts with (see ``prediction``)
PREDICTIONS = ("selected", "modes")

log = logging.getLogger("fedfusion")


class FedBEns(FusionStrategy):
    """Mixture-of-Laplace global posterior, R batched Adam runs, an ensemble of R networks.

    Parameters
    ----------
    hessian_structure : {"kron", "diag", "diag_full"}, default "kron"
        The Laplace curvature the clients upload (section ``curvature.<structure>``).
    temperature : float, default 0.1
        T in the member precision H / T + I / prior_var.
    prior_var : float, default 0.1
        sigma^2 of the Gaussian prior N(0, sigma^2 I).
    steps : int, default 300
        Adam steps per mode with a validation set (best validation iterate kept).
    steps_noval : int, default 100
        Adam steps per mode without one (the last, best-objective iterate is kept: the
        paper's Appendix C.4 protocol).
    lr : float, default 1e-3
        Adam learning rate.
    clip : float, default 1.0
        Gradient-norm clip per mode.
    eval_every : int, default 30
        Steps between model-selection evaluations.
    patience : int, default 4
        A run stops once its score (validation, or objective without a validation set) has
        not improved in ``patience`` evaluations: it keeps its best iterate and leaves the
        batch, so the runs still going cost what they would alone. This changes a result
        only where a run would have improved later: with validation the runs' scores peak
        and then fall while the objective still rises (how often a run's best iterate moves:
        benchmarks/docs/starts.md). 0 = every run takes all ``steps`` (the paper's
        schedule).
    prune_margin : float, default 50.0
        Members more than this many nats below their client's best are skipped between
        refreshes (0 = evaluate every member at every step).
    refresh_every : int, default 10
        Steps between full re-evaluations of all members.
    starts : {"auto", "median", "mean", "members", "clustered"}, default "auto"
        Where the runs start. ``"median"`` (the paper's Algorithm 1): R = max_c M_c runs, run r at
        the per-parameter median over clients of member r. ``"mean"``: run r at the sample-weighted
        average of member r (FedAvg of member r); for BatchNorm networks, whose per-channel weight
        scales differ between clients, the median mixes scales and its runs start far below the
        mean's. ``"members"``: one run from every uploaded member (sum_c M_c runs, C times the
        server work), so the ensemble holds the modes nearest each client's own solutions.
        ``"clustered"``: ``num_starts`` runs from the weighted K-medoids of the members in parameter
        space (:func:`~fedfusion.strategies.fedbens.starts.clustered_starts`), the member starts
        at a bounded cost. ``"auto"``: ``"mean"`` for a model with BatchNorm running statistics
        (benchmarks/docs/real-models.md), ``"clustered"`` otherwise (with ``patience=4``: about the
        member starts' accuracy at well under twice the paper's server cost; its ensemble holds 2
        max_c M_c modes, twice the paper's prediction cost: benchmarks/docs/starts.md).
    num_starts : int, default 0
        K, the runs of ``starts="clustered"``; 0 = 2 max_c M_c (twice the paper's runs).
    modes : int, default 0
        Keep only the first ``modes`` runs (0 = all): with ``starts="median"``, ``modes=1``
        predicts with the single mode from the members-0 median, as the paper's Table 7
        returns one model (with ``"clustered"``: the run from the heaviest cluster); with
        ``prediction="selected"`` that many networks are then picked from the kept modes and
        the members (``modes=1``: the best single network on validation, mode or member).
    prediction : {"selected", "modes"}, default "selected"
        ``"modes"``: the ensemble of the modes (the paper's). ``"selected"``: as many networks
        as there are modes, picked from the modes and the uploaded members by greedy ensemble
        selection on the validation set (:func:`~fedfusion.core.selection.greedy_selection`);
        the modes without a validation set.
    dtype : torch.dtype, default torch.float32
        Precision of the server optimisation.
    cuda_graphs : bool, default True
        On a CUDA device, replay each optimiser step as one captured CUDA graph (the same
        kernels without their launch cost; benchmarks/docs/server-device.md).
    """

    name = "fedbens"
    member_fusions = ("all", "first")

    def __init__(
        self,
        model_fn: ModelFn | nn.Module | ModelSpec,
        *,
        hessian_structure: str = "kron",
        temperature: float = 0.1,
        prior_var: float = 0.1,
        steps: int = 300,
        steps_noval: int = 100,
        lr: float = 1e-3,
        clip: float = 1.0,
        eval_every: int = 30,
        patience: int = 4,
        prune_margin: float = 50.0,
        refresh_every: int = 10,
        starts: str = "auto",
        num_starts: int = 0,
        modes: int = 0,
        prediction: str = "selected",
        dtype: torch.dtype = torch.float32,
        cuda_graphs: bool = True,
        **kwargs: Any,
    ):
        super().__init__(model_fn, **kwargs)
        if hessian_structure not in STRUCTURES:
            raise ValueError(f"hessian_structure must be one of {STRUCTURES}, "
                             f"got {hessian_structure!r}")
        if starts not in STARTS:
            raise ValueError(f"starts must be one of {STARTS}, got {starts!r}")
        PATIENCE.check("patience", patience)
        NUM_STARTS.check("num_starts", num_starts)
        MODES.check("modes", modes)
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
        self.prediction = prediction
        #: the networks the last prediction runs: modes and uploaded members
        self.kept = {"modes": 0, "members": 0}
        self.starts, self.num_starts, self.modes = starts, num_starts, modes
        # without a validation set the last (best-objective) iterate is kept, so the run
        # length is the only stopping rule: the paper's 100 steps (Appendix C.4, Table 3)
        steps = steps if self.context.val is not None else steps_noval
        self.structure = hessian_structure
        self.required_sections = (WEIGHTS, curvature_section(hessian_structure))
        FINITE_POSITIVE.check("temperature", temperature)
        FINITE_POSITIVE.check("prior_var", prior_var)
        self.temperature, self.prior_var = temperature, prior_var
        self.dtype = dtype
        self.prune_margin, self.refresh_every = prune_margin, refresh_every
        self.mixture: MixtureObjective | None = None
        #: the runs (= modes kept) of the last fusion
        self.runs_used = 0
        #: seconds of the last fusion's phases: posterior (stacking the members), starts,
        #: optimise
        self.phase_seconds: dict[str, float] = {}
        self.optimiser = ServerOptimiser(steps=steps, lr=lr, clip=clip, eval_every=eval_every,
                                         patience=patience, dtype=dtype,
                                         cuda_graphs=cuda_graphs, label="fedbens")

    # ------------------------------------------------------------------ posterior
    def build_posterior(self, uploads: Sequence[ClientUpload]) -> tuple[StackedGaussians,
                                                                        torch.Tensor]:
        """All members of all clients as one stack, and the client index of each member.
        ``uploads`` passed :func:`~fedfusion.wire.validation.validate_upload` (as
        :meth:`fuse`'s did), so their curvature's values are not checked a second time."""
        spec = self.context.model_spec
        shapes = self.context.param_shapes(spec.name, spec.kwargs)
        means, curvatures, owner = [], [], []
        for c, upload in enumerate(uploads):
            for member in upload.members:
                means.append({k: torch.from_numpy(v) for k, v in member[WEIGHTS].items()})
                curvatures.append(curvature_from_arrays(
                    self.structure, member[curvature_section(self.structure)], shapes,
                    self.temperature, self.prior_var, check_input=False))
                owner.append(c)
        stacked = StackedGaussians.from_members(means, curvatures, self.context.device,
                                                dtype=self.dtype)
        return stacked, torch.tensor(owner, device=self.context.device)

    def start_rule(self) -> str:
        """The ``starts`` rule in force: ``"auto"`` resolved against the model."""
        if self.starts != "auto":
            return self.starts
        return "mean" if self._has_running_stats else "clustered"

    @functools.cached_property
    def _has_running_stats(self) -> bool:
        return has_running_stats(self.context.model_spec.build())

    def starting_points(self, uploads: Sequence[ClientUpload]) -> list[dict[str, np.ndarray]]:
        """The runs' starting points under :meth:`start_rule` (:mod:`~.starts`), the first
        ``modes`` of them where ``modes`` is set."""
        rule = self.start_rule()
        parameters = set(self.context.model_spec.param_shapes().parameters)
        per_client = max(u.num_members for u in uploads)
        if rule == "members":
            starts = member_starts(uploads)
        elif rule == "clustered":
            k = self.num_starts or CLUSTERED_RUNS_PER_MEMBER * per_client
            starts = clustered_starts(uploads, parameters, k)
        else:  # only the runs that are kept
            runs = min(per_client, self.modes) if self.modes else per_client
            starts = per_index_starts(uploads, parameters, runs, rule, self.context.device)
        return starts[: self.modes or None]

    # ------------------------------------------------------------------ fusion
    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        spec = self.context.model_spec
        with self._phase("posterior"):
            stacked, owner = self.build_posterior(uploads)
        with self._phase("starts"):
            starts = self.starting_points(uploads)
        with self._phase("optimise"):
            modes = self.optimise(starts, stacked, owner, len(uploads))
        self.runs_used = len(starts)
        networks = [spec.build(mode) for mode in modes]
        self.kept = {"modes": len(networks), "members": 0}
        val = self.context.val
        if self.prediction == "selected" and val is not None and len(val):
            pool = networks + [m for u in uploads for m in self.context.member_models(u)]
            with self._phase("selection"):
                keep = select_networks(pool, val, len(networks), self.context.device)
            networks = [pool[i] for i in keep]
            self.kept = {"modes": sum(i < len(modes) for i in keep),
                         "members": sum(i >= len(modes) for i in keep)}
            log.info("[fedbens] prediction: %d mode(s) and %d uploaded member(s), picked on "
                     "validation", self.kept["modes"], self.kept["members"])
        return Ensemble(networks, [spec] * len(networks))

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Time one phase of :meth:`fuse` into :attr:`phase_seconds` (the device's queued
        work included)."""
        start = time.perf_counter()
        yield
        if self.context.device.type == "cuda":
            torch.cuda.synchronize(self.context.device)
        self.phase_seconds[name] = time.perf_counter() - start

    def optimise(self, starts: Sequence[dict[str, np.ndarray]], stacked: StackedGaussians,
                 owner: torch.Tensor, num_clients: int) -> list[dict[str, torch.Tensor]]:
        """Maximise the objective from each start (batched); return each run's best iterate."""
        log.info("[fedbens] %d clients, %d components (%s), %d run(s) x %d Adam steps on %s",
                 num_clients, stacked.num_components, self.structure, len(starts),
                 self.optimiser.steps, self.context.device)
        # Eq. 5 (objective.mixture_log_posterior), evaluated on the components that carry weight
        self.mixture = MixtureObjective(stacked, owner, num_clients, self.prior_var,
                                        self.prune_margin, self.refresh_every)
        return self.optimiser.maximise(self.mixture, starts, self.context,
                                       recalibrate_stats=self.norm_stats == "recalibrate")

    def report(self) -> dict[str, Any]:
        return {"structure": self.structure, "temperature": self.temperature,
                "curvature_blocks": curvature_blocks(
                    self.structure, self.context.model_spec.param_shapes()),
                # what ran (the requested 0 = "auto" resolved): runs from as many starts,
                # each run's best iterate a mode, one forward pass per mode
                "starts": self.start_rule(), "num_starts": self.runs_used,
                "modes": self.runs_used, "forward_passes": sum(self.kept.values()),
                "prediction": self.prediction, "prediction_networks": dict(self.kept),
                "num_starts_requested": self.num_starts, "modes_requested": self.modes,
                "prior_var": self.prior_var,
                "selection": "validation" if self.context.val is not None else "objective",
                "mixture": self.mixture.report() if self.mixture is not None else {},
                "phase_seconds": dict(self.phase_seconds),
                **self.optimiser.report()}
