"""FedBEns (Talpini, Savi, Neglia, ICML 2025): one-shot FL through a Bayesian ensemble.

Each client c uploads M_c members: MAP weights w_m^c and the likelihood curvature H_m^c of a
Laplace approximation (Kronecker-factored, diagonal, or diagonal + full last layer). With
temperature T and prior N(0, sigma^2 I) the member's precision is
Lambda_m^c = H_m^c / T + I / sigma^2. The server maximises the global log posterior (Eq. 5)

    L(w) = sum_c logsumexp_m [ -log M_c + log N(w | w_m^c, (Lambda_m^c)^-1) ]
           - (C - 1) log N(w | 0, sigma^2 I)

from R = max_c M_c starting points, run r starting at the per-parameter median over clients
of member r (Algorithm 1, line 21). The R runs are one batched computation: Adam is
elementwise, so stacking the runs along a leading axis gives exactly R independent runs;
the gradient-norm clip is applied per run. Every ``eval_every`` steps each run's iterate is
scored, on the server validation set (accuracy, then NLL) when there is one, else by the
objective, and each run keeps its best iterate. The prediction is the ensemble of the R
modes, p(y|x) = 1/R sum_r softmax(f(x; w_r)).

Departures from the reference code: the validation set is held out from the training data
(the reference draws it from the clients' data); the starting iterate (step 0) is a
candidate of the model selection too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fedfusion.curvature import StackedGaussians, curvature_from_arrays, mixture_log_posterior
from fedfusion.evaluation import classification_metrics
from fedfusion.payload import WEIGHTS, ClientUpload
from fedfusion.predictors import Ensemble
from fedfusion.strategies.base import FusionContext, FusionStrategy
from fedfusion.uploads import curvature_section

log = logging.getLogger("fedfusion")


class FedBEns(FusionStrategy):
    """Mixture-of-Laplace global posterior, R batched Adam runs, ensemble of the modes."""

    name = "fedbens"

    def __init__(
        self,
        context: FusionContext,
        num_clients: int,
        *,
        hessian_structure: str = "kron",
        temperature: float = 0.1,
        prior_var: float = 0.1,
        steps: int = 300,
        lr: float = 1e-3,
        clip: float = 1.0,
        eval_every: int = 30,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__(context, num_clients)
        self.structure = hessian_structure
        self.required_sections = (WEIGHTS, curvature_section(hessian_structure))
        self.temperature, self.prior_var = temperature, prior_var
        self.steps, self.lr, self.clip, self.eval_every = steps, lr, clip, eval_every
        self.dtype = dtype
        self.trace: list[dict[str, Any]] = []

    @classmethod
    def from_settings(cls, context: FusionContext, settings: Any) -> FedBEns:
        return cls(context, settings.num_clients, hessian_structure=settings.hessian_structure,
                   temperature=settings.temperature, prior_var=settings.prior_var,
                   steps=settings.server_steps, lr=settings.server_lr, clip=settings.server_clip,
                   eval_every=settings.server_eval_every)

    # ------------------------------------------------------------------ posterior
    def build_posterior(self, uploads: Sequence[ClientUpload]) -> tuple[StackedGaussians,
                                                                        torch.Tensor]:
        """All members of all clients as one stack, and the client index of each member."""
        spec = self.context.model_spec
        shapes = dict(self.context.param_shapes(spec.name, spec.kwargs))
        means, curvatures, owner = [], [], []
        for c, upload in enumerate(uploads):
            for member in upload.members:
                means.append({k: torch.from_numpy(v) for k, v in member[WEIGHTS].items()})
                curvatures.append(curvature_from_arrays(
                    self.structure, member[curvature_section(self.structure)], shapes,
                    self.temperature, self.prior_var))
                owner.append(c)
        stacked = StackedGaussians.from_members(means, curvatures, self.context.device,
                                                dtype=self.dtype)
        return stacked, torch.tensor(owner, device=self.context.device)

    def objective(self, w: dict[str, torch.Tensor], stacked: StackedGaussians,
                  owner: torch.Tensor, num_clients: int) -> torch.Tensor:
        """``[R]`` global log posterior (Eq. 5) at the R stacked points ``w``."""
        return mixture_log_posterior(w, stacked, owner, num_clients, self.prior_var)

    @staticmethod
    def starting_points(uploads: Sequence[ClientUpload]) -> list[dict[str, np.ndarray]]:
        """Run r starts at the per-parameter median over the clients that have member r."""
        runs = max(u.num_members for u in uploads)
        starts = []
        for r in range(runs):
            holders = [u.weights(r) for u in uploads if u.num_members > r]
            starts.append({name: np.median(np.stack([h[name] for h in holders]), axis=0)
                           for name in holders[0]})
        return starts

    # ------------------------------------------------------------------ fusion
    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        spec = self.context.model_spec
        stacked, owner = self.build_posterior(uploads)
        modes = self.optimise(self.starting_points(uploads), stacked, owner, len(uploads))
        return Ensemble([spec.build(mode) for mode in modes], [spec] * len(modes))

    def optimise(self, starts: Sequence[dict[str, np.ndarray]], stacked: StackedGaussians,
                 owner: torch.Tensor, num_clients: int) -> list[dict[str, torch.Tensor]]:
        """Maximise the objective from each start (batched); return each run's best iterate."""
        device = self.context.device
        runs = len(starts)
        w = {name: torch.tensor(np.stack([s[name] for s in starts]), dtype=self.dtype,
                                device=device, requires_grad=True) for name in starts[0]}
        optimizer = torch.optim.Adam(list(w.values()), lr=self.lr)
        net = self.context.model_spec.build().to(device)
        best_score = [(-np.inf, -np.inf)] * runs
        best = [{k: v[r].detach().clone() for k, v in w.items()} for r in range(runs)]
        self.trace = []
        log.info("[fedbens] %d clients, %d components (%s), %d run(s) x %d Adam steps on %s",
                 num_clients, stacked.num_components, self.structure, runs, self.steps, device)
        for step in range(self.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            objective = self.objective(w, stacked, owner, num_clients)
            if step % self.eval_every == 0 or step == self.steps:
                scores = self._score(net, w, objective.detach())
                for r, score in enumerate(scores):
                    if score > best_score[r]:
                        best_score[r] = score
                        best[r] = {k: v[r].detach().clone() for k, v in w.items()}
                self.trace.append({"step": step, "objective": objective.detach().cpu().tolist(),
                                   "score": [list(s) for s in scores]})
                log.info("[fedbens] step %d/%d: objective %s | score %s", step, self.steps,
                         " ".join(f"{v:.4g}" for v in objective.tolist()),
                         " ".join(f"{s[0]:.4f}" for s in scores))
            if step == self.steps:
                break
            (-objective.sum()).backward()
            self._clip_per_run(w)
            optimizer.step()
        self.best_scores = best_score
        return [{k: v.cpu() for k, v in b.items()} for b in best]

    def _clip_per_run(self, w: dict[str, torch.Tensor]) -> None:
        """Scale each run's gradient to norm <= clip, as clip_grad_norm_ on separate runs."""
        grads = [v.grad for v in w.values()]
        norms = torch.sqrt(sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads))
        scale = torch.clamp(self.clip / (norms + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.view(-1, *([1] * (g.ndim - 1))))

    @torch.no_grad()
    def _score(self, net: nn.Module, w: dict[str, torch.Tensor], objective: torch.Tensor
               ) -> list[tuple[float, float]]:
        """Per run, higher is better: (val accuracy, -val NLL), or (objective, 0)."""
        val = self.context.val
        if val is None:
            return [(float(v), 0.0) for v in objective]
        x = val.x.to(self.context.device)
        scores = []
        for r in range(objective.shape[0]):
            params = {k: v[r] for k, v in w.items()}
            log_probs = torch.log_softmax(functional_call(net, params, (x,)), dim=-1)
            metrics = classification_metrics(log_probs.float().cpu(), val.y)
            scores.append((metrics["accuracy"], -metrics["nll"]))
        return scores

    def report(self) -> dict[str, Any]:
        return {"structure": self.structure, "temperature": self.temperature,
                "prior_var": self.prior_var, "steps": self.steps, "lr": self.lr,
                "selection": "validation" if self.context.val is not None else "objective",
                "best_scores": [list(s) for s in getattr(self, "best_scores", [])],
                "trace": self.trace}
