"""Batched server-side optimisation with model selection, shared by the strategies that
maximise an objective over the weights (FedBEns, FedFisher).

R runs are stacked along a leading axis of every parameter tensor and optimised together:
Adam (and SGD) act elementwise, so this is exactly R independent runs; the gradient-norm
clip is applied per run, as ``clip_grad_norm_`` would on each run alone. Every
``eval_every`` steps (and at steps 0 and ``steps``) each run is scored, on the server
validation set (accuracy, then -NLL) when there is one, else by its objective, and each
run keeps its best iterate. With ``patience`` a run stops once its score has not improved in
that many evaluations: it keeps its best iterate and, where the objective can drop runs
(:class:`RunSubsetObjective`), leaves the batch, so the runs still going cost what they
would alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fedfusion import cuda_graphs
from fedfusion.constraints import AT_LEAST_ONE, FINITE_POSITIVE, NON_NEGATIVE
from fedfusion.core.evaluation import classification_metrics
from fedfusion.core.fusion import FusionContext
from fedfusion.core.normalization import recalibrate

log = logging.getLogger("fedfusion")

Objective = Callable[[dict[str, torch.Tensor]], torch.Tensor]  # stacked weights -> [R]


@runtime_checkable
class GraphableObjective(Protocol):
    """An objective whose evaluation can be captured in a CUDA graph: :meth:`prepare` does
    whatever reads the device (once per step, outside the graph) and says whether
    :meth:`evaluate` now uses other tensors; :meth:`evaluate` reads nothing back."""

    def __call__(self, w: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def prepare(self, w: dict[str, torch.Tensor]) -> bool: ...

    def evaluate(self, w: dict[str, torch.Tensor]) -> torch.Tensor: ...


@runtime_checkable
class RunSubsetObjective(Protocol):
    """An objective whose runs are independent and that can drop some of them:
    :meth:`keep_runs` keeps the rows ``rows`` (in that order) of whatever per-run state it
    holds, so that its next call takes ``w`` of those runs only."""

    def __call__(self, w: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def keep_runs(self, rows: Sequence[int]) -> None: ...


@dataclass
class ServerOptimiser:
    """Maximise an objective from R starting points; see the module docstring."""

    steps: int = 300
    lr: float = 1e-3
    clip: float | None = 1.0
    eval_every: int = 30
    patience: int = 0  # evaluations without a better score before a run stops; 0 = never
    optimizer: str = "adam"  # adam | sgd
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    dtype: torch.dtype = torch.float32
    #: on a CUDA device, replay each step as one CUDA graph when the objective allows it
    #: (:class:`GraphableObjective`)
    cuda_graphs: bool = True
    label: str = "server"
    trace: list[dict[str, Any]] = field(default_factory=list)
    stopped_at: int | None = None
    #: per run, the step it stopped at under ``patience`` (None: it ran every step)
    run_stops: list[int | None] = field(default_factory=list)
    best_scores: list[tuple[float, float]] = field(default_factory=list)
    #: CUDA graphs captured in the last run (None: eager steps)
    graph_captures: int | None = None

    def __post_init__(self) -> None:
        NON_NEGATIVE.check("steps", self.steps)
        AT_LEAST_ONE.check("eval_every", self.eval_every)
        FINITE_POSITIVE.check("lr", self.lr)
        if self.clip is not None:
            FINITE_POSITIVE.check("clip", self.clip)

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
        on_gpu = torch.device(device).type == "cuda"
        graphs = self.cuda_graphs and on_gpu and isinstance(objective, GraphableObjective)
        optimizer = self._optimizer(list(w.values()), on_gpu, graphs)
        stepper = self._stepper(objective, w, optimizer, graphs)
        captures = 0
        net = context.model_spec.build().to(device, self.dtype)
        best_score = [(-np.inf, -np.inf)] * runs
        best = [self._snapshot(w, buffers[r], r) for r in range(runs)]
        self.trace, self.stopped_at, self.run_stops = [], None, [None] * runs
        batch = list(range(runs))  # the run of each row of w
        keep: list[int] | None = None  # the rows that go on, when runs are to leave the batch
        stale = [0] * runs  # evaluations since the run last improved
        unchecked: list[tuple[int, torch.Tensor]] = []  # (step, objective) not yet checked
        for step in range(self.steps + 1):
            scoring = step % self.eval_every == 0 or step == self.steps
            value = stepper.value(scoring)
            if value is not None:
                unchecked.append((step, value))
            # the objectives are checked where the loop reads the device anyway (before
            # scoring, the only place it may stop), not at every step: a check waits for the
            # queued work, and steps past a bad one change nothing that is kept
            if scoring:
                assert value is not None
                self._check_finite(unchecked, batch)
                unchecked = []
                going = [i for i, r in enumerate(batch) if self.run_stops[r] is None]
                scores = self.score(net, w, value, context, buffers, recalibrate_stats,
                                    rows=going, runs=[batch[i] for i in going])
                entry: dict[str, Any] = {"step": step, "objective": [None] * runs,
                                         "score": [None] * runs}
                values = value.cpu().tolist()
                for i, score in zip(going, scores, strict=True):
                    r = batch[i]
                    entry["objective"][r], entry["score"][r] = values[i], list(score)
                    stale[r] += 1
                    if score > best_score[r]:
                        best_score[r], best[r], stale[r] = score, self._snapshot(
                            w, buffers[r], i), 0
                    if self.patience and stale[r] >= self.patience and step < self.steps:
                        self.run_stops[r] = step
                self.trace.append(entry)
                log.info("[%s] step %d/%d: objective %s | score %s", self.label, step,
                         self.steps, " ".join(f"{values[i]:.4g}" for i in going),
                         " ".join(f"{s[0]:.4f}" for s in scores))
                going = [i for i in going if self.run_stops[batch[i]] is None]
                if not going:
                    self.stopped_at = step
                    log.info("[%s] stopped at step %d: no run improved in its last %d "
                             "evaluations", self.label, step, self.patience)
                    break
                if len(going) < len(batch) and isinstance(objective, RunSubsetObjective):
                    keep = going
            if step == self.steps:
                break
            before = stepper.step()
            if value is None:
                assert before is not None
                unchecked.append((step, before.clone()))  # the graph overwrites it
            if keep is not None:
                # the stopped runs leave the batch after this step (which moved them in vain):
                # their rows of w, of Adam's state and of the objective's per-run state go,
                # and the other runs continue exactly as they would have (no objective is
                # left unchecked here: this follows a scored step)
                assert isinstance(objective, RunSubsetObjective)
                log.info("[%s] step %d: run(s) %s stopped, %d go on", self.label, step,
                         [r for r in batch if self.run_stops[r] is not None], len(keep))
                objective.keep_runs(keep)
                w, optimizer = self._keep_rows(w, optimizer, keep, on_gpu, graphs)
                captures += stepper.captures if isinstance(stepper, _GraphStepper) else 0
                stepper = self._stepper(objective, w, optimizer, graphs)
                batch, keep = [batch[i] for i in keep], None
        self.best_scores = best_score
        self.graph_captures = (captures + stepper.captures
                               if isinstance(stepper, _GraphStepper) else None)
        return [{k: v.cpu() for k, v in b.items()} for b in best]

    def _optimizer(self, params: list[torch.Tensor], on_gpu: bool,
                   graphs: bool) -> torch.optim.Optimizer:
        # on a GPU, Adam's fused kernel: one launch per step instead of one per operation
        # (capturable: its step count stays on the device, as a graph needs)
        fused = {"fused": True, "capturable": graphs} if on_gpu else {}
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr, betas=self.adam_betas,
                                    eps=self.adam_eps, **fused)
        return torch.optim.SGD(params, lr=self.lr)

    def _stepper(self, objective: Objective, w: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer, graphs: bool) -> _EagerStepper | _GraphStepper:
        if graphs:
            assert isinstance(objective, GraphableObjective)
            return _GraphStepper(objective, w, optimizer, self.clip, self.label)
        return _EagerStepper(objective, w, optimizer, self.clip)

    def _keep_rows(self, w: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                   rows: Sequence[int], on_gpu: bool, graphs: bool
                   ) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
        """The rows ``rows`` of the stacked weights and of the optimiser's per-element state
        (Adam's moments; its step count is shared), as a new optimiser over new leaves."""
        index = torch.as_tensor(rows, device=next(iter(w.values())).device)
        kept = {name: v.detach()[index].clone().requires_grad_(True) for name, v in w.items()}
        fresh = self._optimizer(list(kept.values()), on_gpu, graphs)
        for old, new in zip(w.values(), kept.values(), strict=True):
            state = optimizer.state.get(old, {})
            fresh.state[new] = {
                key: (value[index].clone() if torch.is_tensor(value) and value.ndim
                      and value.shape[0] == old.shape[0] else
                      value.clone() if torch.is_tensor(value) else value)
                for key, value in state.items()}
        return kept, fresh

    def _check_finite(self, values: Sequence[tuple[int, torch.Tensor]],
                      batch: Sequence[int]) -> None:
        """Raise at the first step whose objective is not finite in some run (``batch``: the
        run of each row)."""
        finite = torch.stack([torch.isfinite(v) for _, v in values])  # [steps, R]
        if bool(finite.all()):
            return
        first = int((~finite).any(dim=1).nonzero()[0])
        bad = [batch[i] for i in (~finite[first]).nonzero().flatten().tolist()]
        raise FloatingPointError(
            f"[{self.label}] the objective is not finite at step {values[first][0]} in run(s) "
            f"{bad}: an upload with extreme weights or curvature, or a step size that diverges")

    @staticmethod
    def _snapshot(w: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                  row: int) -> dict[str, torch.Tensor]:
        """The iterate of row ``row`` of ``w``: its parameters and the run's buffers scored
        with them."""
        return {**{k: v[row].detach().clone() for k, v in w.items()},
                **{k: v.clone() for k, v in buffers.items()}}

    @torch.no_grad()
    def score(self, net: nn.Module, w: dict[str, torch.Tensor], objective: torch.Tensor,
              context: FusionContext, buffers: Sequence[dict[str, torch.Tensor]] = (),
              recalibrate_stats: bool = False, rows: Sequence[int] | None = None,
              runs: Sequence[int] | None = None) -> list[tuple[float, float]]:
        """Per row in ``rows`` of ``w`` (default: every row), higher is better: (val accuracy,
        -val NLL), or (objective, 0); ``runs`` are those rows' runs, which index ``buffers``
        (default: the rows). With ``recalibrate_stats`` each run's buffers are first
        re-estimated on the validation inputs (and kept in ``buffers``)."""
        rows = range(objective.shape[0]) if rows is None else rows
        runs = rows if runs is None else runs
        val = context.val
        if val is None:
            return [(float(objective[i]), 0.0) for i in rows]
        # float inputs and floating buffers in the weights' precision (``dtype``); integer
        # inputs (token ids) and bool masks as they are
        x = val.x.to(context.device, self.dtype if val.x.is_floating_point() else val.x.dtype)
        scores = []
        for i, r in zip(rows, runs, strict=True):
            state = {k: v[i] for k, v in w.items()}
            if buffers:
                state.update({k: v.to(context.device, self.dtype if v.is_floating_point()
                                      else v.dtype) for k, v in buffers[r].items()})
            if recalibrate_stats and buffers and buffers[r]:
                net.load_state_dict(state)
                recalibrate(net, x)
                fresh = net.state_dict()
                buffers[r].update({k: fresh[k].detach().cpu().to(v.dtype, copy=True)
                                   for k, v in buffers[r].items()})
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
                "run_stops": list(self.run_stops),
                "cuda_graph_captures": self.graph_captures,
                "best_scores": [list(s) for s in self.best_scores], "trace": self.trace}


