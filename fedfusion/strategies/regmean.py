"""RegMean (Jin, Ren, Preotiuc-Pietro, Cheng, ICLR 2023): merge models by regression means.

For every Linear/Conv2d layer RegMean picks the merged weight W that minimises the summed
squared difference between its outputs and each client's layer outputs on that client's
own layer inputs X_i (all samples, all spatial positions for a conv layer):

    min_W sum_i ||X_i W^T - X_i W_i^T||^2   =>   W*^T = (sum_i G_i)^-1 sum_i G_i W_i^T,

G_i = X_i^T X_i the client's Gram (upload section ``gram``, :mod:`fedfusion.sections.gram`). RegMean
regularises by shrinking the off-diagonal of every Gram, G~_i = alpha G_i + (1-alpha)
diag(G_i), and solves with the G~_i (alpha = 1: the exact least-squares merge; alpha -> 0:
a per-input-feature weighted average).

Details and departures from the reference code (Jin et al.'s and the FedFisher/FedBEns copies):

* The Grams are SUMS over each client's samples (the least-squares objective above), so a
  client's weight in the merge grows with its data; the reference code averages them.
* Conv layers are merged too, as the linear maps of their unfolded input patches
  (W viewed as ``[out, c*kh*kw]``); the reference copies fall back to a plain mean for them.
* A layer with a bias merges ``[W | b]`` with the Gram of the inputs augmented by a constant 1
  (our bias-free LeNet/CNN have none).
* Which entries are Linear/Conv2d layers is read from the MODULE TYPES of the server's model
  (built once on the meta device: :func:`fedfusion.sections.gram.model_gram_sizes`), not
  guessed from shapes; every upload's ``gram`` section must hold exactly one Gram per such
  layer, of the module's size (:meth:`RegMean.check_grams`, on top of the ``gram``
  section's validator, which is as exact when the server's shapes know the module types and
  otherwise only bounds the names by the shape rule: see :mod:`fedfusion.sections.gram`).
* Everything else in the state dict is merged by the sample-weighted average
  ``sum_i n_i v_i / sum_i n_i`` (n_i = the client's examples;
  :func:`~fedfusion.strategies.fedavg.weighted_average`, which takes integer entries such as
  BatchNorm's ``num_batches_tracked`` from the client with the most examples instead): the
  affine parameters of BatchNorm/LayerNorm/GroupNorm, BatchNorm's running statistics,
  embeddings, and any other parameter or buffer. RegMean's objective is defined for linear
  maps only; the paper, too, averages its transformers' other weights (embeddings, LayerNorm)
  plainly. The running statistics so averaged are not those of the merged network's
  own activations; recalibrating them on server data is not RegMean's business.
* ``regmean_alpha`` is a comma list: with a server validation set the strategy fuses with each
  alpha and keeps the best validation accuracy (all are reported); without one it uses the
  LAST value. Since sum_i G~_i and sum_i G~_i W_i^T are linear in alpha, the client sums are
  formed once and every alpha costs one solve per layer.
* The solve is ``torch.linalg.solve`` in float64 on the server device. When sum_i G~_i is
  singular or nearly so (eigenvalue ratio below :data:`SINGULAR_RCOND`: dead units, constant
  input pixels with alpha = 1) it adds a tiny ridge ``lam = RIDGE * lambda_max`` pulling
  towards the sample-weighted average W_avg, (S + lam I) W^T = R + lam W_avg^T, so directions
  no client's inputs reach keep the FedAvg weights instead of arbitrary values.
* Attention: the packed in-projection of ``nn.MultiheadAttention`` (``[W_in | b_in]``,
  ``[3d, d+1]``) and its ``out_proj`` are linear maps of captured inputs
  (:mod:`fedfusion.capture`) and are merged like Linear layers; a layer whose Gram sum is
  zero (no client captured an input of it) keeps the average. ``report()`` lists
  ``gram_layers`` and the ``averaged`` parameters.
* Members (M > 1 per client) are merged index by index, as FedAvg does, into an ensemble.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfusion.core.architecture import ModelFn, ModelSpec
from fedfusion.core.evaluation import evaluate
from fedfusion.core.predictors import Ensemble
from fedfusion.core.state import weighted_average
from fedfusion.flower.strategy import FusionStrategy
from fedfusion.sections.gram import check_gram_names, gram_layers, model_gram_sizes
from fedfusion.wire import WEIGHTS, ClientUpload, UploadError

log = logging.getLogger("fedfusion")

GRAM = "gram"
#: sum_i G~_i counts as singular when lambda_min <= SINGULAR_RCOND * lambda_max
SINGULAR_RCOND = 1e-12
#: ridge (relative to lambda_max) added to a singular sum_i G~_i
RIDGE = 1e-10


def parse_alphas(text: str) -> list[float]:
    """``"0.1,0.5,0.9"`` -> [0.1, 0.5, 0.9]; each alpha must lie in [0, 1]."""
    try:
        alphas = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ValueError(f"alphas must look like '0.1,0.5,0.9', got {text!r}") from exc
    if not alphas or not all(0.0 <= a <= 1.0 for a in alphas):
        raise ValueError(f"alphas need values in [0, 1], got {text!r}")
    return alphas


@dataclass
class LayerSums:
    """One layer's client sums: S = sum_i G_i, R = sum_i G_i W_i^T, D = sum_i diag(G_i) W_i^T,
    so that for any alpha sum_i G~_i = alpha S + (1-alpha) diag(S) and
    sum_i G~_i W_i^T = alpha R + (1-alpha) D. ``average`` is W_avg^T (FedAvg); ``bias`` the
    layer's bias parameter (its last row of W^T), if it has one."""

    gram: torch.Tensor  # [n, n]
    cross: torch.Tensor  # [n, out]
    diag_cross: torch.Tensor  # [n, out]
    average: torch.Tensor  # [n, out]
    bias: str | None = field(default=None)

    def solve(self, alpha: float) -> tuple[torch.Tensor, float]:
        """W*^T for this alpha, and the ridge used (0 when the system is regular)."""
        diag = torch.diag(torch.diagonal(self.gram))
        lhs = alpha * self.gram + (1.0 - alpha) * diag
        rhs = alpha * self.cross + (1.0 - alpha) * self.diag_cross
        eig = torch.linalg.eigvalsh(lhs)
        top = float(eig[-1])
        if top <= 0.0:  # no client's input reaches this layer: keep the average
            return self.average.clone(), float("inf")
        if float(eig[0]) > SINGULAR_RCOND * top:
            return torch.linalg.solve(lhs, rhs), 0.0
        ridge = RIDGE * top
        eye = torch.eye(len(lhs), dtype=lhs.dtype, device=lhs.device)
        return torch.linalg.solve(lhs + ridge * eye, rhs + ridge * self.average), ridge


