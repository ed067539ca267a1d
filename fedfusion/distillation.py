"""One network out of any fused predictor: knowledge distillation on the server.

Many strategies predict with several networks (FedBEns' modes, the uniform ensemble, AMS's
max-logit selector). :func:`distil` turns any predictor ``t`` returning log-probabilities
(the *teacher*) into ONE network ``s`` (the *student*, of the architecture the server
broadcasts) by minimising, over a stream of inputs x,

    L(s) = mean_x T^2 KL(p_t(x) || p_s(x)) = mean_x T^2 sum_j p_t,j (log p_t,j - log p_s,j),
    p_t = softmax(log t(x) / T),   p_s = softmax(s(x) / T),

with the temperature T (``temperature``; T^2 keeps the gradient's scale independent of T,
Hinton et al. 2015). ``log t(x)`` are log-probabilities, i.e. logits up to a constant per
row, so any predictor is a teacher; the student's output may be logits or log-probabilities
alike (``log_softmax`` removes the constant). The inputs (``mode``):

* ``"val"``: the server's validation inputs ``val.x`` (their labels ``val.y`` are never a
  target: they only pick the best iterate, below), ``epochs`` passes in shuffled batches of
  ``batch_size``. With ``augment`` each batch is augmented before the teacher and the student
  both see it ("function matching", Beyer et al. 2022: the teacher is queried on the
  augmented input, so no label has to survive the augmentation):

  - images ``[B, C, H, W]``: a random shift of each image by (dy, dx) uniform in
    ``{-r..r}^2`` with ``r = max(1, min(H, W) // 8)`` (3 pixels on 28 x 28, 4 on 32 x 32),
    i.e. replicate-padding by r and a random H x W crop;
  - any float input: mixup (Zhang et al. 2018) of a fraction ``mixup`` of the batch,
    x~_i = lam_i x_i + (1 - lam_i) x_pi(i) with lam_i ~ U(0, 1) (= Beta(1, 1)) and pi a
    random permutation of the batch.

  Integer inputs (token ids into an ``nn.Embedding``) and bool masks have no shift or convex
  combination that is again an input of the model (a shifted or mixed token id is another
  token, not a blend), so for them the augmentation is skipped: the student sees the plain
  validation inputs, logged and recorded in the report (``"augmented": false`` with
  ``"augment_skipped"``, the reason).

* ``"synthetic"``: no data at all: DENSE's class-conditional generator
  (:class:`fedfusion.synthesis.Generator`) is trained against the teacher with DENSE's
  adversarial loss, L_G = CE(log t(G(z, y)), y) - mean_i [m_i KL(p_t,i || p_s,i)]
  + 0.1 * R_input(G(z, y)) (m_i = 1 where teacher and student disagree, R_input the distance
  of the batch's per-channel statistics to N(0, 1): see :mod:`fedfusion.strategies.datafree.dense`),
  one Adam step per student step; each generated batch and its teacher log-probabilities go
  into a pool of the last 10 batches, from which every student step draws its batch. The
  images lie in the per-channel range of ``val.x`` (else DENSE's fallback range). An epoch
  is as many student steps as a ``"val"`` epoch (``ceil(len(val) / batch_size)``, or 8
  without a validation set). DENSE's own teacher is the mean of the members' logits; here
  the teacher is whatever predictor the strategy fused. The generator makes float images;
  a model whose inputs are integers (token ids) or bool cannot be fed them, so
  ``"synthetic"`` with non-float validation inputs is refused (use ``"val"``).

The student starts where the caller built it (the Fusion core: the best-validated, by
:func:`pick_start`, of the sample-weighted FedAvg of the clients' first members and the
networks of an ensemble teacher, else a fresh seeded init) and is optimised by Adam (lr
``lr``) in train mode. After every epoch (and before the first) it is scored on the CLEAN
validation set in eval mode (accuracy, then -NLL) and the best iterate is kept, the start
included; without a validation set the last iterate is returned. Note the bias: in
``"val"`` mode the student was fitted on these very inputs (to the teacher's outputs, not
their labels), so its validation accuracy tends towards the teacher's and overstates its
test accuracy; it still ranks iterates.

Randomness (batch order, shifts, mixup, generator noise) comes from a ``torch.Generator``
seeded by ``seed``; anything drawing from torch's global RNG inside (dropout) runs in a
forked, seeded RNG, so the caller's global RNG is left as it was and two runs with one seed
give the same student.

Cost: per student step one teacher forward (every member of an ensemble) and one student
forward/backward on ``batch_size`` inputs; ``"synthetic"`` adds a generator forward and a
backward through teacher and student per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fedfusion.constraints import FINITE_POSITIVE, Constraint
from fedfusion.grad_mode import gradients_on
from fedfusion.seeding import seeded

log = logging.getLogger("fedfusion")

#: the values of ``distill``: off, on the validation inputs, on generated inputs
DISTILL_MODES = ("none", "val", "synthetic")
#: ``distill_epochs``: passes over the inputs, 0 keeping the start
DISTILL_EPOCHS = Constraint(
    "an int >= 0 (passes over the inputs; 0 = the start)",
    lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)


@dataclass(frozen=True)
class DistillOptions:
    """The knobs of :func:`distil` (see the module docstring)."""

    mode: str = "none"
    epochs: int = 30
    lr: float = 1e-3
    temperature: float = 1.0
    batch_size: int = 64
    augment: bool = True
    shift: bool = True
    mixup: float = 0.5
    seed: int = 0
    # "synthetic" only: the generator (DENSE's defaults for a short run)
    latent_dim: int = 64
    generator_width: int = 32
    g_lr: float = 5e-3
    pool_batches: int = 10

    def check(self) -> None:
        """ValueError naming the argument (as the Fusion constructor calls it) of a bad one."""
        _check("distill", self.mode, self.mode in DISTILL_MODES, f"one of {DISTILL_MODES}")
        DISTILL_EPOCHS.check("distill_epochs", self.epochs)
        FINITE_POSITIVE.check("distill_lr", self.lr)
        FINITE_POSITIVE.check("distill_temperature", self.temperature)
        _check("distill_batch_size", self.batch_size,
               isinstance(self.batch_size, int) and self.batch_size >= 2, "an int >= 2")
        _check("distill_mixup", self.mixup, 0.0 <= self.mixup <= 1.0, "in [0, 1]")


@dataclass
class Distillation:
    """What :func:`distil` returns: the trained student (eval mode, on the CPU) and a report
    (JSON-able: options, teacher's and student's validation metrics, trace, seconds)."""

    student: nn.Module
    report: dict[str, Any] = field(default_factory=dict)


def kd_terms(teacher_log_probs: torch.Tensor, student_out: torch.Tensor,
             temperature: float = 1.0) -> torch.Tensor:
    """Per input, T^2 KL(softmax(log_t / T) || softmax(s / T)) (module docstring), ``[B]``;
    ``teacher_log_probs`` and ``student_out`` are ``[B, K]``."""
    log_pt = F.log_softmax(teacher_log_probs / temperature, dim=1)
    log_ps = F.log_softmax(student_out / temperature, dim=1)
    return (log_pt.exp() * (log_pt - log_ps)).sum(1) * temperature**2


def kd_loss(teacher_log_probs: torch.Tensor, student_out: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """The distillation loss L: the batch mean of :func:`kd_terms`."""
    return kd_terms(teacher_log_probs, student_out, temperature).mean()


def shift_images(x: torch.Tensor, radius: int, rng: torch.Generator) -> torch.Tensor:
    """Each image of ``x`` ``[B, C, H, W]`` shifted by its own (dy, dx) in
    ``{-radius..radius}^2``: replicate-pad by ``radius``, then crop H x W at a random
    offset."""
    b, _, h, w = x.shape
    padded = F.pad(x, (radius, radius, radius, radius), mode="replicate")
    dy = torch.randint(2 * radius + 1, (b,), generator=rng, device=rng.device).to(x.device)
    dx = torch.randint(2 * radius + 1, (b,), generator=rng, device=rng.device).to(x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]  # [B, 1, H, 1]
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :]  # [B, 1, 1, W]
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def mixup(x: torch.Tensor, fraction: float, rng: torch.Generator) -> torch.Tensor:
    """A fraction of the rows of ``x`` (each with probability ``fraction``) replaced by
    lam x_i + (1 - lam) x_pi(i), lam ~ U(0, 1), pi a random permutation of the batch."""
    b = x.shape[0]
    perm = torch.randperm(b, generator=rng, device=rng.device).to(x.device)
    lam = torch.rand(b, generator=rng, device=rng.device).to(x.device, x.dtype)
    keep = torch.rand(b, generator=rng, device=rng.device).to(x.device) >= fraction
    lam = torch.where(keep, torch.ones_like(lam), lam).view(b, *([1] * (x.dim() - 1)))
    return lam * x + (1 - lam) * x[perm]


#: why ``"val"`` distillation does not augment integer or bool inputs (module docstring)
NO_AUGMENT_REASON = ("the inputs are {dtype}: shifts and mixup of token ids or masks are not "
                     "inputs of the model, so the plain validation inputs are used")
#: why ``"synthetic"`` distillation cannot serve a model of integer or bool inputs
NO_SYNTHETIC_REASON = ("distill='synthetic' generates float images with DENSE's generator and "
                       "cannot generate {dtype} inputs (token ids, masks) for this model; "
                       "use distill='val', which distils on the validation inputs")


def augment(x: torch.Tensor, options: DistillOptions, rng: torch.Generator) -> torch.Tensor:
    """The ``"val"`` augmentation: shifts of images (4-d inputs; ``shift``), then mixup (of
    a fraction ``mixup`` of the batch). Integer and bool inputs are returned as they are
    (:data:`NO_AUGMENT_REASON`)."""
    if not x.is_floating_point():
        return x
    if x.dim() == 4 and options.shift:
        x = shift_images(x, max(1, min(x.shape[2], x.shape[3]) // 8), rng)
    return mixup(x, options.mixup, rng) if options.mixup > 0 else x


@torch.no_grad()
def _log_probs(model: nn.Module, x: torch.Tensor, device: torch.device,
               batch: int = 2000) -> torch.Tensor:
    return torch.cat([F.log_softmax(model(x[i:i + batch].to(device)).float(), 1).cpu()
                      for i in range(0, len(x), batch)])


def _score(model: nn.Module, val: Any, device: torch.device) -> dict[str, float]:
    """Accuracy and NLL on the clean validation set (eval mode; the mode is restored)."""
    was_training = model.training
    model.eval()
    try:
        log_probs = _log_probs(model, val.x, device)
    finally:
        model.train(was_training)
    return {"accuracy": float((log_probs.argmax(1) == val.y).float().mean()),
            "nll": float(F.nll_loss(log_probs, val.y))}


def pick_start(candidates: Sequence[tuple[str, nn.Module]], val: Any,
               device: torch.device | str = "cpu") -> tuple[str, nn.Module, dict[str, Any]]:
    """The student's start among ``candidates`` (name, network): the one with the highest
    clean validation accuracy, ties to the lower NLL, then to the earlier candidate; without
    a validation set the first. Returns its name, the network and every candidate's score.
    The candidates were not fitted on ``val``, so these scores are unbiased."""
    if not candidates:
        raise ValueError("pick_start needs at least one candidate network")
    if val is None or not len(val.y) or len(candidates) == 1:
        return candidates[0][0], candidates[0][1], {}
    device = torch.device(device)
    scores = {name: _score(model.to(device), val, device) for name, model in candidates}
    best = max(range(len(candidates)), key=lambda i: (
        scores[candidates[i][0]]["accuracy"], -scores[candidates[i][0]]["nll"], -i))
    return candidates[best][0], candidates[best][1], scores


@contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode with no parameter gradients; both restored on exit."""
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(flag)
        model.train(was_training)