class _EagerStepper:
    """A step through autograd, op by op."""

    def __init__(self, objective: Objective, w: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer, clip: float | None) -> None:
        self.objective, self.w, self.optimizer, self.clip = objective, w, optimizer, clip
        self._value: torch.Tensor | None = None

    def value(self, scoring: bool) -> torch.Tensor:
        """The objective at the current point (kept for :meth:`step`'s gradient)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._value = self.objective(self.w)
        return self._value.detach()

    def step(self) -> torch.Tensor | None:
        """One ascent step from the point of the last :meth:`value`."""
        assert self._value is not None
        _ascend(self._value, self.w, self.optimizer, self.clip)
        return None


class _GraphStepper:
    """A step replayed as one CUDA graph (objective, gradient, clip and optimiser step;
    :mod:`fedfusion.cuda_graphs`): at the sizes of a FedBEns server an eager step is ~1,000
    small kernels, bound by their launches on the CPU, not by the GPU. The graph is captured
    after one eager step with the objective's current tensors (warm-up: lazy state, cached
    factors) and captured again whenever :meth:`GraphableObjective.prepare` says they
    changed. The objective at a scored point is evaluated outside the graph, without
    gradient. A capture that fails leaves the rest of the run eager (logged)."""

    def __init__(self, objective: GraphableObjective, w: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer, clip: float | None, label: str) -> None:
        self.objective, self.w, self.optimizer, self.clip = objective, w, optimizer, clip
        self.label = label
        self.device = next(iter(w.values())).device
        self.side = cuda_graphs.side_stream(self.device)
        self.replay: Callable[[], torch.Tensor] | None = None
        self.warm = False
        self.eager = False  # a capture failed: every later step is eager
        self.captures = 0

    def value(self, scoring: bool) -> torch.Tensor | None:
        """Prepare the step; the objective at the current point when scoring, else None."""
        if self.objective.prepare(self.w):
            self.replay, self.warm = None, False
        if not scoring:
            return None
        with torch.no_grad():
            return self.objective.evaluate(self.w)

    def step(self) -> torch.Tensor:
        """One ascent step; returns the objective at the point it started from."""
        if self.replay is None and (self.eager or not self.warm
                                    or cuda_graphs.capture_failed()):
            self.warm = True
            return self._eager_step()
        if self.replay is None:
            self.optimizer.zero_grad(set_to_none=True)  # gradients then live in the graph's pool
            self.replay = cuda_graphs.try_capture(self._ascent_step, self.device, self.side,
                                                  f"the {self.label} server step")
            if self.replay is None:
                self.eager = True
                return self._eager_step()
            self.captures += 1
        return self.replay()

    def _eager_step(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        return cuda_graphs.on_side_stream(self._ascent_step, self.device, self.side)

    def _ascent_step(self) -> torch.Tensor:
        value = self.objective.evaluate(self.w)
        _ascend(value, self.w, self.optimizer, self.clip)
        return value.detach()


def _ascend(value: torch.Tensor, w: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
            clip: float | None) -> None:
    """Gradient of ``value.sum()``, the per-run clip, one optimiser step up."""
    (-value.sum()).backward()
    if clip is not None:
        clip_per_run(w, clip)
    optimizer.step()


def clip_per_run(w: dict[str, torch.Tensor], max_norm: float) -> None:
    """Scale each run's gradient to norm <= max_norm, as clip_grad_norm_ on separate runs."""
    grads = [v.grad for v in w.values() if v.grad is not None]
    norms = torch.sqrt(sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads))
    scale = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *([1] * (g.ndim - 1))))
