"""Batched server-side optimisation with model selection, shared by the strategies that
maximise an objective over the weights (FedBEns, FedFisher).

R runs are stacked along a leading axis of every parameter tensor and optimised together:
Adam (and SGD) act elementwise, so this is exactly R independent runs; the gradient-norm
clip is applied per run, as ``clip_grad_norm_`` would on each run alone. Every
``eval_every`` steps (and at steps 0 and ``steps``) each run is scored, on the server
validation set (accuracy, then -NLL) when there is one, else by its objective, and each
run keeps its best iterate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fedfusion.evaluation import classification_metrics
from fedfusion.normalization import recalibrate
from fedfusion.strategies.fusion import FusionContext

log = logging.getLogger("fedfusion")

Objective = Callable[[dict[str, torch.Tensor]], torch.Tensor]  # stacked weights -> [R]


@dataclass
class ServerOptimiser:
    """Maximise an objective from R starting points; see the module docstring."""

    steps: int = 300
    lr: float = 1e-3
    clip: float | None = 1.0
    eval_every: int = 30
    patience: int = 0  # evaluations without a better score before stopping; 0 = never
    optimizer: str = "adam"  # adam | sgd
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    dtype: torch.dtype = torch.float32
    label: str = "server"
    trace: list[dict[str, Any]] = field(default_factory=list)
    stopped_at: int | None = None
    best_scores: list[tuple[float, float]] = field(default_factory=list)

    def maximise(self, objective: Objective, starts: Sequence[dict[str, np.ndarray]],
                 context: FusionContext, recalibrate_stats: bool = False
                 ) -> list[dict[str, torch.Tensor]]:
        """Return each run's best iterate (CPU tensors) after ``steps`` steps.
        ``recalibrate_stats``: every scored iterate gets BatchNorm statistics re-estimated on
        the validation inputs first (the ``norm_stats="recalibrate"`` rule), so that the
        model selection sees the statistics the chosen iterate will keep."""
        device, runs = context.device, len(starts)
        # the objective moves the parameters; buffers (running statistics, counters) stay as
        # each start has them (the strategy's normalisation-statistics rule decides them)
        parameters = set(context.model_spec.param_shapes().parameters)
        w = {name: torch.tensor(np.stack([s[name] for s in starts]), dtype=self.dtype,
                                device=device, requires_grad=True)
             for name in starts[0] if name in parameters}
        buffers = [{name: torch.as_tensor(s[name]) for name in s if name not in parameters}
                   for s in starts]
        params = list(w.values())
        optimizer = (torch.optim.Adam(params, lr=self.lr, betas=self.adam_betas, eps=self.adam_eps)
                     if self.optimizer == "adam" else torch.optim.SGD(params, lr=self.lr))
        net = context.model_spec.build().to(device)
        best_score = [(-np.inf, -np.inf)] * runs
        best = [self._snapshot(w, buffers, r) for r in range(runs)]
        self.trace, self.stopped_at = [], None
        stale = 0  # evaluations since any run last improved
        for step in range(self.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            value = objective(w)
            if not torch.isfinite(value).all():
                bad = [r for r in range(runs) if not torch.isfinite(value[r])]
                raise FloatingPointError(
                    f"[{self.label}] the objective is not finite at step {step} in run(s) {bad}: "
                    "an upload with extreme weights or curvature, or a step size that diverges")
            if step % self.eval_every == 0 or step == self.steps:
                scores = self.score(net, w, value.detach(), context, buffers,
                                    recalibrate_stats)
                stale += 1
                for r, score in enumerate(scores):
                    if score > best_score[r]:
                        best_score[r] = score
                        best[r] = self._snapshot(w, buffers, r)
                        stale = 0
                self.trace.append({"step": step, "objective": value.detach().cpu().tolist(),
                                   "score": [list(s) for s in scores]})
                log.info("[%s] step %d/%d: objective %s | score %s", self.label, step,
                         self.steps, " ".join(f"{v:.4g}" for v in value.tolist()),
                         " ".join(f"{s[0]:.4f}" for s in scores))
            if step == self.steps:
                break
            if self.patience and stale >= self.patience:
                self.stopped_at = step
                log.info("[%s] stopped at step %d: no run improved in the last %d evaluations",
                         self.label, step, self.patience)
                break
            (-value.sum()).backward()
            if self.clip is not None:
                clip_per_run(w, self.clip)
            optimizer.step()
        self.best_scores = best_score
        return [{k: v.cpu() for k, v in b.items()} for b in best]

    @staticmethod
    def _snapshot(w: dict[str, torch.Tensor], buffers: Sequence[dict[str, torch.Tensor]],
                  run: int) -> dict[str, torch.Tensor]:
        """Run ``run``'s current iterate: its parameters and the buffers scored with them."""
        return {**{k: v[run].detach().clone() for k, v in w.items()},
                **{k: v.clone() for k, v in buffers[run].items()}}

    @torch.no_grad()
    def score(self, net: nn.Module, w: dict[str, torch.Tensor], objective: torch.Tensor,
              context: FusionContext, buffers: Sequence[dict[str, torch.Tensor]] = (),
              recalibrate_stats: bool = False) -> list[tuple[float, float]]:
        """Per run, higher is better: (val accuracy, -val NLL), or (objective, 0). With
        ``recalibrate_stats`` each run's buffers are first re-estimated on the validation
        inputs (and kept in ``buffers``)."""
        val = context.val
        if val is None:
            return [(float(v), 0.0) for v in objective]
        x = val.x.to(context.device)
        scores = []
        for r in range(objective.shape[0]):
            state = {k: v[r] for k, v in w.items()}
            if buffers:
                state.update({k: v.to(context.device) for k, v in buffers[r].items()})
            if recalibrate_stats and buffers and buffers[r]:
                net.load_state_dict(state)
                recalibrate(net, x)
                fresh = net.state_dict()
                buffers[r].update({k: fresh[k].detach().cpu().clone() for k in buffers[r]})
                state.update({k: fresh[k] for k in buffers[r]})
            logits = functional_call(net, state, (x,))
            metrics = classification_metrics(torch.log_softmax(logits, -1).float().cpu(), val.y)
            scores.append((metrics["accuracy"], -metrics["nll"]))
        return scores

    def report(self) -> dict[str, Any]:
        return {"steps": self.steps, "lr": self.lr, "clip": self.clip,
                "optimizer": self.optimizer, "adam_betas": list(self.adam_betas),
                "adam_eps": self.adam_eps, "eval_every": self.eval_every,
                "patience": self.patience, "stopped_at": self.stopped_at,
                "best_scores": [list(s) for s in self.best_scores], "trace": self.trace}


def clip_per_run(w: dict[str, torch.Tensor], max_norm: float) -> None:
    """Scale each run's gradient to norm <= max_norm, as clip_grad_norm_ on separate runs."""
    grads = [v.grad for v in w.values() if v.grad is not None]
    norms = torch.sqrt(sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads))
    scale = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *([1] * (g.ndim - 1))))
