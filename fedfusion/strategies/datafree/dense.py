"""DENSE (Zhang et al., NeurIPS 2022): data-free one-shot FL by distilling the client ensemble.

The server holds every uploaded member f_k (k = 1..K over all members of all clients) and
distils their ensemble into one student network s of the broadcast architecture, without
data, by alternating two players:

* the teacher is the mean of the members' LOGITS, t(x) = 1/K sum_k f_k(x), every member with
  the same weight (the reference code's ``Ensemble_A``; not the softmax average of
  :class:`~fedfusion.core.predictors.Ensemble`);
* a class-conditional generator G(z, y) (z ~ N(0, I_d), y ~ U{0..K-1}; see :class:`Generator`)
  makes images of ``model_spec.input_shape`` in the data range and minimises

      L_G = CE(t(G(z, y)), y)
            - adv_weight * mean_i [ m_i KL(p_t,i || p_s,i) ]
            + act_weight * R(G(z, y)),      m_i = 1{argmax t_i != argmax s_i} (``adv_mask``)

  i.e. samples the ensemble classifies confidently as y (i), on which the student disagrees
  with the teacher (ii, the reference's "decision adversarial" masked KL; the gradient goes
  to G only), and whose statistics look like data (iii, R below). Each generator batch and
  its teacher logits go into a pool holding the last ``pool_batches`` batches. "The data
  range" is ``data_range`` when given, else per channel [min, max] of the server validation
  images (their only use besides model selection), else :data:`FALLBACK_RANGE`;
* the student takes ``s_steps`` SGD steps (momentum 0.9, lr ``s_lr``, as the reference) per
  ``g_steps`` Adam steps of G (lr ``g_lr``, betas (0.5, 0.999) as the reference), each on a
  batch drawn from the pool, minimising the batch mean of
  T^2 KL(p_t || p_s) = T^2 sum_j p_t,j (log p_t,j - log p_s,j), p = softmax(logits / T).

The statistics term R (``stats_term``). DENSE matches, at every BatchNorm layer of the
teachers, the batch statistics of the synthetic data to the statistics the layer stored while
its client trained (DeepInversion, Yin et al. 2020):

* ``"bn"``, the original term: with l over the BatchNorm layers (1d/2d/3d, running statistics
  tracked) of teacher k, h_{k,l}(x) the layer's INPUT on the synthetic batch, and
  mu_c, sigma^2_c its per-channel mean and biased variance over the batch and every other
  axis but the channel axis 1,

      R = 1/K sum_k sum_l ( ||mu(h_{k,l}) - running_mean_{k,l}||_2
                            + ||sigma^2(h_{k,l}) - running_var_{k,l}||_2 ),

  the sum over layers of DeepInversion's hook, averaged over the K teachers. The teachers are
  in eval mode (each layer normalises with its running statistics, as at inference), the
  running statistics are constants, and the gradient reaches G through h_{k,l}(x).

Models without BatchNorm (of the zoo: every model but ``bn_cnn`` and ``resnet20``) have no
stored statistics; for them:

* ``"input"``: the DeepInversion norm at the one layer whose statistics we do know,
  the input: the data are normalised per channel with the training set's statistics, so
  real inputs have per-channel mean 0 and variance 1, and
  R = ||mu(x)||_2 + ||sigma^2(x) - 1||_2 over channels (mu, sigma^2 over batch and pixels);
* ``"act"``: DAFL's activation loss (Chen et al. 2019; the reference code's unused ``--act``),
  R = -mean |h_k(x)| over the teachers' penultimate activations h_k (the input of each
  member's last Linear layer): samples that excite the teachers' features strongly;
* ``"none"``: R = 0.

``"auto"`` (the default) resolves, when the teachers are built, to ``"bn"`` when every
teacher has at least one BatchNorm layer with running statistics, else to ``"input"``
(:data:`FALLBACK_STATS_TERM`: the three terms without BatchNorm measure alike, and ``input``
is the cheapest meaningful one); :meth:`Dense.report` records the term used, the one asked
for and the number of BatchNorm layers per teacher. ``"bn"`` asked for on teachers without
BatchNorm statistics is an error. R enters L_G with the weight ``act_weight`` whatever the
term.

The student starts from the sample-weighted FedAvg of the clients' first members
(``student_init="fedavg"``; the reference starts from a random network, ``"random"``, which
ends lower and reaches the plateau later). Every ~10% of the iterations (and at the start
and the end) it is scored on the server validation set (accuracy, then -NLL) and the best
iterate is kept, the start included; without a validation set the last iterate is returned.
``adv_mask`` and ``pool_batches`` default to the reference's masked KL and 10 batches. The
measurements behind these defaults: benchmarks/docs/dense.md.

Integer inputs (token ids into an ``nn.Embedding``, bool masks): the generator makes float
images and cannot make them, so such a model is refused before anything trains (the
requirement ``"float-inputs"`` of :mod:`fedfusion.core.model_check`: the constructor on the
validation inputs' dtype, else the model's first layer; each client on its own inputs before
its training), naming ``distill='val'`` and other strategies as the alternatives.

Departures from the reference code (zj-jayzhang/DENSE, ``AdvSynthesizer`` + ``kd_train``):

* one persistent, class-conditional generator trained online against the student; the
  reference re-initialises an unconditional G every epoch and optimises it jointly with a
  fixed latent batch z (whose targets y are fixed) for ``g_steps`` steps, keeping the
  lowest-loss batch. With fresh z every step an unconditional G cannot lower CE(t, y) for
  random y (measured: it stays at log K), hence the conditioning z * embed(y);
* the student trains on a bounded pool of recent batches (the reference: one epoch per
  iteration over ALL batches synthesised so far), with cached teacher logits;
* no augmentation (random crop / flip) of the synthetic images;
* one temperature T (default 1) for both KL terms (the README's command: T = 20 for the
  student, 1 for the adversarial term);
* transposed convolutions and tanh scaled to the normalised data range (the reference:
  upsample + conv3 at full resolution and a sigmoid in [0, 1] for un-normalised models);
* the BatchNorm statistics term is averaged over the teachers and weighted by ``act_weight``
  (default 0.1); the reference sums DeepInversion's hook over every ``BatchNorm2d`` of every
  teacher with weight ``--bn`` (1 in its README), i.e. ``act_weight = K`` here. We also hook
  BatchNorm1d/3d. Without BatchNorm in the teachers the term is replaced as described above;
* the student is scored on the validation set in eval mode (its running statistics, if it has
  BatchNorm, are neither used nor updated by the validation images) and trained in train
  mode, as the reference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fedfusion.constraints import FINITE_NON_NEGATIVE, FINITE_POSITIVE
from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.evaluation import classification_metrics
from fedfusion.core.normalization import running_stat_layers
from fedfusion.core.predictors import Ensemble
from fedfusion.core.state import weighted_average
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.seeding import seeded
from fedfusion.synthesis import (
    FALLBACK_RANGE,
    Generator,
    SamplePool,
    input_stats_loss,
    kl_teacher_student,
)
from fedfusion.wire import WEIGHTS, ClientUpload

#: bounds on the synthetic batch, noise and generator widths, and the pool (pool_batches
#: batches of synthetic images are kept): a typo must not allocate without end
MAX_SIZE, MAX_POOL = 65_536, 1_000
log = logging.getLogger("fedfusion")

STATS_TERMS = ("auto", "bn", "input", "act", "none")
#: the statistics term used when none is named: "bn" for BatchNorm teachers, else the fallback
DEFAULT_STATS_TERM = "auto"
#: what "auto" means for teachers without BatchNorm statistics (measured: see the module doc)
FALLBACK_STATS_TERM = "input"
def bn_stats_loss(h: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor
                  ) -> torch.Tensor:
    """DeepInversion's term at one BatchNorm layer: ``||mu(h) - running_mean||_2 +
    ||sigma^2(h) - running_var||_2``, with mu and the biased sigma^2 per channel (axis 1) of
    the layer's input ``h`` ``[B, C, ...]`` over every other axis."""
    dims = [d for d in range(h.dim()) if d != 1]
    mean = h.mean(dim=dims)
    var = h.var(dim=dims, correction=0)
    return (torch.linalg.vector_norm(mean - running_mean.to(h.dtype))
            + torch.linalg.vector_norm(var - running_var.to(h.dtype)))


