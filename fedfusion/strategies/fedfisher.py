"""FedFisher (Jhunjhunwala, Wang, Joshi, AISTATS 2024): one-shot FL by Fisher-weighted
quadratic approximations of the clients' losses.

Client i (n_i samples, weights w_i, mean Fisher F_i) stands for its loss by the quadratic
1/2 (w - w_i)^T F_i (w - w_i); with p_i = n_i / n, n = sum_i n_i, the server minimises

    f(w) = sum_i p_i / 2 (w - w_i)^T F_i (w - w_i)
         = 1 / (2 n) sum_i (w - w_i)^T H_i (w - w_i),

since our uploads hold the GGN SUMMED over the client's samples, H_i = n_i F_i (laplace-torch's
exact GGN = the Fisher of the softmax likelihood; nngeometry's ``classif_logits`` FIM of the
reference code is the same matrix averaged over samples). ``hessian_structure`` picks the
structure of H_i: ``kron`` is FedFisher (K-FAC), H_i ~= B_i (x) A_i per layer, ``diag`` is
FedFisher (Diag); ``diag_full`` is not part of FedFisher and is refused. H_i is rebuilt with the
Laplace machinery (:func:`fedfusion.curvature.curvature_from_arrays` with T = 1) and the
quadratic forms are evaluated by :meth:`StackedGaussians.quadratic_form`, so K-FAC is never
formed densely. ``curvature_from_arrays`` always adds ``I / prior_var``: we pass
``prior_var = 1 / damping`` with ``damping = 1e-6`` by default, i.e. f is evaluated with
H_i + 1e-6 I. Against a GGN summed over a client's samples this is negligible (the reference
code has no damping); it only makes the minimiser unique in directions no
client's curvature sees, where it pulls (imperceptibly, from the FedAvg start) towards the
clients' unweighted mean.

Like the reference, the server starts at the FedAvg solution sum_i p_i w_i and takes ``steps``
(2000) gradient steps of lr 0.01, keeping the iterate with the best validation accuracy among
those scored every ``eval_every`` (100) steps; without a validation set, the best objective.
With M members per client it runs one FedFisher per member index m (over the clients that
have member m, batched as R = max M runs) and predicts with the ensemble of the R results;
M = 1 is the paper's setting.

Departures from the reference code (github.com/Divyansh03/FedFisher, ``algs/fisher_avg.py``):

- optimiser: the reference hand-writes an Adam-like rule without bias correction,
  ``m <- g + 0.9 m``, ``v <- g^2 + 0.99 v``, ``w <- w - eta m / (sqrt(v) + 0.01)``, which is
  Adam with betas (0.9, 0.99) and an effective eps of 1e-3 up to bias correction. We use
  ``torch.optim.Adam`` with betas (0.9, 0.99), eps 1e-3 (bias-corrected) at the same lr.
  This matters for K-FAC, where torch's default Adam lands several points below both
  (benchmarks/docs/fedbens.md). ``optimizer="sgd"`` is available, for which the scale of
  f matters: f is on the mean-Fisher scale (H / n), so SGD needs
  ``lr < 2 / lambda_max(sum_i p_i F_i)``;
- no gradient clipping by default (``clip=None``), as the reference;
- the FedAvg start (step 0) is a model-selection candidate too, and ties in validation accuracy
  are broken by validation NLL (the reference keeps the first best accuracy among the iterates
  after steps 1, 101, ...);
- no 15-bit quantisation of weights and Fisher and no low-rank compression of the K-FAC
  factors (the reference compresses to match FedAvg's upload size; here the clients'
  ``curvature-rank`` / ``curvature-half`` settings play that role);
- the validation set is held out from the training data (the reference samples it from the
  clients' data).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.predictors import Ensemble
from fedfusion.core.state import weighted_average
from fedfusion.curvature import StackedGaussians, curvature_blocks, curvature_from_arrays
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.sections import curvature_section
from fedfusion.strategies.fedbens.server_optim import ServerOptimiser
from fedfusion.wire import WEIGHTS, ClientUpload

log = logging.getLogger("fedfusion")

#: structure name -> FedFisher variant
VARIANTS = {"kron": "K-FAC", "diag": "Diag"}


class FedFisherProblem:
    """f_r(w) = 1 / (2 n_r) sum_{i holds member r} (w - w_{i,r})^T (H_{i,r} + damping I)
    (w - w_{i,r}) for each member index r, with n_r the holders' total sample count."""

    def __init__(self, stacks: Sequence[StackedGaussians], totals: Sequence[int]):
        self.stacks = list(stacks)
        self.scales = [1.0 / (2.0 * n) for n in totals]

    @property
    def runs(self) -> int:
        return len(self.stacks)

    def value(self, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[R]``: f_r at the R stacked points ``w`` (w[name] is ``[R, *shape]``)."""
        return torch.stack([
            stack.quadratic_form({k: v[r:r + 1] for k, v in w.items()}).sum() * scale
            for r, (stack, scale) in enumerate(zip(self.stacks, self.scales, strict=True))
        ])


class FedFisher(FusionStrategy):
    """Minimise the p-weighted sum of the clients' Fisher quadratics from the FedAvg point.

    Parameters
    ----------
    hessian_structure : {"kron", "diag"}, default "kron"
        FedFisher K-FAC or FedFisher Diag (section ``curvature.<structure>``).
    steps : int, default 2000
        Optimiser steps per member index.
    lr : float, default 0.01
        Learning rate.
    eval_every : int, default 100
        Steps between model-selection evaluations.
    optimizer : {"adam", "sgd"}, default "adam"
        The server optimiser (Adam as the official FedFisher code).
    clip : float, optional
        Gradient-norm clip per run (None = no clip).
    damping : float, default 1e-6
        Added to every curvature (H + damping I).
    dtype : torch.dtype, default torch.float32
        Precision of the server optimisation.
    """

    name = "fedfisher"
    one_shot_only = False  # one model per member index, like FedAvg: multi-round FedFisher

    def __init__(
        self,
        model_fn: ModelFn | nn.Module | ModelSpec,
        *,
        hessian_structure: str = "kron",
        steps: int = 2000,
        lr: float = 0.01,
        eval_every: int = 100,
        optimizer: str = "adam",
        clip: float | None = None,
        damping: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ):
        super().__init__(model_fn, **kwargs)
        if hessian_structure not in VARIANTS:
            raise ValueError(
                f"fedfisher needs hessian_structure 'kron' (FedFisher K-FAC) or 'diag' "
                f"(FedFisher Diag), got {hessian_structure!r}")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"fedfisher optimizer must be 'adam' or 'sgd', got {optimizer!r}")
        if not damping > 0:
            raise ValueError(f"fedfisher damping must be > 0, got {damping}")
        self.structure = hessian_structure
        self.required_sections = (WEIGHTS, curvature_section(hessian_structure))
        self.damping = damping
        self.dtype = dtype
        # The official FedFisher update is Adam with betas (0.9, 0.99) and eps ~1e-3 (no bias
        # correction); PyTorch's defaults cost K-FAC accuracy (see the module docstring).
        self.optimiser = ServerOptimiser(steps=steps, lr=lr, clip=clip, eval_every=eval_every,
                                         optimizer=optimizer, adam_betas=(0.9, 0.99),
                                         adam_eps=1e-3, dtype=dtype, label="fedfisher")


    # ------------------------------------------------------------------ objective
    def build_problem(self, uploads: Sequence[ClientUpload]) -> FedFisherProblem:
        """One stack of (w_{i,r}, H_{i,r} + damping I) per member index r, from validated
        uploads (their curvature's values are not checked a second time)."""
        spec = self.context.model_spec
        shapes = self.context.param_shapes(spec.name, spec.kwargs)
        section = curvature_section(self.structure)
        stacks, totals = [], []
        for r in range(max(u.num_members for u in uploads)):
            holders = [u for u in uploads if u.num_members > r]
            means = [{k: torch.from_numpy(v) for k, v in u.weights(r).items()} for u in holders]
            curvatures = [curvature_from_arrays(self.structure, u.members[r][section], shapes,
                                                temperature=1.0, prior_var=1.0 / self.damping,
                                                check_input=False)
                          for u in holders]
            stacks.append(StackedGaussians.from_members(means, curvatures, self.context.device,
                                                        dtype=self.dtype))
            totals.append(sum(u.num_examples for u in holders))
        return FedFisherProblem(stacks, totals)

    @staticmethod
    def starting_points(uploads: Sequence[ClientUpload]) -> list[dict[str, np.ndarray]]:
        """Run r starts at FedAvg of member r: sum_i n_i w_{i,r} / sum_i n_i over holders."""
        starts = []
        for r in range(max(u.num_members for u in uploads)):
            holders = [u for u in uploads if u.num_members > r]
            starts.append(weighted_average([u.weights(r) for u in holders],
                                           [u.num_examples for u in holders]))
        return starts

    # ------------------------------------------------------------------ fusion
    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        spec = self.context.model_spec
        modes = self.optimise(self.starting_points(uploads), self.build_problem(uploads))
        return Ensemble([spec.build(mode) for mode in modes], [spec] * len(modes))

    def optimise(self, starts: Sequence[dict[str, np.ndarray]], problem: FedFisherProblem
                 ) -> list[dict[str, torch.Tensor]]:
        """Minimise every f_r from its start (batched); return each run's best iterate."""
        log.info("[fedfisher] FedFisher (%s): %d run(s) x %d %s steps on %s",
                 VARIANTS[self.structure], problem.runs, self.optimiser.steps,
                 self.optimiser.optimizer, self.context.device)
        return self.optimiser.maximise(lambda w: -problem.value(w), starts, self.context,
                                       recalibrate_stats=self.norm_stats == "recalibrate")

    def report(self) -> dict[str, Any]:
        return {"structure": self.structure, "variant": VARIANTS[self.structure],
                "curvature_blocks": curvature_blocks(
                    self.structure, self.context.model_spec.param_shapes()),
                "damping": self.damping,
                "selection": "validation" if self.context.val is not None else "objective",
                **self.optimiser.report()}
