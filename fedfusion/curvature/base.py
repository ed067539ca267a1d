"""Common interface of the per-member curvature structures.

A trained member ``w_hat`` (the MAP of one client model) gets the Laplace approximation

    p(w | D_c) ~= N(w | w_hat, Lambda^{-1}),   Lambda = H / T + (1 / sigma2) I,

where ``H`` is a structured approximation of the generalised Gauss-Newton matrix (or a Fisher)
of the negative log-likelihood *summed* over the client's ``N`` samples, ``T`` the temperature
of the tempered likelihood ``p(D | w)^{1/T}`` and ``sigma2`` the variance of the isotropic
Gaussian prior ``N(0, sigma2 I)``. This is laplace-torch's posterior precision
``H * (1 / T) + prior_precision`` with ``prior_precision = 1 / sigma2``.

Every structure stores only the likelihood curvature ``H`` (never ``T`` or ``sigma2``), as a flat
``{name: np.ndarray}`` mapping whose keys are ``"<parameter name>/<array>"``. Parameter names
and their order follow ``model.named_parameters()``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import torch

ParamShapes = Mapping[str, tuple[int, ...]]

# Relative tolerance for negative eigenvalues (round-off of eigh on a PSD matrix): values in
# [-EIG_RTOL * max|lambda|, 0) are clipped to 0, anything more negative is rejected.
EIG_RTOL = 1e-6


class Curvature(ABC):
    """Posterior precision of ONE member: ``Lambda = H / T + 1/sigma2 * I``.

    ``H`` is the GGN / Fisher of the negative log-likelihood summed over the client's samples,
    approximated with the structure named by :attr:`structure`.
    """

    structure: ClassVar[str]

    def __init__(self, param_shapes: ParamShapes, temperature: float, prior_var: float) -> None:
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be positive and finite, got {temperature}")
        if not (prior_var > 0 and math.isfinite(prior_var)):
            raise ValueError(f"prior_var must be positive and finite, got {prior_var}")
        self.param_shapes: dict[str, tuple[int, ...]] = {
            name: tuple(int(s) for s in shape) for name, shape in param_shapes.items()
        }
        self.temperature = float(temperature)
        self.prior_var = float(prior_var)

    @property
    def prior_precision(self) -> float:
        """``delta = 1 / sigma2``, the prior precision added to every diagonal entry."""
        return 1.0 / self.prior_var

    @property
    def num_params(self) -> int:
        """``d``, the number of parameters the Gaussian is over."""
        return sum(math.prod(shape) for shape in self.param_shapes.values())

    @abstractmethod
    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat ``{"<param>/<array>": array}`` holding everything needed to rebuild ``H``."""

    @classmethod
    @abstractmethod
    def from_arrays(
        cls,
        arrays: Mapping[str, np.ndarray],
        param_shapes: ParamShapes,
        temperature: float,
        prior_var: float,
        *,
        check_input: bool = True,
    ) -> Curvature:
        """Rebuild from :meth:`to_arrays`; raises ``ValueError`` naming any bad array.

        ``check_input=False`` skips the checks of the values that cost more than reading
        them (an eigenvector basis' orthonormality, a block's symmetry and definiteness), for
        arrays that already passed them: a strategy's uploads, which
        :func:`~fedfusion.wire.validation.validate_upload` rebuilt with the defaults. Keys and
        shapes are still checked, and every transformation (round-off negatives clipped,
        half-precision bases re-orthonormalised) still applies, so the result is the same."""

    @abstractmethod
    def precision_logdet(self) -> float:
        """``log det Lambda``."""

    @abstractmethod
    def dense_precision(self) -> torch.Tensor:
        """Dense ``d x d`` ``Lambda`` in float64 (tests on tiny nets only)."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(params={len(self.param_shapes)}, d={self.num_params}, "
            f"T={self.temperature:g}, sigma2={self.prior_var:g})"
        )


# ----------------------------------------------------------------------------------------------
# validation helpers shared by the structures


def get_array(
    arrays: Mapping[str, np.ndarray], key: str, shape: tuple[int, ...] | None = None
) -> np.ndarray:
    """``arrays[key]`` as a floating numpy array, checked for presence, shape and finiteness."""
    if key not in arrays:
        raise ValueError(f"missing array {key!r}")
    arr = np.asarray(arrays[key])
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"array {key!r} must be floating point, got dtype {arr.dtype}")
    if shape is not None and arr.shape != tuple(shape):
        raise ValueError(f"array {key!r} has shape {arr.shape}, expected {tuple(shape)}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"array {key!r} contains non-finite values (NaN or inf)")
    return arr


def clip_nonnegative(key: str, values: np.ndarray) -> np.ndarray:
    """Clip round-off negatives (``> -EIG_RTOL * max|v|``) to 0; reject larger negatives.

    Returns ``values`` itself (no copy) when nothing is negative, so that a valid array
    round-trips bit-exactly.
    """
    if values.size == 0 or values.min() >= 0:
        return values
    scale = float(np.abs(values).max())
    if values.min() < -EIG_RTOL * scale:
        raise ValueError(
            f"array {key!r} has negative entries (min {values.min():.3e}, "
            f"allowed > {-EIG_RTOL * scale:.3e}); the curvature must be positive semi-definite"
        )
    return np.maximum(values, 0).astype(values.dtype, copy=False)


def check_unexpected(arrays: Mapping[str, np.ndarray], expected: set[str]) -> None:
    """Reject keys that no parameter of ``param_shapes`` accounts for."""
    extra = sorted(set(arrays) - expected)
    if extra:
        raise ValueError(f"unexpected arrays {extra}; not parameters of this model/structure")


def as_tensor(arr: np.ndarray) -> torch.Tensor:
    """CPU tensor sharing nothing with ``arr`` (float16/bfloat16 are upcast to float32)."""
    tensor = torch.from_numpy(np.array(arr, copy=True))
    if tensor.dtype in (torch.float16, torch.bfloat16):
        tensor = tensor.float()
    return tensor


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy().copy()