def as_matrix(weights: dict[str, np.ndarray], name: str, bias: str | None) -> np.ndarray:
    """``[W.reshape(out, -1) | b]`` of the layer whose weight is ``name`` and bias ``bias``
    (None: no bias): ``[out, n]``."""
    w = weights[name].reshape(weights[name].shape[0], -1)
    if bias is not None:
        w = np.concatenate([w, weights[bias][:, None]], axis=1)
    return w.astype(np.float64)


class RegMean(FusionStrategy):
    """Gram-weighted least-squares merge of every Linear/Conv2d layer, the sample-weighted
    average of every other state-dict entry; alpha chosen on validation.

    Parameters
    ----------
    alphas : sequence of float or str, default (0.1, 0.5, 0.9)
        Off-diagonal scales of the Grams (or ``"0.1,0.5,0.9"``); several are chosen on the
        validation set, without one the last is used.
    """

    name = "regmean"
    applies_norm_stats = True
    required_sections = (WEIGHTS, GRAM)

    def __init__(self, model_fn: ModelFn | nn.Module | ModelSpec, *,
                 alphas: Sequence[float] | str = (0.1, 0.5, 0.9), **kwargs: Any):
        super().__init__(model_fn, **kwargs)
        if isinstance(alphas, str):
            alphas = parse_alphas(alphas)
        if not alphas:
            raise ValueError("RegMean needs at least one alpha")
        self.alphas = [float(a) for a in alphas]
        self._report: dict[str, Any] = {}
        self._layers: dict[str, tuple[int, str | None]] | None = None

    # ------------------------------------------------------------------ layers
    def linear_layers(self) -> dict[str, tuple[int, str | None]]:
        """Every Linear/Conv2d weight of the server's model -> (Gram side, its bias parameter
        or None), from the module types (the model built once, on the meta device)."""
        if self._layers is None:
            with torch.device("meta"):
                model = self.context.model_spec.build()
            sizes = model_gram_sizes(model)
            self._layers = {name: (sizes[name], layer.bias)
                            for name, layer in gram_layers(model).items()}
        return self._layers

    def check_grams(self, upload: ClientUpload) -> None:
        """Every member's ``gram`` section holds exactly one Gram per Linear/Conv2d weight of
        the model, of the module's size (names and shapes; the values are the section
        validator's, and a missing or malformed section is :func:`validate_upload`'s to
        report). Raises :class:`UploadError`."""
        sizes = {name: size for name, (size, _) in self.linear_layers().items()}
        members = upload.members if isinstance(upload.members, list) else []
        for m, member in enumerate(members):
            arrays = member.get(GRAM) if isinstance(member, dict) else None
            if not isinstance(arrays, dict):
                continue
            try:
                check_gram_names(arrays, sizes)
            except (ValueError, TypeError) as exc:
                raise UploadError(upload.client_id, f"member {m} section {GRAM!r}: {exc}"
                                  ) from exc

    def check_upload(self, upload: ClientUpload) -> None:
        """The server's architecture (as every strategy), then :meth:`check_grams`."""
        super().check_upload(upload)
        self.check_grams(upload)


    # ------------------------------------------------------------------ math
    def layer_sums(self, uploads: Sequence[ClientUpload], member: int
                   ) -> tuple[dict[str, LayerSums], dict[str, np.ndarray]]:
        """Client sums of every Linear/Conv2d layer of member ``member``, and the
        sample-weighted average of the whole state dict (what every other entry keeps)."""
        holders = [u for u in uploads if u.num_members > member]
        counts = [float(u.num_examples) for u in holders]
        average = weighted_average([u.weights(member) for u in holders], counts)
        device, f64 = self.context.device, torch.float64
        sums = {}
        for name, (size, bias) in self.linear_layers().items():
            avg = torch.from_numpy(as_matrix(average, name, bias).T.copy()).to(device)
            layer = LayerSums(torch.zeros(size, size, dtype=f64, device=device),
                              torch.zeros_like(avg), torch.zeros_like(avg), avg, bias)
            for upload in holders:
                gram = torch.from_numpy(upload.members[member][GRAM][name]).to(device, f64)
                w_t = torch.from_numpy(as_matrix(upload.weights(member), name, bias).T
                                       .copy()).to(device)
                layer.gram += gram
                layer.cross += gram @ w_t
                layer.diag_cross += torch.diagonal(gram)[:, None] * w_t
            sums[name] = layer
        return sums, average

    def merge(self, sums: dict[str, LayerSums], average: dict[str, np.ndarray], alpha: float
              ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The merged state dict for one alpha, and the ridge used per layer."""
        merged = {k: v.copy() for k, v in average.items()}
        ridges = {}
        for name, layer in sums.items():
            w_t, ridges[name] = layer.solve(alpha)
            w = w_t.T.cpu().numpy()
            shape = average[name].shape
            if layer.bias is not None:  # [W | b]
                merged[layer.bias] = w[:, -1].astype(average[layer.bias].dtype)
                w = w[:, :-1]
            merged[name] = w.reshape(shape).astype(average[name].dtype)
        return merged, ridges

    # ------------------------------------------------------------------ fusion
    def fuse(self, uploads: Sequence[ClientUpload]) -> nn.Module:
        spec = self.context.model_spec
        num_members = max(u.num_members for u in uploads)
        per_member = [self.layer_sums(uploads, m) for m in range(num_members)]
        val = self.context.val if self.context.val is not None and len(self.context.val) else None
        candidates = self.alphas if val is not None else self.alphas[-1:]
        results: list[dict[str, Any]] = []
        best: tuple[float, float, Ensemble] | None = None
        for alpha in candidates:
            states, ridges = [], {}
            for m, (sums, average) in enumerate(per_member):
                state, member_ridges = self.merge(sums, average, alpha)
                states.append(state)
                ridges.update({f"m{m}/{k}": v for k, v in member_ridges.items() if v})
            predictor = Ensemble([spec.build(s) for s in states], [spec] * num_members)
            recalibrated = self._apply_norm_stats(predictor)  # scored with what it will keep
            entry: dict[str, Any] = {"alpha": alpha, "ridged_layers": ridges}
            if val is not None:
                metrics = evaluate(predictor, val.x, val.y, self.context.device)
                entry["val_accuracy"] = metrics["accuracy"]
                entry["val_nll"] = metrics["nll"]
                log.info("[regmean] alpha %.3g: validation accuracy %.2f%%", alpha,
                         100 * metrics["accuracy"])
                score = metrics["accuracy"]
            else:
                score = 0.0
            results.append(entry)
            if best is None or score > best[0]:
                best = (score, alpha, predictor)
                self.recalibrated_layers = recalibrated
        assert best is not None
        merged = {n for name, (_, bias) in self.linear_layers().items() for n in (name, bias)}
        self._report = {"alphas": results, "chosen_alpha": best[1],
                        "selection": "validation" if val is not None else "last value",
                        # the stated rule: Gram-weighted least squares for the linear maps,
                        # the sample-weighted average for every other state entry
                        "gram_layers": list(self.linear_layers()),
                        "averaged": [n for n in spec.param_shapes() if n not in merged]}
        return best[2].cpu()

    def report(self) -> dict[str, Any]:
        return dict(self._report)
