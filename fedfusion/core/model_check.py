"""One check of a model against what a fusion strategy needs, run before anything trains.

Some strategies cannot fuse some models by design: DENSE's and Co-Boosting's generators (and
``distill="synthetic"``) make float images and cannot make token ids, PFNM matches the
neurons of plain MLPs only, OTFusion permutes only the channels it can follow through the
module graph. Found after the clients trained, such a model costs the federation its local
training for nothing; :func:`check_model` finds it first, on the untrained model:

1. a **dry forward**, in eval mode and without gradients, on at most :data:`DRY_ROWS` inputs
   of the right dtype (the caller's own: the server's validation inputs, a client's training
   rows; else zeros of the declared input shape: float32, or int64 token ids where the model
   runs on those and not on float ones). It must return finite scores ``[n, K]``, ``K`` at
   least the number of classes where it is known; the first leaf module it calls is
   recorded;
2. every **requirement** the strategy declares (:data:`REQUIREMENTS`), each a function of the
   model, its architecture's name, the inputs of step 1 and that first module, returning why
   the model fails it (naming the module and the alternative) or None:

   * ``"float-inputs"``: the strategy generates the inputs (DENSE, Co-Boosting);
   * ``"synthetic-distill"``: ``distill="synthetic"`` generates them;
   * ``"mlp"``: PFNM (:func:`fedfusion.strategies.pfnm.not_an_mlp`), and ``"alignable"``:
     OTFusion (:func:`fedfusion.strategies.alignment.graph.alignment_structure`), each declared by
     its strategy (``requirement_checks``; this module imports no strategy).

The server runs it once when a strategy is constructed
(:class:`~fedfusion.core.fusion.Fusion`), on the network its architecture builds; the
strategy names itself and its requirements in every round's train config
(:data:`STRATEGY_KEY`, :data:`REQUIREMENTS_KEY`), and the client runs the same check on the
models it was sent, with its own inputs, before its first training step
(:func:`fedfusion.client.initial_models`, the built-in ClientApp): what the server could not
tell (a user's ``model_fn`` without validation data or input shape) the client can. A failure
raises :class:`ModelRefused`, a ``ValueError``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedfusion.core.inputs import first_called, integer_reason
from fedfusion.flower.train_config import MODEL_KEY, REQUIREMENTS_KEY, STRATEGY_KEY

log = logging.getLogger("fedfusion")

#: rows of the dry forward: enough for a batch statistic, few enough to cost nothing
DRY_ROWS = 4
#: train-config keys: the strategy's name and the requirements the client checks

#: (model, architecture name, dry-forward inputs or None, first module called or None,
#: strategy name) -> why the model fails the requirement, or None
Requirement = Callable[[nn.Module, str, torch.Tensor | None, tuple[str, nn.Module] | None, str],
                       str | None]


class ModelRefused(ValueError):
    """A model the strategy cannot fuse (or cannot run), refused before any training."""


def _float_inputs(model: nn.Module, name: str, x: torch.Tensor | None,
                  first: tuple[str, nn.Module] | None, strategy: str) -> str | None:
    reason = integer_reason(x, first)
    if reason is None:
        return None
    return (f"{strategy} cannot fuse model {name!r}: {reason}. {strategy} is data-free: its "
            "generator makes float images [C, H, W] and cannot make token ids. Distil on the "
            "validation inputs instead (distill='val' on another strategy, e.g. "
            "UniformEnsemble(..., distill='val')), or fuse with another strategy such as "
            "'fedbens', 'ensemble', 'ams' or 'regmean'")


def _synthetic_distill(model: nn.Module, name: str, x: torch.Tensor | None,
                       first: tuple[str, nn.Module] | None, strategy: str) -> str | None:
    from fedfusion.distillation import NO_SYNTHETIC_REASON

    reason = integer_reason(x, first)
    if reason is None:
        return None
    return (f"{strategy} cannot distil model {name!r}: {reason}; "
            + NO_SYNTHETIC_REASON.format(dtype="integer"))


#: the requirements of this module, by the name the train config carries; a strategy adds
#: its own (``requirement_checks``: PFNM's ``"mlp"``, OTFusion's ``"alignable"``), and
#: :data:`fedfusion.strategies.requirements.ALL_REQUIREMENTS` holds every one
REQUIREMENTS: dict[str, Requirement] = {
    "float-inputs": _float_inputs,
    "synthetic-distill": _synthetic_distill,
}


def dry_inputs(model: nn.Module, input_shape: Sequence[int]) -> torch.Tensor:
    """Zeros of ``input_shape`` for :data:`DRY_ROWS` rows: float32, or int64 (token id 0)
    where the model runs on those and not on float ones (an ``nn.Embedding`` reading the
    input; an Embedding of the model's own indices does not count)."""
    device = next(iter(model.parameters()), torch.zeros(0)).device
    probe = torch.zeros(DRY_ROWS, *input_shape, device=device)
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        for x in (probe, probe.long()):
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    model(x)
            except Exception:  # noqa: BLE001, S112 (the user's forward: try the other dtype)
                continue
            return x
    finally:
        for module, training in modes.items():
            module.train(training)
    return probe  # neither runs: the check's forward reports the float one's error


def check_model(
    model: nn.Module,
    requirements: Sequence[str] = (),
    *,
    x: torch.Tensor | None = None,
    input_shape: Sequence[int] = (),
    num_classes: int = 0,
    name: str | None = None,
    strategy: str = "the strategy",
    checks: Mapping[str, Requirement] = REQUIREMENTS,
) -> dict[str, Any]:
    """The module docstring's check of ``model`` (architecture ``name``, default its class
    name) for ``strategy`` and its ``requirements``: the dry forward on ``x[:DRY_ROWS]`` (else
    zeros of ``input_shape``; neither: no forward), then every requirement. Returns what was
    checked (``rows``, ``dtype``, ``output_shape`` or None without a forward, and
    ``requirements``); raises :class:`ModelRefused` naming the problem. The model's
    train/eval modes and the caller's RNG are left as they were. ``checks``: the function of
    each requirement name (the strategy's own beside :data:`REQUIREMENTS`)."""
    name = name or type(model).__name__
    unknown = [r for r in requirements if r not in checks]
    if unknown:
        raise ValueError(f"unknown model requirement(s) {unknown}; known: {sorted(checks)}")
    if x is None and input_shape:
        x = dry_inputs(model, input_shape)
    checked: dict[str, Any] = {"rows": 0, "dtype": None, "output_shape": None,
                               "requirements": list(requirements)}
    first = None
    if x is not None and len(x):
        x = x[:DRY_ROWS]
        device = next(iter(model.parameters()), torch.zeros(0)).device
        modes = {m: m.training for m in model.modules()}
        try:
            model.eval()
            with torch.random.fork_rng(devices=[]):  # a forward that draws leaves no trace
                first = first_called(model, x.to(device))
                with torch.no_grad():
                    out = model(x.to(device))
        except Exception as exc:  # noqa: BLE001 (the user's forward: any error is the answer)
            raise ModelRefused(
                f"{strategy}: model {name!r} fails a dry forward on {len(x)} input(s) of "
                f"shape {tuple(x.shape[1:])} and dtype {x.dtype}, before any training: "
                f"{type(exc).__name__}: {exc}") from exc
        finally:
            for module, training in modes.items():
                module.train(training)
        problem = None
        if not isinstance(out, torch.Tensor) or out.ndim != 2 or len(out) != len(x):
            shown = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            problem = f"returns {shown}, not class scores [{len(x)}, K]"
        elif out.shape[1] < num_classes:  # (a class count read off labels is a lower bound)
            problem = (f"returns {out.shape[1]} scores per input, fewer than the {num_classes} "
                       "classes")
        elif not torch.isfinite(out).all():
            problem = "returns NaN or Inf"
        if problem:
            raise ModelRefused(f"{strategy}: model {name!r}, on a dry forward of {len(x)} "
                               f"input(s) before any training, {problem}")
        checked.update(rows=len(x), dtype=str(x.dtype), output_shape=list(out.shape))
    for requirement in requirements:
        reason = checks[requirement](model, name, x, first, strategy)
        if reason is not None:
            raise ModelRefused(reason)
    return checked


def check_received(model: nn.Module, config: Mapping[str, Any], x: torch.Tensor | None,
                   name: str | None = None, checks: Mapping[str, Requirement] = REQUIREMENTS
                   ) -> dict[str, Any] | None:
    """The client's side: :func:`check_model` of ``model`` for the strategy and the
    requirements the server's train ``config`` names, on the client's inputs ``x``. A
    requirement this client does not know (a newer server) is skipped with a warning: the
    server has checked it on its side. None where the config names no strategy (the server
    is not a fedfusion strategy, or an older one)."""
    if STRATEGY_KEY not in config:
        return None
    strategy = str(config[STRATEGY_KEY])
    listed = config.get(REQUIREMENTS_KEY, [])
    if isinstance(listed, str) or not isinstance(listed, Sequence):
        raise ValueError(f"the server's train config {REQUIREMENTS_KEY!r} must be a list of "
                         f"names, got {type(listed).__name__}")
    requirements = [str(r) for r in listed]
    for unknown in [r for r in requirements if r not in checks]:
        log.warning("model requirement %r of %s is unknown to this client; not checked here",
                    unknown[:60], strategy)
    requirements = [r for r in requirements if r in checks]
    if name is None and MODEL_KEY in config:
        name = str(config[MODEL_KEY])
    return check_model(model, requirements, x=x, name=name, strategy=strategy, checks=checks)
