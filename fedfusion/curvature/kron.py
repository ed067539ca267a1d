"""Kronecker-factored (K-FAC) curvature, stored as eigendecompositions of the two factors.

Every parameter ``W`` is viewed as a matrix ``[out, in']``: a linear weight ``[out, in]`` as is,
a convolution weight ``[out, in, k, k]`` as ``[out, in * k * k]`` (row-major, i.e.
``W.reshape(out, -1)``), and a 1-D parameter (a bias) ``[n]`` as ``[1, n]``. Its block of the
GGN, in the row-major ordering ``vec(W) = W.flatten()``, is

    H_W ~= B (x) A,

with ``B`` the ``[out, out]`` factor of back-propagated output gradients and ``A`` the
``[in', in']`` factor of layer inputs. This is laplace-torch's ``Kron`` layout (``kfacs[l] ==
[B, A]``, ``Kron.to_matrix() == kron(B, A)``), verified against a dense GGN in the tests. Its
scaling is the one of a sum over the client's ``N`` samples: laplace-torch's backends return
``B = sum_n g_n g_n^T`` and ``A = (1/N) sum_n a_n a_n^T`` (``Kron`` factors are summed over
batches after multiplying ``A`` by ``batch / N``), so for ``N`` copies of one input ``B (x) A``
equals the exact GGN summed over the ``N`` samples. For a 1-D parameter the single dense block
``F`` of laplace-torch becomes ``A = F`` with the trivial output factor ``B = [[1]]``.

With ``B = Q_B diag(l_B) Q_B^T`` and ``A = Q_A diag(l_A) Q_A^T`` the posterior precision block is

    Lambda_W = (Q_B (x) Q_A) diag(vec(outer(l_B, l_A) / T + 1/sigma2)) (Q_B (x) Q_A)^T,

exactly laplace-torch's ``KronDecomposed`` ``H * (1/T) + prior_precision`` (it multiplies each
factor's eigenvalues by ``(1/T)^{1/2}``, which gives the same product). So

    log det Lambda_W = sum_{o,i} log(l_B[o] l_A[i] / T + 1/sigma2)
    (w - m)^T Lambda_W (w - m) = sum_{o,i} S[o,i]^2 (l_B[o] l_A[i] / T + 1/sigma2),
    S = Q_B^T (W - M) Q_A.

Low-rank / half-precision storage (:meth:`KronCurvature.to_arrays`): ``rank=r`` keeps only the
``r`` largest eigenpairs of each factor, i.e. ``B`` is replaced by ``Q_B,r diag(l_B,r) Q_B,r^T``
(the dropped eigenvalues are set to 0). The precision is then

    Lambda_W = (1/sigma2) I + (Q_B,r (x) Q_A,r) diag(vec(outer(l_B,r, l_A,r) / T))
                                                 (Q_B,r (x) Q_A,r)^T,

still exact to evaluate in the truncated eigenbasis (quad = ||W - M||^2 / sigma2 + sum S_r^2 *
outer / T, logdet adds ``(out * in' - r_B r_A) log(1/sigma2)``) and cheaper. ``eigvec_dtype=
np.float16`` stores the eigenvectors (entries in [-1, 1]) in half precision; eigenvalues stay in
their dtype, as GGN eigenvalues can exceed float16's range.

:meth:`from_arrays` accepts an eigenvector basis only if it is orthonormal to the precision of
its dtype, but never stricter than float32's (:func:`orthonormal_tolerance`): a basis computed
in float32 and stored as float64 passes; a float16 basis must be orthonormal to float16
precision (a basis that is not is rejected, never repaired). An accepted float16 basis is then
upcast to float32 and re-orthonormalised (QR), so that the log-determinant and the quadratic
form describe the same matrix.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from fedfusion.curvature.base import (
    Curvature,
    ParamShapes,
    as_tensor,
    check_unexpected,
    clip_nonnegative,
    get_array,
    to_numpy,
)

FACTOR_KEYS = ("eigvals_out", "eigvecs_out", "eigvals_in", "eigvecs_in")
#: array key of a diagonal block (a parameter outside Linear / Conv2d)
DIAG_KEY = "ggn_diag"
_HALF_DTYPES = (np.float16,)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(out, in')`` of the matrix view of a parameter of ``shape``."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class KronFactors:
    """Eigendecomposition of one layer's Kronecker factors ``B = Q_B diag(l_B) Q_B^T`` (output
    side, ``[out, out]``) and ``A = Q_A diag(l_A) Q_A^T`` (input side, ``[in', in']``), possibly
    truncated to ``r_B`` / ``r_A`` columns."""

    eigvals_out: torch.Tensor  # [r_B]
    eigvecs_out: torch.Tensor  # [out, r_B]
    eigvals_in: torch.Tensor  # [r_A]
    eigvecs_in: torch.Tensor  # [in', r_A]

    def likelihood_eigvals(self, temperature: float) -> torch.Tensor:
        """``outer(l_B, l_A) / T``, ``[r_B, r_A]``: eigenvalues of ``(B (x) A) / T``."""
        return torch.outer(self.eigvals_out, self.eigvals_in) / temperature

    def truncated(self, rank: int) -> KronFactors:
        """Keep the ``rank`` largest eigenpairs of each factor (eigh sorts ascending)."""

        def top(vals: torch.Tensor, vecs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            order = torch.argsort(vals, descending=True)[:rank]
            order = order.sort().values  # keep ascending order, as eigh returns
            return vals[order], vecs[:, order]

        vo, qo = top(self.eigvals_out, self.eigvecs_out)
        vi, qi = top(self.eigvals_in, self.eigvecs_in)
        return KronFactors(vo, qo, vi, qi)


def _orthonormalise(q: torch.Tensor) -> torch.Tensor:
    """Closest-sign orthonormal basis of the span of ``q``'s columns (QR, signs of R's diagonal
    made positive so that columns stay close to the input)."""
    qq, r = torch.linalg.qr(q)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return qq * signs


#: the least precision an eigenvector basis must have (float32's, with a wide margin): the
#: probe error below of a float32-rounded orthonormal basis is 4e-8, of one computed by a
#: float32 eigh about 2e-6 (n = 1600)
ORTHONORMAL_RTOL = 1e-4


def orthonormal_tolerance(dtype: np.dtype | type) -> float:
    """Allowed relative ``|Q^T Q v - v|`` of a basis stored in ``dtype``: 10 units of its
    rounding, but never below :data:`ORTHONORMAL_RTOL` (a float64 array may hold a float32
    computation). float16: 1e-2, against 3-4e-4 for float16-rounded orthonormal bases."""
    return max(ORTHONORMAL_RTOL, 10 * float(np.finfo(dtype).eps))


def _check_orthonormal(key: str, vecs: np.ndarray, q: torch.Tensor, probes: int = 4) -> None:
    """Reject the basis ``vecs`` (``q``: the same values as a tensor) unless ``Q^T Q = I`` to
    :func:`orthonormal_tolerance` of its dtype, checked on random probe vectors (``O(n r)``
    instead of the ``O(n r^2)`` Gram matrix, which matters for 1600 x 1600 factors). The
    probes are seeded by the array's bytes: deterministic, yet not known to whoever crafts a
    basis that is wrong only away from them. Entries beyond 1 (impossible for unit columns)
    are rejected outright."""
    tol = orthonormal_tolerance(vecs.dtype)
    peak = float(np.abs(vecs).max()) if vecs.size else 0.0
    if peak > 1 + tol:
        raise ValueError(f"array {key!r} is not orthonormal (an entry of magnitude {peak:.3g})")
    gen = torch.Generator().manual_seed(zlib.crc32(np.ascontiguousarray(vecs).data))
    v = torch.randn(q.shape[1], probes, generator=gen, dtype=torch.float64)
    qd = q.double()
    err = ((qd.T @ (qd @ v) - v).norm(dim=0) / v.norm(dim=0)).max().item()
    if not err <= tol:
        raise ValueError(f"array {key!r} is not orthonormal to {vecs.dtype} precision "
                         f"(relative |Q^T Q v - v| = {err:.2e}, allowed {tol:.0e})")


class KronCurvature(Curvature):
    """Per-layer K-FAC curvature ``H_W = B (x) A``, kept as eigendecompositions of ``B``, ``A``.

    ``Lambda_W = (Q_B (x) Q_A) diag(outer(l_B, l_A) / T + 1/sigma2) (Q_B (x) Q_A)^T``; layers
    are independent (block diagonal ``Lambda``).

    Hybrid networks: a parameter outside ``nn.Linear`` / ``nn.Conv2d`` (BatchNorm, LayerNorm,
    GroupNorm, Embedding, a user's layer) has no Kronecker structure; it gets a diagonal block
    ``H_W = diag(h)`` (``diagonals[name]``, arrays ``"<param>/ggn_diag"``), so
    ``Lambda_W = diag(h / T + 1/sigma2)``, ``log det Lambda_W = sum log(h / T + 1/sigma2)``
    and the quadratic form ``sum (h / T + 1/sigma2) (w - m)^2`` (see
    :mod:`fedfusion.curvature.hybrid` for how the client fits both kinds of block).
    """

    structure: ClassVar[str] = "kron"

    def __init__(
        self,
        factors: Mapping[str, KronFactors],
        param_shapes: ParamShapes,
        temperature: float,
        prior_var: float,
        diagonals: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(param_shapes, temperature, prior_var)
        diagonals = diagonals or {}
        missing = [name for name in self.param_shapes
                   if name not in factors and name not in diagonals]
        if missing:
            raise ValueError(f"missing Kronecker factors for parameters {missing}")
        #: the diagonal blocks ``h`` (parameter shape) of the parameters without Kron factors
        self.diagonals: dict[str, torch.Tensor] = {
            name: diagonals[name] for name in self.param_shapes if name in diagonals}
        self.factors: dict[str, KronFactors] = {
            name: factors[name] for name in self.param_shapes if name not in self.diagonals}

    @classmethod
    def from_kron_matrices(
        cls,
        matrices: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        param_shapes: ParamShapes,
        temperature: float,
        prior_var: float,
        diagonals: Mapping[str, torch.Tensor] | None = None,
    ) -> KronCurvature:
        """From dense factors ``{name: (B, A)}`` (and diagonal blocks ``{name: h}`` of the
        other parameters): eigendecomposed in float64, stored in the factors' dtype,
        round-off negatives clipped (via :meth:`from_arrays`' validation)."""
        arrays: dict[str, np.ndarray] = {
            f"{name}/{DIAG_KEY}": to_numpy(h) for name, h in (diagonals or {}).items()}
        for name, (b, a) in matrices.items():
            for side, mat in (("out", b), ("in", a)):
                vals, vecs = torch.linalg.eigh(mat.detach().double())
                arrays[f"{name}/eigvals_{side}"] = to_numpy(vals.to(mat.dtype))
                arrays[f"{name}/eigvecs_{side}"] = to_numpy(vecs.to(mat.dtype))
        return cls.from_arrays(arrays, param_shapes, temperature, prior_var)

    def to_arrays(
        self, *, rank: int | None = None, eigvec_dtype: type[np.floating] | None = None
    ) -> dict[str, np.ndarray]:
        """``"<param>/eigvals_out"``, ``"/eigvecs_out"``, ``"/eigvals_in"``, ``"/eigvecs_in"``
        per parameter. ``rank`` keeps the ``rank`` largest eigenpairs of each factor;
        ``eigvec_dtype`` (e.g. ``np.float16``) casts the eigenvectors only. Both are lossy;
        the defaults round-trip bit-exactly."""
        if rank is not None and rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        arrays: dict[str, np.ndarray] = {
            f"{name}/{DIAG_KEY}": to_numpy(h) for name, h in self.diagonals.items()}
        for name, fac in self.factors.items():
            if rank is not None:
                fac = fac.truncated(rank)
            for key in FACTOR_KEYS:
                arr = to_numpy(getattr(fac, key))
                if eigvec_dtype is not None and key.startswith("eigvecs"):
                    arr = arr.astype(eigvec_dtype)
                arrays[f"{name}/{key}"] = arr
        return arrays

    @classmethod
    def from_arrays(
        cls,
        arrays: Mapping[str, np.ndarray],
        param_shapes: ParamShapes,
        temperature: float,
        prior_var: float,
        diagonal_params: Collection[str] | None = None,
        *,
        check_input: bool = True,
    ) -> KronCurvature:
        """Rebuild from :meth:`to_arrays`. A parameter with a ``"<param>/ggn_diag"`` array has a
        diagonal block, any other the four factor arrays. ``diagonal_params``, when given (the
        server knows which parameters are not Linear/Conv2d ones), is the exact set that must
        be diagonal: a client cannot choose another structure for a layer.
        ``check_input=False``: the bases' orthonormality is not checked again (see
        :meth:`Curvature.from_arrays`; two thirds of the decoding time of LeNet's factors)."""
        factors: dict[str, KronFactors] = {}
        diagonals: dict[str, torch.Tensor] = {}
        expected: set[str] = set()
        for name, shape in param_shapes.items():
            diag_key = f"{name}/{DIAG_KEY}"
            is_diag = diag_key in arrays if diagonal_params is None else (
                name in diagonal_params)
            if is_diag:
                expected.add(diag_key)
                values = get_array(arrays, diag_key, tuple(shape))
                diagonals[name] = as_tensor(clip_nonnegative(diag_key, values))
                continue
            out_dim, in_dim = matrix_shape(tuple(shape))
            tensors: dict[str, torch.Tensor] = {}
            for side, dim in (("out", out_dim), ("in", in_dim)):
                vec_key, val_key = f"{name}/eigvecs_{side}", f"{name}/eigvals_{side}"
                expected |= {vec_key, val_key}
                vecs = get_array(arrays, vec_key)
                if vecs.ndim != 2 or vecs.shape[0] != dim or not 1 <= vecs.shape[1] <= dim:
                    raise ValueError(
                        f"array {vec_key!r} has shape {vecs.shape}, expected ({dim}, r) with "
                        f"1 <= r <= {dim} for parameter of shape {tuple(shape)}"
                    )
                rank = vecs.shape[1]
                vals = clip_nonnegative(val_key, get_array(arrays, val_key, (rank,)))
                q = as_tensor(vecs)
                if check_input:
                    _check_orthonormal(vec_key, vecs, q)
                if vecs.dtype in _HALF_DTYPES:
                    q = _orthonormalise(q)
                tensors[f"eigvals_{side}"] = as_tensor(vals).to(q.dtype)
                tensors[f"eigvecs_{side}"] = q
            factors[name] = KronFactors(**tensors)
        check_unexpected(arrays, expected)
        return cls(factors, param_shapes, temperature, prior_var, diagonals)

    def layer_logdet(self, name: str) -> float:
        """``log det Lambda_W``: ``sum log(outer(l_B, l_A)/T + delta)`` over the kept
        eigenpairs, plus ``log(delta)`` for every direction a truncation dropped (a diagonal
        block: ``sum log(h/T + delta)``)."""
        if name in self.diagonals:
            h = self.diagonals[name].double()
            return float(torch.log(h / self.temperature + self.prior_precision).sum())
        fac = self.factors[name]
        eig = fac.likelihood_eigvals(self.temperature).double() + self.prior_precision
        out_dim, in_dim = matrix_shape(self.param_shapes[name])
        dropped = out_dim * in_dim - eig.numel()
        return float(torch.log(eig).sum()) + dropped * math.log(self.prior_precision)

    def precision_logdet(self) -> float:
        return sum(self.layer_logdet(name) for name in self.param_shapes)

    def dense_precision(self) -> torch.Tensor:
        blocks = []
        for name in self.param_shapes:
            if name in self.diagonals:
                h = self.diagonals[name].double().flatten()
                blocks.append(torch.diag(h / self.temperature + self.prior_precision))
                continue
            fac = self.factors[name]
            q = torch.kron(fac.eigvecs_out.double(), fac.eigvecs_in.double())
            eig = fac.likelihood_eigvals(self.temperature).double().flatten()
            eye = torch.eye(q.shape[0], dtype=torch.float64)
            blocks.append(q @ torch.diag(eig) @ q.T + self.prior_precision * eye)
        return torch.block_diag(*blocks)