class LogitEnsemble(nn.Module):
    """t(x) = 1/K sum_k f_k(x): the mean of the members' logits (frozen).

    With ``bn_stats`` every BatchNorm layer of every member records
    :func:`bn_stats_loss` of its input during a forward (see :meth:`bn_statistics_loss`)."""

    def __init__(self, members: Sequence[nn.Module], bn_stats: bool = False):
        super().__init__()
        self.members = nn.ModuleList(members)
        for p in self.parameters():
            p.requires_grad_(False)
        self.eval()
        #: the members' penultimate activations of the last forward (for the "act" term)
        self.features: list[torch.Tensor] = []
        #: every BatchNorm layer's statistics term of the last forward (for the "bn" term)
        self.bn_terms: list[torch.Tensor] = []
        for member in self.members:
            linears = [m for m in member.modules() if isinstance(m, nn.Linear)]
            if linears:
                linears[-1].register_forward_hook(self._keep_input)
            if bn_stats:
                for layer in running_stat_layers(member):
                    layer.register_forward_pre_hook(self._match_statistics)

    def _keep_input(self, module: nn.Module, inputs: tuple[torch.Tensor, ...],
                    output: torch.Tensor) -> None:
        self.features.append(inputs[0])

    def _match_statistics(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        mean, var = module.running_mean, module.running_var
        assert isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor)
        self.bn_terms.append(bn_stats_loss(inputs[0], mean, var))

    def bn_statistics_loss(self) -> torch.Tensor:
        """R of the last forward: the sum of the BatchNorm layers' terms, averaged over the
        members (1/K sum_k sum_l ...)."""
        if not self.bn_terms:
            raise RuntimeError("no BatchNorm statistics recorded: build the ensemble with "
                               "bn_stats=True from members with BatchNorm, then call it")
        return torch.stack(self.bn_terms).sum() / len(self.members)

    def member_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's logits, stacked: [K, B, num_classes] (resets the recorded terms)."""
        self.features = []
        self.bn_terms = []
        return torch.stack([m(x) for m in self.members])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.member_logits(x).mean(0)


