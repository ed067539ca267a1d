"""Co-Boosting (Dai et al., ICLR 2024): DENSE with hard samples and a re-weighted ensemble.

Built on :class:`~fedfusion.strategies.datafree.dense.Dense` (same generator, pool, student, data
range, statistics term and validation-based best-iterate selection; its ``dense-*`` knobs).
Per iteration t, with members f_1..f_K (every member of every client):

* the teacher is a weighted mean of the members' logits,

      t_w(x) = sum_k pi_k f_k(x),   pi = w / sum_k w_k  (on the simplex),  w in [0, 1]^K,

  w starting uniform (the authors' parametrisation: raw weights clipped to [0, 1] and
  normalised in the forward);
* the generator minimises DENSE's L_G with the class term replaced by the hard-sample loss

      L_H = mean_i (1 - p_{y_i}(x_i))^beta CE(t_w(x_i), y_i),   p = softmax(t_w), (1-p) detached

  (``hardness`` beta; 0 is DENSE's CE): samples the ensemble already classifies confidently
  weigh less;
* hard samples: a batch x drawn from the pool is moved ``perturb_steps`` signed-gradient
  steps of size ``epsilon`` and clipped to the data range [low, high] per channel,

      x <- clip(x + epsilon sign(grad_x J(x)), low, high),

  with J the authors' on-the-fly diversification (``perturbation="ods"``, ODS of Tashiro et
  al. 2020): J(x) = sum_i r_i . softmax(t_w(x_i) / 4), r_i ~ U[-1, 1]^C drawn once per batch;
  or (``"kl"``) the student-ensemble disagreement J(x) = sum_i KL(p_t,i || p_s,i);
* ensemble re-weighting: on a hard batch (x^, y) (y: the labels the generator was asked for)
  ``weight_steps`` signed-gradient steps

      w <- clip(w - mu_t sign(grad_w CE(t_w(x^), y)), 0, 1),   mu_t = weight_lr * weight_decay^t;

* a weight step is kept only if it does not raise the weighted teacher's NLL on the
  server's validation set (``weight_selection="validation"``; ``"none"``, or no validation
  set, keeps every step as the authors do);
* the student takes DENSE's ``s_steps`` SGD steps on T^2 KL(t_w(x^) || s(x^)) over fresh
  hard batches x^, the teacher evaluated with the current weights (no cached logits).

The server's validation labels only select: the student's best iterate, as in DENSE, and
which proposed weight steps are kept (no gradient is taken on them). The check is there
because a signed step of mu is a large part of a uniform weight 1/K when K is large: with
many clients the kept-every-step weights zero out whole clients and the teacher falls below
the uniform ensemble (benchmarks/docs/leaderboard.md). Departures from
the authors' code (rong-dai/Co-Boosting, ``COBOOSTSynthesizer`` + ``cb_kd_train``), besides
DENSE's own (persistent conditional generator, bounded pool): the weights take
``weight_steps`` steps per iteration on perturbed pool batches (the authors: one pass over
every unperturbed sample synthesised so far, from the second epoch on); perturbed samples
are clipped to the data range (the authors do not clip); DENSE's masked adversarial KL at
temperature ``temperature`` (the authors: unmasked, T = 3) and its student temperature (the
authors: T = 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.strategies.datafree.dense import Dense, LogitEnsemble
from fedfusion.synthesis import SamplePool, kl_teacher_student
from fedfusion.wire import ClientUpload

PERTURBATIONS = ("ods", "kl")
WEIGHT_SELECTIONS = ("validation", "none")
#: softmax temperature of the ODS objective (the authors' code)
ODS_TEMPERATURE = 4.0


def mix_logits(member_logits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k (w_k / sum w) logits_k for stacked logits [K, B, C] and raw weights w [K]."""
    pi = w / w.sum().clamp_min(torch.finfo(w.dtype).tiny)
    return torch.einsum("k,kbc->bc", pi.to(member_logits.dtype), member_logits)


class WeightedLogitEnsemble(LogitEnsemble):
    """t_w(x) = sum_k pi_k f_k(x), pi = w / sum(w); ``w`` a buffer, uniform at the start."""

    w: torch.Tensor

    def __init__(self, members: Sequence[nn.Module], bn_stats: bool = False):
        super().__init__(members, bn_stats=bn_stats)
        self.register_buffer("w", torch.full((len(members),), 1.0 / len(members)))

    @property
    def mixture(self) -> torch.Tensor:
        """pi = w / sum(w), on the simplex."""
        return self.w / self.w.sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mix_logits(self.member_logits(x), self.w)