@gradients_on()
def distil(teacher: nn.Module, student: nn.Module, val: Any, options: DistillOptions,
           device: torch.device | str = "cpu",
           input_shape: tuple[int, ...] | None = None,
           on_epoch: Callable[[dict[str, float], nn.Module], None] | None = None
           ) -> Distillation:
    """Distil ``teacher`` (any predictor returning log-probabilities) into ``student`` (its
    start; trained in place) on ``options.mode``'s inputs; see the module docstring. ``val``
    has ``.x`` and ``.y`` (``.y`` only scores iterates), or is None (``"synthetic"`` only,
    which then needs ``input_shape`` ``(C, H, W)`` and generates in DENSE's fallback range).
    ``on_epoch(entry, student)``, when given, is called after every epoch's scoring (and the
    start's) with the trace entry and the student (in train mode; leave it as it is).
    """
    options.check()
    if options.mode == "none":
        raise ValueError("distill='none' asks for no distillation; nothing to distil")
    has_val = val is not None and len(val.y) > 0
    if options.mode == "val" and not has_val:
        raise ValueError("distill='val' distils on the server's validation inputs, but there "
                         "is no validation set: pass val=(x, y) or use distill='synthetic'")
    device = torch.device(device)
    with seeded(options.seed, device), _frozen(teacher):
        shape = tuple(val.x.shape[1:]) if has_val else tuple(input_shape or ())
        if options.mode == "synthetic" and has_val and not val.x.is_floating_point():
            raise ValueError(NO_SYNTHETIC_REASON.format(dtype=val.x.dtype))
        if options.mode == "synthetic" and len(shape) != 3:
            raise ValueError(f"distill='synthetic' generates images [C, H, W]; the inputs "
                             f"are {shape or 'unknown (no validation set, no input_shape)'}")
        return _distil(teacher.to(device), student.to(device), val if has_val else None,
                       options, device, shape, on_epoch)