class Dense(FusionStrategy):
    """Data-free distillation of the client ensemble into one student; see the module doc.

    Parameters
    ----------
    epochs : int, default 200
        Generator/distillation iterations.
    batch_size : int, default 256
        Synthetic batch size.
    latent_dim : int, default 256
        Generator noise dimension.
    g_lr, s_lr : float, default 1e-3, 0.01
        Generator and student learning rates.
    g_steps, s_steps : int, default 1, 5
        Generator and student steps per iteration.
    adv_weight : float, default 1.0
        Weight of the adversarial (teacher-student disagreement) loss.
    act_weight : float, default 0.1
        Weight of the statistics term R, whichever it is.
    stats_term : {"auto", "bn", "input", "act", "none"}, default "auto"
        The statistics term R: "auto" = the BatchNorm-statistics term ("bn") when the teachers
        have BatchNorm, else "input" (see the module docstring).
    student_init, generator_width, temperature, data_range, pool_batches, \
adv_mask, eval_fraction
        Details of the generator and the distillation (see the module docstring).
    """

    name = "dense"
    member_fusions = ("first", "all")  # teachers: member 0 of each client, or every member
    required_sections = (WEIGHTS,)
    #: the generator makes the inputs: float ones only (:mod:`fedfusion.core.model_check`)
    model_requirements = ("float-inputs",)

    def __init__(
        self,
        model_fn: ModelFn | nn.Module | ModelSpec,
        *,
        epochs: int = 200,
        batch_size: int = 256,
        latent_dim: int = 256,
        g_lr: float = 1e-3,
        s_lr: float = 0.01,
        g_steps: int = 1,
        s_steps: int = 5,
        adv_weight: float = 1.0,
        act_weight: float = 0.1,
        stats_term: str = DEFAULT_STATS_TERM,
        student_init: str = "fedavg",
        generator_width: int = 32,
        temperature: float = 1.0,
        data_range: tuple[float, float] | None = None,
        pool_batches: int = 10,
        adv_mask: bool = True,
        eval_fraction: float = 0.1,
        **kwargs: Any,
    ):
        super().__init__(model_fn, **kwargs)
        if stats_term not in STATS_TERMS:
            raise ValueError(f"stats_term {stats_term!r}: choose one of {STATS_TERMS}")
        if student_init not in ("fedavg", "random"):
            raise ValueError(f"student_init {student_init!r}: choose 'fedavg' or 'random'")
        if min(epochs + 1, batch_size - 1, latent_dim, g_steps + 1, s_steps + 1,
               pool_batches, generator_width) < 1:
            raise ValueError("dense needs epochs, g_steps, s_steps >= 0, batch_size >= 2, "
                             "latent_dim, pool_batches, generator_width >= 1")
        if max(batch_size, latent_dim, generator_width) > MAX_SIZE or pool_batches > MAX_POOL:
            raise ValueError(f"dense needs batch_size, latent_dim, generator_width <= {MAX_SIZE} "
                             f"and pool_batches <= {MAX_POOL}, got {batch_size}, {latent_dim}, "
                             f"{generator_width}, {pool_batches}")
        FINITE_POSITIVE.check("g_lr", g_lr)
        FINITE_POSITIVE.check("s_lr", s_lr)
        FINITE_NON_NEGATIVE.check("adv_weight", adv_weight)
        FINITE_NON_NEGATIVE.check("act_weight", act_weight)
        self.epochs, self.batch_size, self.latent_dim = epochs, batch_size, latent_dim
        self.g_lr, self.s_lr, self.g_steps, self.s_steps = g_lr, s_lr, g_steps, s_steps
        self.adv_weight, self.act_weight = adv_weight, act_weight
        self.stats_term, self.student_init = stats_term, student_init
        #: the term in use, resolved from ``stats_term`` by :meth:`build`
        self.stats_term_used: str | None = None
        #: BatchNorm layers with running statistics, per teacher (set by :meth:`build`)
        self.bn_layers: list[int] = []
        self.generator_width, self.temperature = generator_width, temperature
        self.data_range = data_range
        self.pool_batches = pool_batches
        self.adv_mask = adv_mask
        self.eval_every = max(1, round(epochs * eval_fraction))
        self.trace: list[dict[str, float]] = []
        self.best: dict[str, float] = {}
        self.seconds_per_iteration = float("nan")
        self.generator: Generator | None = None
        self.student: nn.Module | None = None
        self.teacher: LogitEnsemble | None = None


    # ------------------------------------------------------------------ set-up
    def channel_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel [low, high] of the normalised data: ``data_range`` when given, else
        the min/max of the validation images, else :data:`FALLBACK_RANGE`."""
        channels = self.context.model_spec.input_shape[0]
        if self.data_range is not None:
            low, high = self.data_range
        elif self.context.val is not None and len(self.context.val) > 0:
            x = self.context.val.x.transpose(0, 1).reshape(channels, -1)
            return x.min(1).values, x.max(1).values
        else:
            low, high = FALLBACK_RANGE
        return torch.full((channels,), float(low)), torch.full((channels,), float(high))

    def resolve_stats_term(self, members: Sequence[nn.Module]) -> str:
        """The term ``stats_term`` means for these teachers ("auto": "bn" when every one has
        BatchNorm statistics, else :data:`FALLBACK_STATS_TERM`); records the BatchNorm
        layers per teacher in :attr:`bn_layers`."""
        self.bn_layers = [len(running_stat_layers(m)) for m in members]
        has_bn = bool(members) and all(self.bn_layers)
        if self.stats_term == "auto":
            return "bn" if has_bn else FALLBACK_STATS_TERM
        if self.stats_term == "bn" and not has_bn:
            raise ValueError(f"stats_term 'bn' matches the teachers' BatchNorm running "
                             f"statistics, but BatchNorm layers per teacher are "
                             f"{self.bn_layers}; use 'auto', 'input', 'act' or 'none'")
        return self.stats_term

    def build(self, uploads: Sequence[ClientUpload]) -> None:
        """Teacher (all members of all clients), student and generator, seeded; resolves the
        statistics term (:meth:`resolve_stats_term`)."""
        spec, device = self.context.model_spec, self.context.device
        members = [m for upload in uploads for m in self.context.member_models(upload)]
        self.stats_term_used = self.resolve_stats_term(members)
        self.teacher = self.make_teacher(members, self.stats_term_used == "bn").to(device)
        with seeded(self.context.seed):
            low, high = self.channel_range()
            self.generator = Generator(self.latent_dim, spec.input_shape, spec.num_classes,
                                       self.generator_width, low, high).to(device).train()
            if self.student_init == "fedavg":
                state = weighted_average([u.weights(0) for u in uploads],
                                         [u.num_examples for u in uploads])
                self.student = spec.build(state)
            else:
                self.student = spec.build()
        self.student = self.student.to(device).train()

    def make_teacher(self, members: Sequence[nn.Module], bn_stats: bool) -> LogitEnsemble:
        """The teacher over the members: DENSE's is the plain logit mean."""
        return LogitEnsemble(members, bn_stats=bn_stats)

    # ------------------------------------------------------------------ losses
    def sample(self, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """z ~ N(0, I) [B, d] and labels y ~ U{0..K-1} [B]."""
        device = self.context.device
        z = torch.randn(self.batch_size, self.latent_dim, generator=rng, device=device)
        y = torch.randint(self.context.model_spec.num_classes, (self.batch_size,),
                          generator=rng, device=device)
        return z, y

    def stats_loss(self, x: torch.Tensor) -> torch.Tensor:
        """The statistics term R(x) (after the teacher's forward on x)."""
        assert self.teacher is not None
        if self.stats_term_used == "bn":
            return self.teacher.bn_statistics_loss()
        if self.stats_term_used == "input":
            return input_stats_loss(x)
        if self.stats_term_used == "act":
            return -torch.stack([h.abs().mean() for h in self.teacher.features]).mean()
        return x.new_zeros(())

    def generator_loss(self, z: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """L_G and its parts on one batch (see the module docstring)."""
        assert self.generator is not None and self.teacher is not None and self.student
        x = self.generator(z, y)
        t_logits = self.teacher(x)
        s_logits = self.student(x)
        ce = self.class_loss(t_logits, y)
        disagree = ((t_logits.argmax(1) != s_logits.argmax(1)).float() if self.adv_mask
                    else torch.ones_like(ce).expand(len(y)))
        adv = -(kl_teacher_student(t_logits, s_logits, self.temperature) * disagree).mean()
        stats = self.stats_loss(x)
        total = ce + self.adv_weight * adv + self.act_weight * stats
        return {"loss": total, "ce": ce, "adv": adv, "stats": stats, "x": x,
                "t_logits": t_logits, "y": y}

    def class_loss(self, t_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The generator's class term: CE(t(G(z, y)), y), the batch mean."""
        return F.cross_entropy(t_logits, y)

    def student_loss(self, x: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
        """Batch-mean KL(p_t || p_s) on synthetic images x with teacher logits t_logits."""
        assert self.student is not None
        return kl_teacher_student(t_logits.detach(), self.student(x.detach()),
                                  self.temperature).mean()

    # ------------------------------------------------------------------ fusion
    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        spec = self.context.model_spec
        self.build(uploads)
        self.distil()
        assert self.student is not None
        return Ensemble([self.student.cpu().eval()], [spec])

    def distil(self) -> None:
        """``epochs`` iterations of g_steps generator steps then s_steps student steps;
        keep the best iterate on the validation set."""
        assert self.generator is not None and self.student is not None
        device = self.context.device
        rng = torch.Generator(device=device).manual_seed(self.context.seed)
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=self.g_lr, betas=(0.5, 0.999))
        s_opt = torch.optim.SGD(self.student.parameters(), lr=self.s_lr, momentum=0.9)
        spec = self.context.model_spec
        pool = SamplePool(self.pool_batches * self.batch_size, spec.input_shape,
                          spec.num_classes, device)
        log.info("[%s] %d iterations x (%d G + %d student steps), batch %d, stats term %s, "
                 "student from %s, on %s", self.name, self.epochs, self.g_steps, self.s_steps,
                 self.batch_size, self.stats_term_used, self.student_init, device)
        self.trace, self.best = [], {}
        best_state = self._snapshot()
        start = time.perf_counter()
        parts: dict[str, float] = {}
        for it in range(self.epochs + 1):
            if it % self.eval_every == 0 or it == self.epochs:
                seconds = (time.perf_counter() - start) / max(it, 1)
                entry = {"iteration": it, **parts, "seconds_per_iteration": seconds,
                         **self._validate()}
                self.trace.append(entry)
                if self._better(entry):
                    self.best, best_state = entry, self._snapshot()
                log.info("[%s] iteration %d/%d: %s", self.name, it, self.epochs, " ".join(
                    f"{k} {v:.4g}" for k, v in entry.items() if k != "iteration"))
            if it == self.epochs:
                break
            for _ in range(self.g_steps):
                parts = self.generator_step(g_opt, pool, rng)
            parts.update(self.teacher_step(pool, rng, it))
            for _ in range(self.s_steps if pool.size else 0):
                parts["s_kl"] = self.student_step(s_opt, pool, rng)
        self.seconds_per_iteration = (time.perf_counter() - start) / max(self.epochs, 1)
        if self.best:
            self.student.load_state_dict(best_state)

    def generator_step(self, g_opt: torch.optim.Optimizer, pool: SamplePool,
                       rng: torch.Generator) -> dict[str, float]:
        """One Adam step on L_G (gradient to G only); its batch goes to the pool."""
        assert self.generator is not None
        g_opt.zero_grad(set_to_none=True)
        losses = self.generator_loss(*self.sample(rng))
        losses["loss"].backward(inputs=list(self.generator.parameters()))
        g_opt.step()
        pool.add(losses["x"], losses["t_logits"], losses["y"])
        return {f"g_{k}": losses[k].item() for k in ("loss", "ce", "adv", "stats")}

    def teacher_step(self, pool: SamplePool, rng: torch.Generator, iteration: int
                     ) -> dict[str, float]:
        """A hook between the generator and the student steps: DENSE's teacher is fixed."""
        return {}

    def student_step(self, s_opt: torch.optim.Optimizer, pool: SamplePool,
                     rng: torch.Generator) -> float:
        """One SGD step of the student on the KL to the cached teacher logits of a pool
        batch; returns the KL."""
        s_opt.zero_grad(set_to_none=True)
        kl = self.student_loss(*pool.sample(self.batch_size, rng))
        kl.backward()
        s_opt.step()
        return kl.item()

    def _snapshot(self) -> dict[str, torch.Tensor]:
        assert self.student is not None
        return {k: v.detach().clone() for k, v in self.student.state_dict().items()}

    @torch.no_grad()
    def _validate(self) -> dict[str, float]:
        """The student's validation accuracy and NLL (empty without a validation set)."""
        val = self.context.val
        if val is None or len(val) == 0:
            return {}
        assert self.student is not None
        was_training = self.student.training
        self.student.eval()  # BatchNorm: score with (and leave) the running statistics
        try:
            logits = self.in_chunks(self.student, val.x).cpu()
        finally:
            self.student.train(was_training)
        metrics = classification_metrics(torch.log_softmax(logits.float(), 1), val.y)
        return {"val_accuracy": metrics["accuracy"], "val_nll": metrics["nll"]}

    def in_chunks(self, fn: Any, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """``fn`` over ``x`` in chunks of 2000 rows on the server device, concatenated along
        ``dim`` (bounds the activations of a large validation set)."""
        return torch.cat([fn(x[i:i + 2000].to(self.context.device))
                          for i in range(0, len(x), 2000)], dim)

    def _better(self, entry: dict[str, float]) -> bool:
        if "val_accuracy" not in entry:
            return False
        if not self.best:
            return True
        return ((entry["val_accuracy"], -entry["val_nll"])
                > (self.best["val_accuracy"], -self.best["val_nll"]))

    def report(self) -> dict[str, Any]:
        return {"epochs": self.epochs, "batch_size": self.batch_size, "g_steps": self.g_steps,
                "s_steps": self.s_steps, "g_lr": self.g_lr, "s_lr": self.s_lr,
                "latent_dim": self.latent_dim, "generator_width": self.generator_width,
                "pool_batches": self.pool_batches, "adv_mask": self.adv_mask,
                "adv_weight": self.adv_weight,
                "act_weight": self.act_weight,
                "stats_term": self.stats_term_used or self.stats_term,
                "stats_term_requested": self.stats_term, "bn_layers": self.bn_layers,
                "student_init": self.student_init, "temperature": self.temperature,
                "selection": "validation" if self.context.val is not None else "last",
                "best": self.best, "seconds_per_iteration": self.seconds_per_iteration,
                "trace": self.trace}
