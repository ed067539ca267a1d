"""Diagonal and diagonal + full-last-layer curvature.

``diag``: ``H = diag(h)`` with ``h`` the diagonal of the GGN (summed over the client's samples),

    Lambda = diag(h / T + 1/sigma2),   log det Lambda = sum_i log(h_i / T + 1/sigma2),
    (w - m)^T Lambda (w - m) = sum_i (h_i / T + 1/sigma2) (w_i - m_i)^2.

``diag_full`` (the paper's "Diagonal+Full", Sec. 4.3 / App. C.1): the diagonal for every layer
except the last linear layer, whose block ``H_L`` (``n x n``, ``n = n_classes * n_last`` for a
bias-free last layer) is kept dense:

    Lambda = blockdiag(diag(h / T + 1/sigma2), H_L / T + 1/sigma2 I).

The last layer is the last parameter with two or more dimensions (in ``named_parameters()``
order) together with every parameter after it (its bias, if any); its block is ordered like
``torch.cat([p.flatten() for p in last_layer_params])``, as laplace-torch's last-layer Laplace.
Negative eigenvalues of ``H_L`` within round-off (``> -EIG_RTOL * max``) are accepted as they are
(they are dominated by ``1/sigma2``); clipping them would mean re-projecting the matrix, which
would break the bit-exact round trip.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import torch

from fedfusion.curvature.base import (
    EIG_RTOL,
    Curvature,
    ParamShapes,
    as_tensor,
    check_unexpected,
    clip_nonnegative,
    get_array,
    to_numpy,
)


def _diag_from_arrays(
    arrays: Mapping[str, np.ndarray], names: list[str], param_shapes: ParamShapes
) -> dict[str, torch.Tensor]:
    diag: dict[str, torch.Tensor] = {}
    for name in names:
        key = f"{name}/ggn_diag"
        values = clip_nonnegative(key, get_array(arrays, key, tuple(param_shapes[name])))
        diag[name] = as_tensor(values)
    return diag


def _diag_logdet(diag: Mapping[str, torch.Tensor], temperature: float, delta: float) -> float:
    return sum(float(torch.log(h.double() / temperature + delta).sum()) for h in diag.values())


class DiagCurvature(Curvature):
    """Diagonal GGN: ``Lambda = diag(h / T + 1/sigma2)``; arrays ``"<param>/ggn_diag"``."""

    structure: ClassVar[str] = "diag"

    def __init__(
        self,
        diag: Mapping[str, torch.Tensor],
        param_shapes: ParamShapes,
        temperature: float,
        prior_var: float,
    ) -> None:
        super().__init__(param_shapes, temperature, prior_var)
        self.diag: dict[str, torch.Tensor] = {name: diag[name] for name in self.param_shapes}

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {f"{name}/ggn_diag": to_numpy(h) for name, h in self.diag.items()}

    @classmethod
    def from_arrays(
        cls,
        arrays: Mapping[str, np.ndarray],
        param_shapes: ParamShapes,
        temperature: float,
        prior_var: float,
        *,
        check_input: bool = True,
    ) -> DiagCurvature:
        """Rebuild from :meth:`to_arrays` (``check_input``: accepted for the common
        interface; no check of a diagonal costs more than reading it)."""
        names = list(param_shapes)
        check_unexpected(arrays, {f"{name}/ggn_diag" for name in names})
        diag = _diag_from_arrays(arrays, names, param_shapes)
        return cls(diag, param_shapes, temperature, prior_var)

    def precision_logdet(self) -> float:
        return _diag_logdet(self.diag, self.temperature, self.prior_precision)

    def precision_diag(self, name: str) -> torch.Tensor:
        """``h / T + 1/sigma2`` of one parameter (parameter shaped)."""
        return self.diag[name] / self.temperature + self.prior_precision

    def dense_precision(self) -> torch.Tensor:
        flat = torch.cat([self.precision_diag(n).double().flatten() for n in self.param_shapes])
        return torch.diag(flat)


def _is_psd(block: np.ndarray, tol: float) -> bool:
    """``min eig(block) > -tol``, via a Cholesky of ``block + tol I`` in float64 (4x cheaper than
    the eigenvalues; a pivot failure means an eigenvalue at or below ``-tol``, up to round-off)."""
    shifted = torch.from_numpy(block.astype(np.float64))
    shifted = 0.5 * (shifted + shifted.T) + tol * torch.eye(block.shape[0], dtype=torch.float64)
    return torch.linalg.cholesky_ex(shifted).info.item() == 0


def _check_symmetric_psd(key: str, block: np.ndarray) -> None:
    """Reject a block that is not symmetric and positive semi-definite (to :data:`EIG_RTOL` of
    its largest entry)."""
    scale = float(np.abs(block).max()) if block.size else 0.0
    asym = float(np.abs(block - block.T).max()) if block.size else 0.0
    if asym > EIG_RTOL * scale:
        raise ValueError(f"array {key!r} is not symmetric (max |H - H^T| = {asym:.3e})")
    if scale > 0 and not _is_psd(block, EIG_RTOL * scale):
        min_eig = float(np.linalg.eigvalsh(block.astype(np.float64)).min())
        raise ValueError(
            f"array {key!r} is not positive semi-definite (min eigenvalue "
            f"{min_eig:.3e}, allowed > {-EIG_RTOL * scale:.3e})"
        )


def last_layer_names(param_shapes: ParamShapes) -> list[str]:
    """The last parameter with ``ndim >= 2`` and all parameters after it."""
    names = list(param_shapes)
    matrices = [i for i, name in enumerate(names) if len(param_shapes[name]) >= 2]
    if not matrices:
        raise ValueError("diag_full needs a last layer with a weight matrix")
    return names[matrices[-1] :]


class DiagFullCurvature(Curvature):
    """Diagonal GGN for all but the last linear layer, dense GGN block ``H_L`` for it.

    Arrays: ``"<param>/ggn_diag"`` for the diagonal parameters and one
    ``"<last weight>/ggn_full"`` ``[n, n]`` for the last layer.
    """

    structure: ClassVar[str] = "diag_full"

    def __init__(
        self,
        diag: Mapping[str, torch.Tensor],
        last_block: torch.Tensor,
        param_shapes: ParamShapes,
        temperature: float,
        prior_var: float,
    ) -> None:
        super().__init__(param_shapes, temperature, prior_var)
        self.last_names = last_layer_names(self.param_shapes)
        self.diag_names = [name for name in self.param_shapes if name not in self.last_names]
        self.diag: dict[str, torch.Tensor] = {name: diag[name] for name in self.diag_names}
        n = self.last_size
        if tuple(last_block.shape) != (n, n):
            raise ValueError(f"last-layer block has shape {tuple(last_block.shape)}, need {n}")
        self.last_block = last_block

    @property
    def last_size(self) -> int:
        return sum(math.prod(self.param_shapes[name]) for name in self.last_names)

    @property
    def full_key(self) -> str:
        return f"{self.last_names[0]}/ggn_full"

    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays = {f"{name}/ggn_diag": to_numpy(h) for name, h in self.diag.items()}
        arrays[self.full_key] = to_numpy(self.last_block)
        return arrays

    @classmethod
    def from_arrays(
        cls,
        arrays: Mapping[str, np.ndarray],
        param_shapes: ParamShapes,
        temperature: float,
        prior_var: float,
        *,
        check_input: bool = True,
    ) -> DiagFullCurvature:
        last = last_layer_names(param_shapes)
        diag_names = [name for name in param_shapes if name not in last]
        full_key = f"{last[0]}/ggn_full"
        check_unexpected(arrays, {f"{name}/ggn_diag" for name in diag_names} | {full_key})
        diag = _diag_from_arrays(arrays, diag_names, param_shapes)
        n = sum(math.prod(param_shapes[name]) for name in last)
        block = get_array(arrays, full_key, (n, n))
        if check_input:
            _check_symmetric_psd(full_key, block)
        return cls(diag, as_tensor(block), param_shapes, temperature, prior_var)

    def last_precision(self) -> torch.Tensor:
        """``H_L / T + 1/sigma2 I`` (symmetrised), ``[n, n]``, in the block's dtype."""
        block = 0.5 * (self.last_block + self.last_block.T)
        eye = torch.eye(block.shape[0], dtype=block.dtype)
        return block / self.temperature + self.prior_precision * eye

    def precision_diag(self, name: str) -> torch.Tensor:
        return self.diag[name] / self.temperature + self.prior_precision

    def precision_logdet(self) -> float:
        logdet = _diag_logdet(self.diag, self.temperature, self.prior_precision)
        chol = torch.linalg.cholesky(self.last_precision().double())
        return logdet + 2.0 * float(torch.log(torch.diagonal(chol)).sum())

    def dense_precision(self) -> torch.Tensor:
        flat = [self.precision_diag(n).double().flatten() for n in self.diag_names]
        diag = torch.diag(torch.cat(flat)) if flat else torch.zeros(0, 0, dtype=torch.float64)
        return torch.block_diag(diag, self.last_precision().double())