def _distil(teacher: nn.Module, student: nn.Module, val: Any, options: DistillOptions,
            device: torch.device, input_shape: tuple[int, ...],
            on_epoch: Callable[[dict[str, float], nn.Module], None] | None) -> Distillation:
    rng = torch.Generator(device=device).manual_seed(options.seed)
    optimiser = torch.optim.Adam(student.parameters(), lr=options.lr)
    # every batch of the validation rows, but a last one of a single row (BatchNorm1d in
    # training mode refuses it; that row is drawn into another batch next epoch)
    steps = (max(1, len(val.y) // options.batch_size + (len(val.y) % options.batch_size > 1))
             if val is not None else 8)
    source = (_SyntheticInputs(teacher, student, val, input_shape, options, device, rng)
              if options.mode == "synthetic" else None)
    report: dict[str, Any] = {"options": asdict(options), "steps_per_epoch": steps}
    augmenting = options.mode == "val" and options.augment
    if augmenting and not val.x.is_floating_point():
        augmenting = False
        report["augment_skipped"] = NO_AUGMENT_REASON.format(dtype=val.x.dtype)
        log.info("[distill] augmentation skipped: %s", report["augment_skipped"])
    if options.mode == "val":
        report["augmented"] = augmenting
    if val is not None:
        report["teacher_val"] = _score(teacher, val, device)
    trace: list[dict[str, float]] = []
    best: dict[str, float] = {}
    best_state = {k: v.detach().clone() for k, v in student.state_dict().items()}
    start, cpu_start = time.perf_counter(), time.process_time()
    student.train()
    log.info("[distill] %s: %d epoch(s) x %d step(s) of batch %d, T=%g, lr %g, augment %s",
             options.mode, options.epochs, steps, options.batch_size, options.temperature,
             options.lr, augmenting if options.mode == "val" else "-")
    loss_sum = 0.0
    for epoch in range(options.epochs + 1):
        entry: dict[str, float] = {"epoch": epoch}
        if epoch:
            entry["kd_loss"] = loss_sum / steps
        if val is not None:
            score = _score(student, val, device)
            entry.update(val_accuracy=score["accuracy"], val_nll=score["nll"])
            if not best or ((score["accuracy"], -score["nll"])
                            > (best["val_accuracy"], -best["val_nll"])):
                best = entry
                best_state = {k: v.detach().clone() for k, v in student.state_dict().items()}
        trace.append(entry)
        if on_epoch is not None:  # its time is not the distillation's
            outside = time.perf_counter(), time.process_time()
            on_epoch(entry, student)
            start += time.perf_counter() - outside[0]
            cpu_start += time.process_time() - outside[1]
        if epoch == options.epochs:
            break
        loss_sum = 0.0
        order = (torch.randperm(len(val.y), generator=rng, device=device).cpu()
                 if val is not None else None)
        for i in range(steps):
            if source is not None:
                x, t_log_probs = source.batch(options.batch_size)
            else:
                assert order is not None
                x = val.x[order[i * options.batch_size:(i + 1) * options.batch_size]]
                x = x.to(device)
                if augmenting:
                    x = augment(x, options, rng)
                with torch.no_grad():
                    t_log_probs = teacher(x)
            optimiser.zero_grad(set_to_none=True)
            loss = kd_loss(t_log_probs.detach(), student(x.detach()), options.temperature)
            loss.backward()
            optimiser.step()
            loss_sum += loss.item()
    if best:
        student.load_state_dict(best_state)
    report.update(trace=trace, best=best, selection="validation" if best else "last",
                  seconds=time.perf_counter() - start,
                  cpu_seconds=time.process_time() - cpu_start)
    if val is not None:
        report["student_val"] = {"accuracy": best["val_accuracy"], "nll": best["val_nll"]}
        log.info("[distill] teacher val accuracy %.4f, student %.4f (epoch %d), %.1f s",
                 report["teacher_val"]["accuracy"], best["val_accuracy"], best["epoch"],
                 report["seconds"])
    return Distillation(student.cpu().eval(), report)


class _SyntheticInputs:
    """DENSE's generator trained against the teacher: each :meth:`batch` takes one generator
    step (its images and teacher outputs into the pool) and draws a student batch from the
    pool."""

    def __init__(self, teacher: nn.Module, student: nn.Module, val: Any,
                 shape: tuple[int, ...], options: DistillOptions, device: torch.device,
                 rng: torch.Generator):
        from fedfusion.synthesis import FALLBACK_RANGE, Generator, SamplePool

        with torch.no_grad():
            num_classes = int(teacher(torch.zeros(2, *shape, device=device)).shape[1])
        if val is not None:
            flat = val.x.transpose(0, 1).reshape(shape[0], -1)
            low, high = flat.min(1).values, flat.max(1).values
        else:
            low, high = (torch.full((shape[0],), float(v)) for v in FALLBACK_RANGE)
        self.teacher, self.student, self.options, self.rng = teacher, student, options, rng
        self.num_classes, self.device = num_classes, device
        self.generator = Generator(options.latent_dim, shape, num_classes,
                                   options.generator_width, low, high).to(device).train()
        self.g_opt = torch.optim.Adam(self.generator.parameters(), lr=options.g_lr,
                                      betas=(0.5, 0.999))
        self.pool = SamplePool(options.pool_batches * options.batch_size, shape, num_classes,
                               device)

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        from fedfusion.synthesis import input_stats_loss

        options, rng = self.options, self.rng
        z = torch.randn(n, options.latent_dim, generator=rng, device=self.device)
        y = torch.randint(self.num_classes, (n,), generator=rng, device=self.device)
        self.g_opt.zero_grad(set_to_none=True)
        x = self.generator(z, y)
        t_log_probs = self.teacher(x)
        s_out = self.student(x)
        disagree = (t_log_probs.argmax(1) != s_out.argmax(1)).float()
        kl = kd_terms(t_log_probs, s_out, options.temperature)
        loss = (F.nll_loss(F.log_softmax(t_log_probs, 1), y) - (kl * disagree).mean()
                + 0.1 * input_stats_loss(x))
        loss.backward(inputs=list(self.generator.parameters()))
        self.g_opt.step()
        self.pool.add(x.detach(), t_log_probs.detach())
        return self.pool.sample(n, rng)


def _check(name: str, value: object, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
