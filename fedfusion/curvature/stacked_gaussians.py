"""Server side: batched Gaussian log-densities of all members (the stacked Gaussian family).

The server holds ``K`` Laplace components (all members of all clients), component ``k`` being
``N(w | m_k, Lambda_k^{-1})`` with ``Lambda_k = H_k / T_k + I / sigma2_k``, and evaluates

    log N(w | m_k, Lambda_k^{-1}) = -1/2 (w - m_k)^T Lambda_k (w - m_k)
                                    + 1/2 log det Lambda_k - d/2 log(2 pi)

for ``R`` candidate weight vectors at once (``[R, K]``, or any list of (run, component)
pairs), differentiably in ``w``, without ever forming a ``d x d`` matrix.
:class:`StackedGaussians` holds the components of one curvature structure;
``StackedGaussians.from_members`` picks the subclass (:class:`StackedKron`,
:class:`StackedDiag`, :class:`StackedDiagFull`) and precomputes everything that does not depend
on ``w`` (rotated means, precision eigenvalues, Cholesky factors, log-determinants in float64).

Memory: the Kron sandwich of a layer is a ``[P, out, in']`` tensor for P pairs (409 MB in
float32 for the CNN's 512 x 1600 layer with all R=5 x K=25 pairs), so pairs are processed in
chunks whose intermediates stay below ``max_chunk_bytes``; the same holds for the ``[P, d]``
differences of the diagonal structures. The default (:func:`default_chunk_bytes`) is 256 MB on
a CUDA device, where large batches fill the device, and 16 MB on the CPU, where a chunk's
intermediates then stay in the last-level cache and in memory the allocator reuses.

FedBEns' objective over these densities (Eq. 5) is :mod:`fedfusion.strategies.fedbens.objective`;
FedFisher uses :meth:`StackedGaussians.quadratic_form`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import torch

from fedfusion.curvature.base import Curvature
from fedfusion.curvature.diag import DiagCurvature, DiagFullCurvature
from fedfusion.curvature.kron import KronCurvature, matrix_shape

#: the chunk budget on a CUDA device
DEFAULT_CHUNK_BYTES = 256 * 2**20
#: ... and on the CPU, small enough that glibc reuses the memory (it maps allocations above
#: 32 MB anew at every step) and the intermediates stay near the cache
CPU_CHUNK_BYTES = 16 * 2**20
#: a layer's gathered pair factors are kept between steps up to this size (gathering them
#: anew at every step is a sizeable part of a step)
MAX_PAIR_CACHE_BYTES = 512 * 2**20
LOG_2PI = math.log(2 * math.pi)


def default_chunk_bytes(device: torch.device | str) -> int:
    """The chunk budget of the stacks on ``device``: :data:`DEFAULT_CHUNK_BYTES` on a CUDA
    device, :data:`CPU_CHUNK_BYTES` elsewhere."""
    return DEFAULT_CHUNK_BYTES if torch.device(device).type == "cuda" else CPU_CHUNK_BYTES


def _chunks(num: int, per_item_bytes: int, max_bytes: int) -> Iterator[slice]:
    """Slices of ``range(num)`` with at most ``max_bytes // per_item_bytes`` items (>= 1)."""
    step = max(1, max_bytes // max(per_item_bytes, 1))
    for start in range(0, num, step):
        yield slice(start, min(start + step, num))


class StackedGaussians(ABC):
    """``K`` Gaussian components ``N(m_k, Lambda_k^{-1})`` of one curvature structure, stacked
    for vectorised evaluation of ``log N(w_r | m_k, Lambda_k^{-1})`` over ``R`` points."""

    structure: ClassVar[str]

    def __init__(
        self,
        param_shapes: Mapping[str, tuple[int, ...]],
        logdet: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        max_chunk_bytes: int,
    ) -> None:
        self.param_shapes = dict(param_shapes)
        self.num_params = sum(math.prod(s) for s in self.param_shapes.values())
        self.device = device
        self.dtype = dtype
        self.max_chunk_bytes = int(max_chunk_bytes)
        # 1/2 log det Lambda_k - d/2 log(2 pi), summed in float64 then cast
        self.log_normaliser = (0.5 * logdet - 0.5 * self.num_params * LOG_2PI).to(device, dtype)

    @property
    def num_components(self) -> int:
        return self.log_normaliser.shape[0]

    @classmethod
    def from_members(
        cls,
        means: Sequence[Mapping[str, torch.Tensor]],
        curvatures: Sequence[Curvature],
        device: torch.device | str,
        *,
        dtype: torch.dtype | None = None,
        max_chunk_bytes: int | None = None,
    ) -> StackedGaussians:
        """Stack members ``k = 0..K-1`` (mean ``means[k]``: parameter name -> tensor, e.g. a
        ``state_dict``; curvature ``curvatures[k]``). ``dtype`` defaults to the means' dtype,
        ``max_chunk_bytes`` to :func:`default_chunk_bytes` of ``device``."""
        if len(means) != len(curvatures) or not means:
            raise ValueError(
                f"need as many means as curvatures (>= 1), got {len(means)} and {len(curvatures)}"
            )
        first = curvatures[0]
        for k, curv in enumerate(curvatures):
            if curv.structure != first.structure:
                raise ValueError(
                    f"component {k} has structure {curv.structure!r}, "
                    f"component 0 {first.structure!r}"
                )
            if curv.param_shapes != first.param_shapes:
                raise ValueError(f"component {k} has other parameters than component 0")
        shapes = first.param_shapes
        for k, mean in enumerate(means):
            for name, shape in shapes.items():
                if name not in mean:
                    raise ValueError(f"mean {k} lacks parameter {name!r}")
                if tuple(mean[name].shape) != shape:
                    raise ValueError(
                        f"mean {k} parameter {name!r} has shape "
                        f"{tuple(mean[name].shape)}, expected {shape}"
                    )
        if dtype is None:
            dtype = means[0][next(iter(shapes))].dtype
        subclass = _STACKED.get(first.structure)
        if subclass is None or (cls is not StackedGaussians and subclass is not cls):
            raise ValueError(f"cannot stack structure {first.structure!r} as {cls.__name__}")
        stacked_means = {
            name: torch.stack([m[name].detach().to("cpu", torch.float64) for m in means])
            for name in shapes
        }
        logdet = torch.tensor([c.precision_logdet() for c in curvatures], dtype=torch.float64)
        return subclass._build(
            stacked_means,
            curvatures,
            shapes,
            logdet,
            torch.device(device),
            dtype,
            default_chunk_bytes(device) if max_chunk_bytes is None else max_chunk_bytes,
        )

    @classmethod
    @abstractmethod
    def _build(
        cls,
        means: dict[str, torch.Tensor],
        curvatures: Sequence[Curvature],
        param_shapes: Mapping[str, tuple[int, ...]],
        logdet: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        max_chunk_bytes: int,
    ) -> StackedGaussians:
        """Precompute the structure's tensors from float64 means ``[K, *shape]``."""

    @abstractmethod
    def pair_quadratic_form(
        self, w: Mapping[str, torch.Tensor], runs: torch.Tensor, comps: torch.Tensor
    ) -> torch.Tensor:
        """``[P]``: ``(w_r - m_k)^T Lambda_k (w_r - m_k)`` with ``r = runs[p]``, ``k = comps[p]``
        for ``P`` (run, component) pairs, chunked so intermediates stay below the byte budget."""

    def quadratic_form(self, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[R, K]``: ``(w_r - m_k)^T Lambda_k (w_r - m_k)`` for every run and component."""
        runs, comps = self.all_pairs(self.num_points(w))
        return self.pair_quadratic_form(w, runs, comps).reshape(-1, self.num_components)

    def all_pairs(self, num_runs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run and component index of every pair, run-major (``[R * K]`` each)."""
        grid = torch.cartesian_prod(torch.arange(num_runs, device=self.device),
                                    torch.arange(self.num_components, device=self.device))
        return grid[:, 0], grid[:, 1]

    def num_points(self, w: Mapping[str, torch.Tensor]) -> int:
        """``R``, after checking that every ``w[name]`` is ``[R, *param_shape]``."""
        sizes = set()
        for name, shape in self.param_shapes.items():
            if name not in w:
                raise ValueError(f"w lacks parameter {name!r}")
            if tuple(w[name].shape[1:]) != shape or w[name].ndim != len(shape) + 1:
                raise ValueError(
                    f"w[{name!r}] has shape {tuple(w[name].shape)}, expected "
                    f"[R, {', '.join(map(str, shape))}]"
                )
            sizes.add(w[name].shape[0])
        if len(sizes) != 1:
            raise ValueError(f"all w[name] need the same leading R, got {sorted(sizes)}")
        return sizes.pop()

    def log_density(self, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[R, K]``: ``log N(w_r | m_k, Lambda_k^{-1})`` including the normaliser
        ``1/2 log det Lambda_k - d/2 log 2 pi``."""
        return -0.5 * self.quadratic_form(w) + self.log_normaliser

    def log_density_pairs(
        self, w: Mapping[str, torch.Tensor], runs: torch.Tensor, comps: torch.Tensor
    ) -> torch.Tensor:
        """``[P]``: :meth:`log_density` at the given (run, component) pairs only."""
        self.num_points(w)
        return -0.5 * self.pair_quadratic_form(w, runs, comps) + self.log_normaliser[comps]


def _pad(mat: torch.Tensor, rows: int | None = None, cols: int | None = None) -> torch.Tensor:
    """``mat`` zero-padded at the bottom / right to ``rows`` x ``cols``."""
    rows = mat.shape[0] if rows is None else rows
    cols = mat.shape[1] if cols is None else cols
    return torch.nn.functional.pad(mat, (0, cols - mat.shape[1], 0, rows - mat.shape[0]))


def _dense_factors(eigvecs: Sequence[torch.Tensor], eigvals: Sequence[torch.Tensor], rank: int,
                   device: torch.device, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``[K, n, n]`` float64: ``Q_k diag(l_k) Q_k^T / scale_k``, formed as one batched product
    on a CUDA device (eigenvectors zero-padded to ``rank`` columns: padding adds nothing),
    else on the CPU."""
    work = device if device.type == "cuda" else torch.device("cpu")
    # stacked in the uploads' own precision (float64 is formed where the product runs:
    # exact, and half the bytes to copy and move)
    q = torch.zeros(len(eigvecs), eigvecs[0].shape[0], rank, dtype=eigvecs[0].dtype)
    lam = torch.zeros(len(eigvals), rank, dtype=eigvals[0].dtype)
    for k, (vecs, vals) in enumerate(zip(eigvecs, eigvals, strict=True)):
        q[k, :, : vecs.shape[1]] = vecs
        lam[k, : vals.shape[0]] = vals
    q, lam = q.to(work, torch.float64), lam.to(work, torch.float64)
    dense = (q * lam[:, None, :]) @ q.transpose(1, 2)
    return dense if scale is None else dense / scale.to(work)[:, None, None]


def _rowwise_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[P]``: ``<x[p], y[p]>`` over all but the first axis (an einsum: 4x faster here than
    ``(x * y).sum()``, which writes the product out first)."""
    return torch.einsum("pn,pn->p", x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1))


class _KronQuadraticForm(torch.autograd.Function):
    """``[P]``: ``<D, B D A> + delta ||D||^2`` with ``D = W - M`` per pair, and its gradient
    ``2 (B D A + delta D)`` from the same product: one ``B D A`` per pair serves the value
    and the gradient, where autograd through ``Q_B^T D Q_A`` would multiply twice."""

    @staticmethod
    def forward(ctx, w, mean, b, a, delta, uniform_delta):  # type: ignore[override]
        diff = w - mean
        # prod = B D A + delta D (the half-gradient), then quad = <D, prod> per pair;
        # ``uniform_delta`` (a float when every component has the same delta, known when the
        # stack is built) avoids reading ``delta`` back from the device at every step
        prod = torch.bmm(torch.bmm(b, diff), a)
        if uniform_delta is not None:
            prod.add_(diff, alpha=uniform_delta)
        else:
            prod.addcmul_(delta[:, None, None], diff)
        quad = _rowwise_dot(diff, prod)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(prod)
        return quad

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (prod,) = ctx.saved_tensors
        return (2 * grad)[:, None, None] * prod, None, None, None, None, None


class StackedKron(StackedGaussians):
    """Kron components: per layer, with ``D = W - M`` the ``[out, in']`` difference,

        quad = <D, B D A> + delta ||D||^2,   B = Q_B diag(l_B) Q_B^T / T,
                                              A = Q_A diag(l_A) Q_A^T,

    i.e. ``sum S^2 outer(l_B, l_A) / T + ||S||^2 / sigma2`` with ``S = Q_B^T D Q_A``. The dense
    factors ``B``, ``A`` (formed once, in float64) give value and gradient from one ``B D A``
    per pair (:class:`_KronQuadraticForm`): ``out * in' * (out + in')`` multiply-adds per pair
    and step, half of what autograd through the rotation ``S`` costs. Truncated factors
    (``rank`` < dimension) whose rotation is cheaper than that keep the rotation instead:
    ``quad = delta ||D||^2 + sum S_r^2 outer(l_B, l_A) / T``, members truncated to different
    ranks zero-padded to the largest rank. A parameter with a diagonal block (hybrid
    networks) adds ``sum_i prec_i (w_i - m_i)^2``.
    """

    structure: ClassVar[str] = "kron"

    def __init__(self, layers: dict[str, dict[str, torch.Tensor]], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.layers = layers
        #: layer -> delta as a float when all components share it (the usual case: one
        #: prior and temperature for every client), else None
        self.uniform_delta: dict[str, float | None] = {}
        for name, layer in layers.items():
            if "delta" in layer:
                delta = layer["delta"].cpu()
                self.uniform_delta[name] = (float(delta[0]) if bool((delta == delta[0]).all())
                                            else None)
        #: layer -> (a copy of the pairs' components, their gathered factors, the tensor
        #: passed and its version counter): see :meth:`_gathered`
        self._pair_cache: dict[str, tuple[torch.Tensor, list, torch.Tensor, int]] = {}

    @classmethod
    def _build(cls, means, curvatures, param_shapes, logdet, device, dtype, max_chunk_bytes):
        kron: list[KronCurvature] = []
        for curv in curvatures:
            assert isinstance(curv, KronCurvature)
            kron.append(curv)
        delta = torch.tensor([c.prior_precision for c in kron], dtype=torch.float64)
        layers: dict[str, dict[str, torch.Tensor]] = {}
        for name, shape in param_shapes.items():
            diagonal = [name in c.diagonals for c in kron]
            if any(diagonal):
                if not all(diagonal):
                    raise ValueError(f"parameter {name!r} has a diagonal block in component "
                                     f"{diagonal.index(True)} and Kron factors in component "
                                     f"{diagonal.index(False)}")
                prec = torch.stack([c.diagonals[name].double().flatten() / c.temperature
                                    for c in kron]) + delta[:, None]
                layers[name] = {"diag_mean": means[name].flatten(1).to(device, dtype),
                                "diag_prec": prec.to(device, dtype)}
                continue
            facs = [c.factors[name] for c in kron]
            out_dim, in_dim = matrix_shape(shape)
            rank_b = max(f.eigvecs_out.shape[1] for f in facs)
            rank_a = max(f.eigvecs_in.shape[1] for f in facs)
            mean = means[name].reshape(len(kron), out_dim, in_dim)
            layer = {"mean": mean, "delta": delta}
            dense_cost = out_dim * in_dim * (out_dim + in_dim)
            rotation_cost = 2 * min(out_dim * in_dim * rank_b + rank_b * in_dim * rank_a,
                                    out_dim * in_dim * rank_a + out_dim * rank_a * rank_b)
            if dense_cost <= rotation_cost:
                temperature = torch.tensor([c.temperature for c in kron], dtype=torch.float64)
                layer["b"] = _dense_factors([f.eigvecs_out for f in facs],
                                            [f.eigvals_out for f in facs], rank_b, device,
                                            temperature)
                layer["a"] = _dense_factors([f.eigvecs_in for f in facs],
                                            [f.eigvals_in for f in facs], rank_a, device)
            else:
                # members truncated to other ranks: pad with zero eigenvectors / eigenvalues,
                # which add nothing to sum S^2 outer(l_B, l_A) / T
                layer["qb"] = torch.stack([_pad(f.eigvecs_out.double(), cols=rank_b)
                                           for f in facs])
                layer["qa"] = torch.stack([_pad(f.eigvecs_in.double(), cols=rank_a)
                                           for f in facs])
                layer["eig"] = torch.stack([
                    _pad(f.likelihood_eigvals(c.temperature).double(), rank_b, rank_a)
                    for f, c in zip(facs, kron, strict=True)])  # [K, rB, rA]
            layers[name] = {k: v.to(device, dtype) for k, v in layer.items()}
        return cls(
            layers,
            param_shapes=param_shapes,
            logdet=logdet,
            device=device,
            dtype=dtype,
            max_chunk_bytes=max_chunk_bytes,
        )

    def layer_pair_quadratic_form(
        self, name: str, w: torch.Tensor, runs: torch.Tensor, comps: torch.Tensor
    ) -> torch.Tensor:
        """``[P]`` quadratic form of one layer; ``w`` is ``[R, *param_shape]``."""
        layer = self.layers[name]
        if "diag_prec" in layer:  # a parameter outside Linear / Conv2d: diagonal block
            return _diag_pair_quadratic_form(w.reshape(w.shape[0], -1), layer["diag_mean"],
                                             layer["diag_prec"], runs, comps,
                                             self.max_chunk_bytes)
        out_dim, in_dim = layer["mean"].shape[1:]
        wm = w.reshape(w.shape[0], out_dim, in_dim)
        if "b" in layer:
            uniform = self.uniform_delta[name]
            return torch.cat([_KronQuadraticForm.apply(wm.index_select(0, runs[ps]), *factors,
                                                         uniform)
                              for ps, factors in self._gathered(name, comps)])
        qb, qa = layer["qb"], layer["qa"]
        rank_b, rank_a = qb.shape[2], qa.shape[2]
        # contract the cheaper side first; the intermediate is [p, rB, in] or [p, out, rA]
        b_first = out_dim * in_dim * rank_b + rank_b * in_dim * rank_a <= (
            out_dim * in_dim * rank_a + out_dim * rank_a * rank_b
        )
        inter = rank_b * in_dim if b_first else out_dim * rank_a
        per_pair = (out_dim * rank_b + in_dim * rank_a + 3 * out_dim * in_dim + inter
                    + 4 * rank_b * rank_a) * wm.element_size()
        parts = []
        for ps in _chunks(len(runs), per_pair, self.max_chunk_bytes):
            k = comps[ps]
            diff = wm.index_select(0, runs[ps]) - layer["mean"][k]
            qb_t, qa_k = qb[k].transpose(1, 2), qa[k]
            sand = (qb_t @ diff) @ qa_k if b_first else qb_t @ (diff @ qa_k)
            quad = (sand * sand * layer["eig"][k]).sum(dim=(-2, -1))
            parts.append(quad + layer["delta"][k] * (diff * diff).sum(dim=(-2, -1)))
        return torch.cat(parts)

    def _gathered(self, name: str, comps: torch.Tensor
                  ) -> list[tuple[slice, tuple[torch.Tensor, ...]]]:
        """Per chunk of pairs, the dense layer's ``(M_k, B_k, A_k, delta_k)`` of each pair.
        The copies of the last pair list are kept when they fit in
        ``max(max_chunk_bytes, MAX_PAIR_CACHE_BYTES)``: an optimiser calls with the same
        active pairs for many steps, and gathering the factors costs as much as a third of a
        step (LeNet at C = 100: 222 MB for fc1's 500 pairs)."""
        cached = self._pair_cache.get(name)
        if cached is not None:
            # the same, unmodified tensor (an optimiser's pairs between refreshes) needs no
            # comparison on the device, which would wait for the queued work at every step
            same = cached[2] is comps and cached[3] == comps._version
            if same or torch.equal(cached[0], comps):
                return cached[1]
        layer = self.layers[name]
        out_dim, in_dim = layer["mean"].shape[1:]
        per_pair = (out_dim * out_dim + in_dim * in_dim + 5 * out_dim * in_dim
                    ) * layer["mean"].element_size()
        gathered = [(ps, tuple(layer[key][comps[ps]] for key in ("mean", "b", "a", "delta")))
                    for ps in _chunks(len(comps), per_pair, self.max_chunk_bytes)]
        kept = sum(t.numel() * t.element_size() for _, factors in gathered for t in factors)
        if kept <= max(self.max_chunk_bytes, MAX_PAIR_CACHE_BYTES):
            self._pair_cache[name] = (comps.clone(), gathered, comps, comps._version)
        else:  # a stale entry would be compared on the device at every later step
            self._pair_cache.pop(name, None)
        return gathered

    def pair_quadratic_form(
        self, w: Mapping[str, torch.Tensor], runs: torch.Tensor, comps: torch.Tensor
    ) -> torch.Tensor:
        return sum(  # type: ignore[return-value]
            self.layer_pair_quadratic_form(name, w[name], runs, comps)
            for name in self.param_shapes
        )

    def quadratic_form(self, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[R, K]``; the dense-factor layers take each component's ``B``, ``A`` once for
        all ``R`` points (no per-pair copy of the factors)."""
        num_runs = self.num_points(w)
        runs, comps = self.all_pairs(num_runs)
        total = torch.zeros(num_runs, self.num_components, device=self.device, dtype=self.dtype)
        for name in self.param_shapes:
            layer = self.layers[name]
            if "b" in layer:
                total = total + self._dense_all_runs(layer, w[name])
            else:
                quad = self.layer_pair_quadratic_form(name, w[name], runs, comps)
                total = total + quad.reshape(num_runs, self.num_components)
        return total

    def _dense_all_runs(self, layer: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        """``[R, K]`` quadratic form of one dense-factor layer at every run and component, as
        ``<B, D A D^T> + delta ||D||^2`` (``= <D, B D A>`` for symmetric ``A``, ``B``): both
        products take ``D`` in its own layout, where ``B D`` over all runs needed two
        transposed copies of the differences (1.6x faster at C = 100)."""
        num_runs, (out_dim, in_dim) = w.shape[0], layer["mean"].shape[1:]
        wm = w.reshape(num_runs, out_dim, in_dim)
        per_comp = (out_dim * out_dim + in_dim * in_dim + 3 * num_runs * out_dim * in_dim
                    + num_runs * out_dim * out_dim) * wm.element_size()
        parts = []
        for ks in _chunks(self.num_components, per_comp, self.max_chunk_bytes):
            diff = wm[None] - layer["mean"][ks, None]  # [k, R, out, in]
            k = diff.shape[0]
            pairs = diff.reshape(k * num_runs, out_dim, in_dim)
            da = torch.bmm(diff.reshape(k, num_runs * out_dim, in_dim), layer["a"][ks])
            dad = torch.bmm(da.reshape(k * num_runs, out_dim, in_dim), pairs.transpose(1, 2))
            quad = torch.einsum("kij,krij->kr", layer["b"][ks],
                                dad.reshape(k, num_runs, out_dim, out_dim))
            flat = diff.reshape(k * num_runs, -1)
            parts.append(quad + layer["delta"][ks, None]
                         * _rowwise_dot(flat, flat).reshape(k, num_runs))
        return torch.cat(parts).T


def _flat(w: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """``[R, sum numel]``: the parameters ``names`` of ``w``, flattened and concatenated."""
    return torch.cat([w[name].reshape(w[name].shape[0], -1) for name in names], dim=1)


def _diag_pair_quadratic_form(
    w_flat: torch.Tensor, mean: torch.Tensor, prec: torch.Tensor, runs: torch.Tensor,
    comps: torch.Tensor, max_bytes: int
) -> torch.Tensor:
    """``[P]``: ``sum_i prec[k, i] (w[r, i] - mean[k, i])^2`` for the pairs ``(runs, comps)``."""
    per_pair = 3 * w_flat.shape[1] * w_flat.element_size()
    parts = []
    for ps in _chunks(len(runs), per_pair, max_bytes):
        diff = w_flat.index_select(0, runs[ps]) - mean[comps[ps]]
        parts.append((diff * diff * prec[comps[ps]]).sum(-1))
    return torch.cat(parts)


class StackedDiag(StackedGaussians):
    """Diag components: ``quad = sum_i (h_i / T + 1/sigma2) (w_i - m_i)^2`` over all
    parameters flattened into one ``[K, d]`` mean and precision."""

    structure: ClassVar[str] = "diag"

    def __init__(self, mean: torch.Tensor, prec: torch.Tensor, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.mean, self.prec = mean, prec

    @classmethod
    def _build(cls, means, curvatures, param_shapes, logdet, device, dtype, max_chunk_bytes):
        names = list(param_shapes)
        prec = []
        for curv in curvatures:
            assert isinstance(curv, DiagCurvature)
            prec.append(torch.cat([curv.precision_diag(n).double().flatten() for n in names]))
        mean = torch.cat([means[n].flatten(1) for n in names], dim=1)
        return cls(
            mean.to(device, dtype),
            torch.stack(prec).to(device, dtype),
            param_shapes=param_shapes,
            logdet=logdet,
            device=device,
            dtype=dtype,
            max_chunk_bytes=max_chunk_bytes,
        )

    def pair_quadratic_form(
        self, w: Mapping[str, torch.Tensor], runs: torch.Tensor, comps: torch.Tensor
    ) -> torch.Tensor:
        w_flat = _flat(w, list(self.param_shapes))
        return _diag_pair_quadratic_form(w_flat, self.mean, self.prec, runs, comps,
                                         self.max_chunk_bytes)


class StackedDiagFull(StackedGaussians):
    """Diag + full-last-layer components: the diagonal quadratic form over all but the last
    layer plus ``||L_k^T (w_L - m_L,k)||^2`` with ``L_k L_k^T = H_L,k / T + I / sigma2`` the
    Cholesky factor of the last layer's dense precision block, computed once in float64."""

    structure: ClassVar[str] = "diag_full"

    def __init__(
        self,
        diag_names: list[str],
        last_names: list[str],
        diag_mean: torch.Tensor,
        diag_prec: torch.Tensor,
        last_mean: torch.Tensor,
        last_chol: torch.Tensor,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.diag_names, self.last_names = diag_names, last_names
        self.diag_mean, self.diag_prec = diag_mean, diag_prec
        self.last_mean, self.last_chol = last_mean, last_chol
        self.last_rot = torch.einsum("kij,ki->kj", last_chol.double(), last_mean.double()).to(
            last_chol.dtype)  # L_k^T m_k

    @classmethod
    def _build(cls, means, curvatures, param_shapes, logdet, device, dtype, max_chunk_bytes):
        full: list[DiagFullCurvature] = []
        for curv in curvatures:
            assert isinstance(curv, DiagFullCurvature)
            full.append(curv)
        diag_names, last_names = full[0].diag_names, full[0].last_names
        k_all = len(full)
        prec = [
            torch.cat([c.precision_diag(n).double().flatten() for n in diag_names])
            if diag_names
            else torch.zeros(0, dtype=torch.float64)
            for c in full
        ]
        chol = torch.linalg.cholesky(torch.stack([c.last_precision().double() for c in full]))

        def flat_means(names: list[str]) -> torch.Tensor:
            if not names:
                return torch.zeros(k_all, 0, dtype=torch.float64)
            return torch.cat([means[n].flatten(1) for n in names], dim=1)

        return cls(
            diag_names,
            last_names,
            flat_means(diag_names).to(device, dtype),
            torch.stack(prec).to(device, dtype),
            flat_means(last_names).to(device, dtype),
            chol.to(device, dtype),
            param_shapes=param_shapes,
            logdet=logdet,
            device=device,
            dtype=dtype,
            max_chunk_bytes=max_chunk_bytes,
        )

    def pair_quadratic_form(
        self, w: Mapping[str, torch.Tensor], runs: torch.Tensor, comps: torch.Tensor
    ) -> torch.Tensor:
        quad = 0.0
        if self.diag_names:
            quad = _diag_pair_quadratic_form(_flat(w, self.diag_names), self.diag_mean,
                                             self.diag_prec, runs, comps, self.max_chunk_bytes)
        # L_k^T (w_r - m_k) = L_k^T w_r - L_k^T m_k for all R x K (cheap: n is the last layer's
        # size), then the pairs are picked: no per-pair copy of the n x n factors
        w_last = _flat(w, self.last_names)  # [R, n]
        rotated = torch.einsum("kij,ri->rkj", self.last_chol, w_last) - self.last_rot
        rotated = rotated[runs, comps]
        return quad + (rotated * rotated).sum(-1)


_STACKED: dict[str, type[StackedGaussians]] = {
    cls.structure: cls for cls in (StackedKron, StackedDiag, StackedDiagFull)
}