def signed_gradient_ascent(x: torch.Tensor, objective: Callable[[torch.Tensor], torch.Tensor],
                           epsilon: float, steps: int, low: torch.Tensor, high: torch.Tensor
                           ) -> torch.Tensor:
    """``steps`` times x <- clip(x + epsilon sign(grad_x objective(x)), low, high)."""
    for _ in range(steps):
        x = x.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(objective(x), x)
        x = torch.minimum(torch.maximum(x + epsilon * grad.sign(), low), high)
    return x.detach()


def reweight_step(member_logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor, lr: float
                  ) -> tuple[torch.Tensor, float]:
    """One step w <- clip(w - lr sign(grad_w CE(mix_logits(member_logits, w), y)), 0, 1);
    returns the new w and the CE before the step."""
    w = w.detach().requires_grad_(True)
    loss = F.cross_entropy(mix_logits(member_logits.detach(), w), y)
    (grad,) = torch.autograd.grad(loss, w)
    return (w - lr * grad.sign()).clamp(0.0, 1.0).detach(), loss.item()


class CoBoosting(Dense):
    """DENSE with hard samples and a re-weighted ensemble teacher; see the module doc.

    Parameters
    ----------
    epsilon : float, default 0.03
        Step of the hard-sample perturbation, in normalised input units (the authors' 8/255).
    perturb_steps : int, default 1
        Signed-gradient steps per hard batch (0 = no perturbation).
    perturbation : {"ods", "kl"}, default "ods"
        The objective the perturbation ascends: random output direction (the authors') or
        the student-ensemble KL.
    hardness : float, default 1.0
        beta of the generator's hard-sample loss (1 - p_y)^beta CE (0 = DENSE's CE).
    weight_lr, weight_decay : float, default 0.01, 0.99
        Ensemble-weight step mu and its per-iteration decay (the authors' mu and wdc).
    weight_steps : int, default 1
        Weight steps per iteration, each on a fresh hard batch (0 = uniform ensemble).
    weight_selection : {"validation", "none"}, default "validation"
        Keep a weight step only if the weighted teacher's validation NLL does not rise, or
        keep every step (the authors'; also what happens without a validation set).
    epochs, batch_size, latent_dim, g_lr, s_lr, g_steps, s_steps, adv_weight, act_weight, \
stats_term, student_init, generator_width, temperature, data_range, pool_batches, adv_mask, \
eval_fraction
        :class:`Dense`'s knobs and defaults, shared (run config: the ``dense-*`` keys).
    """

    name = "co-boosting"

    def __init__(
        self,
        model_fn: ModelFn | nn.Module | ModelSpec,
        *,
        epsilon: float = 0.03,
        perturb_steps: int = 1,
        perturbation: str = "ods",
        hardness: float = 1.0,
        weight_lr: float = 0.01,
        weight_decay: float = 0.99,
        weight_steps: int = 1,
        weight_selection: str = "validation",
        **kwargs: Any,
    ):
        super().__init__(model_fn, **kwargs)
        if perturbation not in PERTURBATIONS:
            raise ValueError(f"perturbation {perturbation!r}: choose one of {PERTURBATIONS}")
        if weight_selection not in WEIGHT_SELECTIONS:
            raise ValueError(f"weight_selection {weight_selection!r}: choose one of "
                             f"{WEIGHT_SELECTIONS}")
        if min(epsilon, perturb_steps, hardness, weight_lr, weight_decay, weight_steps) < 0:
            raise ValueError("co-boosting needs epsilon, perturb_steps, hardness, weight_lr, "
                             "weight_decay, weight_steps >= 0")
        self.epsilon, self.perturb_steps, self.perturbation = epsilon, perturb_steps, perturbation
        self.hardness = hardness
        self.weight_lr, self.weight_decay, self.weight_steps = (weight_lr, weight_decay,
                                                                weight_steps)
        self.weight_selection = weight_selection
        #: the client id of each teacher member, in the order of the weights
        self.member_clients: list[int] = []
        self.teacher: WeightedLogitEnsemble | None = None
        #: the members' validation logits [K, N, C] and labels, when steps are checked
        self._val: tuple[torch.Tensor, torch.Tensor] | None = None
        #: the weighted teacher's validation NLL: uniform, then after the last kept step
        self.teacher_val_nll: dict[str, float] = {}
        self.weight_steps_kept = self.weight_steps_proposed = 0

    def build(self, uploads: Sequence[ClientUpload]) -> None:
        super().build(uploads)
        assert self.teacher is not None
        self.member_clients = [u.client_id for u in uploads
                               for _ in self.context.member_models(u)]
        val = self.context.val
        self._val, self.teacher_val_nll = None, {}
        self.weight_steps_kept = self.weight_steps_proposed = 0
        if self.weight_selection == "validation" and val is not None and len(val):
            with torch.no_grad():
                logits = self.in_chunks(self.teacher.member_logits, val.x, dim=1)
            self._val = logits, val.y.to(self.context.device)
            self.teacher_val_nll["uniform"] = self.teacher_val_nll["kept"] = (
                self._val_nll(self.teacher.w))

    def _val_nll(self, w: torch.Tensor) -> float:
        assert self._val is not None
        logits, y = self._val
        return F.cross_entropy(mix_logits(logits, w), y).item()

    def make_teacher(self, members: Sequence[nn.Module], bn_stats: bool
                     ) -> WeightedLogitEnsemble:
        return WeightedLogitEnsemble(members, bn_stats=bn_stats)

    def class_loss(self, t_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """L_H = mean_i (1 - p_{y_i})^beta CE_i, (1 - p) detached (the authors')."""
        ce = F.cross_entropy(t_logits, y, reduction="none")
        p_y = F.softmax(t_logits.detach(), 1).gather(1, y[:, None]).squeeze(1)
        return ((1 - p_y) ** self.hardness * ce).mean()

    def harden(self, x: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        """The hard version of the batch x (see the module doc)."""
        assert self.teacher is not None and self.student is not None and self.generator
        if self.perturb_steps == 0 or self.epsilon == 0:
            return x.detach()
        teacher, student = self.teacher, self.student
        if self.perturbation == "ods":
            r = 2 * torch.rand(x.shape[0], self.context.model_spec.num_classes,
                               generator=rng, device=x.device) - 1

            def objective(v: torch.Tensor) -> torch.Tensor:
                return (r * F.softmax(teacher(v) / ODS_TEMPERATURE, 1)).sum()
        else:
            def objective(v: torch.Tensor) -> torch.Tensor:
                return kl_teacher_student(teacher(v), student(v), self.temperature).sum()
        return signed_gradient_ascent(x, objective, self.epsilon, self.perturb_steps,
                                      self.generator.low, self.generator.high)

    def hard_batch(self, pool: SamplePool, rng: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pool batch (images, generator labels), the images hardened."""
        index = pool.draw(self.batch_size, rng)
        return self.harden(pool.x[index], rng), pool.y[index]

    def teacher_step(self, pool: SamplePool, rng: torch.Generator, iteration: int
                     ) -> dict[str, float]:
        """``weight_steps`` re-weighting steps on hard batches (step mu * decay^t)."""
        assert self.teacher is not None
        parts: dict[str, float] = {}
        lr = self.weight_lr * self.weight_decay ** iteration
        for _ in range(self.weight_steps if pool.size else 0):
            x, y = self.hard_batch(pool, rng)
            with torch.no_grad():
                member_logits = self.teacher.member_logits(x)
            w, parts["w_ce"] = reweight_step(member_logits, y, self.teacher.w, lr)
            self.weight_steps_proposed += 1
            if self._val is not None:
                nll = self._val_nll(w)
                if nll > self.teacher_val_nll["kept"]:
                    continue
                self.teacher_val_nll["kept"] = nll
            self.weight_steps_kept += 1
            self.teacher.w.copy_(w)
        return parts

    def student_step(self, s_opt: torch.optim.Optimizer, pool: SamplePool,
                     rng: torch.Generator) -> float:
        """One SGD step of the student on the KL to the current weighted teacher on a hard
        batch; returns the KL."""
        assert self.teacher is not None
        x, _ = self.hard_batch(pool, rng)
        with torch.no_grad():
            t_logits = self.teacher(x)
        s_opt.zero_grad(set_to_none=True)
        kl = self.student_loss(x, t_logits)
        kl.backward()
        s_opt.step()
        return kl.item()

    def report(self) -> dict[str, Any]:
        weights = self.teacher.mixture.tolist() if self.teacher is not None else []
        return {**super().report(), "epsilon": self.epsilon,
                "perturb_steps": self.perturb_steps, "perturbation": self.perturbation,
                "hardness": self.hardness, "weight_lr": self.weight_lr,
                "weight_decay": self.weight_decay, "weight_steps": self.weight_steps,
                "weight_selection": self.weight_selection if self._val is not None else "none",
                "weight_steps_kept": self.weight_steps_kept,
                "weight_steps_proposed": self.weight_steps_proposed,
                "teacher_val_nll": self.teacher_val_nll,
                "client_weights": weights, "member_clients": self.member_clients}
