"""Client side: fit a Laplace approximation to one trained member with laplace-torch.

``fit_curvature(model, x, y, structure)`` fits laplace-torch's
``Laplace(model, "classification", subset_of_weights="all", hessian_structure=...,
prior_precision=1/prior_var, temperature=temperature, backend=...)`` on ``(x, y)`` and keeps only
its likelihood curvature ``H`` (summed over the ``N = len(x)`` samples); the posterior precision
``Lambda = H / T + 1/sigma2 I`` is rebuilt from ``H``, ``T`` and ``sigma2`` by the
:class:`~fedfusion.curvature.base.Curvature` objects.

Structures
    ``kron``: laplace-torch's K-FAC ``Kron`` factors ``[B, A]`` per parameter (``B`` the
    ``[out, out]`` output-gradient factor summed over samples, ``A`` the ``[in', in']`` input
    factor averaged over samples, ``H_W = B (x) A``), re-decomposed with a float64 ``eigh``
    (see :mod:`fedfusion.curvature.kron`).
    ``diag``: the diagonal ``h`` of laplace-torch's ``DiagLaplace`` (``la.H``).
    ``diag_full``: the diagonal fit above for every layer except the last linear layer, plus
    the dense ``n x n`` block of that layer from laplace-torch's last-layer
    ``Laplace(..., subset_of_weights="last_layer", hessian_structure="full")`` (a second pass
    over the data; ``n = n_classes * n_features`` for a bias-free last layer, 840 for LeNet).
    That block is the exact GGN of the last layer, ``sum_n J_n^T (diag p_n - p_n p_n^T) J_n``
    with ``J_n = I (x) phi_n^T``, for the GGN and MC backends (see ``LAST_LAYER_BACKEND``: the
    dense contraction, not the sampling, is its cost) and the empirical Fisher for ``*_ef``;
    it replaces the last layer's entries of the diagonal fit and is symmetrised in float64.

Backends (``backend=``): ``"<library>_<type>"`` with library ``curvlinops``, ``asdl``,
``backpack`` and type ``ggn`` (exact GGN; for K-FAC the "type-2" K-FAC, one backward pass per
class), ``mc`` (Monte-Carlo Fisher, one sampled label per input: an unbiased estimate of the
GGN from a single backward pass) or ``ef`` (empirical Fisher, gradients at the true labels: a
different, biased matrix). ``curvlinops_ggn`` is laplace-torch's default and the one the
FedBEns reference code uses; ``asdl_ggn`` gives the same K-FAC (to 1e-6) and diagonal.
Known limitations, measured by ``benchmarks/curvature_backends.py``:

* ``curvlinops_ggn`` / ``curvlinops_mc`` with ``diag`` / ``diag_full`` go through laplace-torch's
  ``torch.func`` Jacobian of a whole batch (a vmap over batch x classes cotangents): more than
  20 GB at batch 256 and minutes at batch 16-32 on LeNet. Do not use them for the diagonal.
* ``curvlinops_mc`` builds a fresh Curvlinops K-FAC operator per batch with Curvlinops' fixed
  default seed, so every batch reuses the same random draws (``seed`` has no effect) and its
  error depends on the batch size (log det off by -4770 ... +106 on LeNet).
* ``backpack_*`` K-FAC needs a plain ``nn.Sequential`` model and, through laplace-torch,
  returns convolution factors on another scale (LeNet's conv layers off by factors of 10^2 -
  10^3 relative to Curvlinops / ASDL); ``backpack_ef`` has no K-FAC. Its diagonals are fine.
* ``diag_full``'s dense last-layer block costs more than the diagonal itself (asdl_mc: 13.2 s
  against 3.4 s under the load below): laplace-torch contracts ``sum_n J_n^T H_n J_n`` with
  dense last-layer Jacobians, ignoring ``J_n = I (x) phi_n^T``; the structured sum
  ``sum_n G_n (x) phi_n phi_n^T`` would be ~10x cheaper.
* The MC diagonal (``asdl_mc`` = ``backpack_mc`` with the same seed) came out ~1-3 % above the
  exact diagonal on the larger entries of LeNet (log det +1270 of 233,000); the MC K-FAC did not
  show this (log det -80 ... -530 of 171,000 over seeds).

Default ``backend="asdl_mc"``: LeNet, 12,000 FMNIST samples, 20 training epochs, one thread
(``benchmarks/results/curvature_backends.json``; the 2-core machine was shared, load average
5.5-8, so every fit is the minimum of two runs and the training time is the fastest epoch x 20,
45.7 s). The exact K-FAC GGN costs about 35 % of the training time (``asdl_ggn`` 15.8 s,
``curvlinops_ggn`` 16.3 s at batch 256) because it back-propagates once per class (an earlier,
less loaded run: 5-6 s against ~21 s, 25-30 %). The MC Fisher back-propagates once:
``asdl_mc`` fits in 4.1 s, 9.0 % of training (1.5 s, ~7 %, in the less loaded run), about 4x
faster than the exact GGN, and stays faithful: max-layer relative Frobenius error of
``B (x) A`` 13 %, log det within 0.3 % (std 444 over MC seeds, bias -530, of 171,300, while two
independently trained members differ by 1,725) and the quadratic form at another member's
weights within 1.5 %. The empirical Fisher is as fast but systematically off (56 % factor
error, log det -2,090, quadratic form +8.7 %). Batch 256 is the fastest fit batch (128 equal,
512 / 1000 slower: larger im2col buffers). Use ``backend="asdl_ggn"`` for the reference code's
exact K-FAC at about 4x the cost. The MC draws are seeded with ``seed`` inside a forked RNG
state (ASDL / BackPack), so a fit is reproducible and the global RNG is left alone.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from laplace import Laplace
from laplace.curvature import (
    AsdlEF,
    AsdlGGN,
    BackPackEF,
    BackPackGGN,
    CurvatureInterface,
    CurvlinopsEF,
    CurvlinopsGGN,
)
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from fedfusion.curvature import asdl_speedup
from fedfusion.curvature.base import Curvature, to_numpy
from fedfusion.curvature.diag import DiagCurvature, DiagFullCurvature, last_layer_names
from fedfusion.curvature.kron import KronCurvature, matrix_shape

BACKENDS: dict[str, tuple[type[CurvatureInterface], dict[str, Any]]] = {
    "curvlinops_ggn": (CurvlinopsGGN, {}),
    "curvlinops_mc": (CurvlinopsGGN, {"stochastic": True}),
    "curvlinops_ef": (CurvlinopsEF, {}),
    "asdl_ggn": (AsdlGGN, {}),
    "asdl_mc": (AsdlGGN, {"stochastic": True}),
    "asdl_ef": (AsdlEF, {}),
    "backpack_ggn": (BackPackGGN, {}),
    "backpack_mc": (BackPackGGN, {"stochastic": True}),
    "backpack_ef": (BackPackEF, {}),
}
# Backend of the dense last-layer block of diag_full. laplace-torch forms it as
# sum_n J_n^T H_n J_n from last-layer Jacobians, a contraction whose cost (not the sampling)
# dominates, so the exact GGN costs the same as its MC estimate and the GGN/MC backends all use
# the exact GGN (AsdlGGN: 1.6x faster than CurvlinopsGGN's dense linear operator here). The EF
# backends keep the EF; laplace-torch's AsdlEF cannot compute this block (it returns the
# gradients of all parameters), Curvlinops computes the same empirical Fisher.
LAST_LAYER_BACKEND = {
    "curvlinops_ggn": "asdl_ggn",
    "curvlinops_mc": "asdl_ggn",
    "asdl_mc": "asdl_ggn",
    "backpack_ggn": "asdl_ggn",
    "backpack_mc": "asdl_ggn",
    "asdl_ef": "curvlinops_ef",
    "backpack_ef": "curvlinops_ef",
}
DEFAULT_BACKEND = "asdl_mc"
STRUCTURES = ("kron", "diag", "diag_full")
CURVATURE_CLASSES: dict[str, type[Curvature]] = {
    cls.structure: cls for cls in (KronCurvature, DiagCurvature, DiagFullCurvature)
}


def _laplace(
    model: nn.Module,
    loader: DataLoader,
    backend: str,
    temperature: float,
    prior_var: float,
    **kwargs: Any,
) -> Any:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    backend_cls, backend_kwargs = BACKENDS[backend]
    if backend.startswith("asdl"):
        asdl_speedup.install()  # conv K-FAC factors without a transposed copy of the batch
    la = Laplace(
        model,
        "classification",
        prior_precision=1.0 / prior_var,
        temperature=temperature,
        backend=backend_cls,
        backend_kwargs=dict(backend_kwargs),
        **kwargs,
    )
    la.fit(loader)
    return la


def fit_laplace(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    hessian_structure: str,
    *,
    temperature: float = 0.1,
    prior_var: float = 0.1,
    backend: str = DEFAULT_BACKEND,
    batch_size: int = 256,
    seed: int | None = 0,
    **laplace_kwargs: Any,
) -> Any:
    """laplace-torch ``Laplace(...)`` fitted on ``(x, y)`` (``subset_of_weights="all"`` unless
    given) for a deep copy of ``model``; the RNG of MC backends is seeded with ``seed`` inside a
    forked RNG state."""
    model = copy.deepcopy(model).eval()
    # whole batches by slicing the tensors (a per-sample collate costs ~3 % of a LeNet fit)
    batches = BatchSampler(SequentialSampler(range(len(y))), batch_size, drop_last=False)
    loader = DataLoader(TensorDataset(x, y), sampler=batches, batch_size=None)
    laplace_kwargs.setdefault("subset_of_weights", "all")
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        return _laplace(
            model,
            loader,
            backend,
            temperature,
            prior_var,
            hessian_structure=hessian_structure,
            **laplace_kwargs,
        )


def _param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}


def _last_linear_name(model: nn.Module, param_shapes: dict[str, tuple[int, ...]]) -> str:
    """Module name of the last ``nn.Linear``; it must own the trailing parameters."""
    last = last_layer_names(param_shapes)
    module_name = last[0].rsplit(".", 1)[0] if "." in last[0] else ""
    module = dict(model.named_modules()).get(module_name)
    owned = []
    if isinstance(module, nn.Linear):
        owned = [f"{module_name}.{n}" if module_name else n for n, _ in module.named_parameters()]
    if owned != last:
        raise ValueError(
            f"diag_full needs the trailing parameters {last} to be one nn.Linear layer"
        )
    return module_name


def fit_curvature(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    structure: str,
    *,
    temperature: float = 0.1,
    prior_var: float = 0.1,
    backend: str = DEFAULT_BACKEND,
    batch_size: int = 256,
    seed: int | None = 0,
) -> Curvature:
    """Laplace curvature of the trained ``model`` (the MAP) on the client data ``(x, y)``.

    Returns a :class:`Curvature` of the given ``structure`` (``kron``, ``diag``,
    ``diag_full``) whose precision is ``H / temperature + I / prior_var``; ``model`` itself is
    not modified (laplace-torch works on a deep copy).
    """
    if structure not in STRUCTURES:
        raise ValueError(f"unknown structure {structure!r}; available: {', '.join(STRUCTURES)}")
    shapes = _param_shapes(model)
    if list(shapes) != [name for name, _ in model.named_parameters()]:
        raise ValueError("all parameters must require grad (the Laplace is over all weights)")
    common = dict(
        temperature=temperature,
        prior_var=prior_var,
        backend=backend,
        batch_size=batch_size,
        seed=seed,
    )
    if structure == "kron":
        la = fit_laplace(model, x, y, "kron", **common)
        return kron_from_laplace(la, shapes, temperature, prior_var)
    la = fit_laplace(model, x, y, "diag", **common)
    diag_curv = diag_from_laplace(la, shapes, temperature, prior_var)
    if structure == "diag":
        return diag_curv
    last_name = _last_linear_name(model, shapes)
    common["backend"] = LAST_LAYER_BACKEND.get(backend, backend)
    la_last = fit_laplace(
        model,
        x,
        y,
        "full",
        subset_of_weights="last_layer",
        last_layer_name=last_name,
        **common,
    )
    arrays = {k: v for k, v in diag_curv.to_arrays().items()}
    last = last_layer_names(shapes)
    for name in last:
        del arrays[f"{name}/ggn_diag"]
    block = la_last.H.detach().double()
    # A GGN block is PSD in exact arithmetic; float32 accumulation over thousands of samples
    # leaves small negative eigenvalues, so project onto the PSD cone (in float64) before upload.
    evals, evecs = torch.linalg.eigh(0.5 * (block + block.T))
    block = (evecs * evals.clamp(min=0)) @ evecs.T
    arrays[f"{last[0]}/ggn_full"] = to_numpy((0.5 * (block + block.T)).to(la_last.H.dtype))
    return DiagFullCurvature.from_arrays(arrays, shapes, temperature, prior_var)


def kron_from_laplace(
    la: Any, param_shapes: dict[str, tuple[int, ...]], temperature: float, prior_var: float
) -> KronCurvature:
    """``KronCurvature`` from a fitted laplace-torch ``KronLaplace`` (its ``H_facs``)."""
    kfacs = la.H_facs.kfacs
    if len(kfacs) != len(param_shapes):
        raise ValueError(
            f"laplace-torch returned {len(kfacs)} Kron blocks for {len(param_shapes)} parameters"
        )
    matrices: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for (name, shape), factors in zip(param_shapes.items(), kfacs, strict=True):
        out_dim, in_dim = matrix_shape(shape)
        if len(factors) == 2:
            b, a = factors
        else:  # single dense block (bias, or a 1x1 weight): trivial output factor
            (a,) = factors
            b = torch.ones(1, 1, dtype=a.dtype, device=a.device)
        if tuple(b.shape) != (out_dim, out_dim) or tuple(a.shape) != (in_dim, in_dim):
            raise ValueError(
                f"Kron factors of {name!r} have shapes {tuple(b.shape)}, {tuple(a.shape)}; "
                f"expected ({out_dim}, {out_dim}), ({in_dim}, {in_dim})"
            )
        matrices[name] = (b.detach().cpu(), a.detach().cpu())
    return KronCurvature.from_kron_matrices(matrices, param_shapes, temperature, prior_var)


def diag_from_laplace(
    la: Any, param_shapes: dict[str, tuple[int, ...]], temperature: float, prior_var: float
) -> DiagCurvature:
    """``DiagCurvature`` from a fitted laplace-torch ``DiagLaplace`` (its ``H`` vector)."""
    flat = la.H.detach().cpu()
    arrays, offset = {}, 0
    for name, shape in param_shapes.items():
        size = int(torch.Size(shape).numel())
        arrays[f"{name}/ggn_diag"] = to_numpy(flat[offset : offset + size].reshape(shape))
        offset += size
    if offset != flat.numel():
        raise ValueError(f"laplace-torch diagonal has {flat.numel()} entries, model {offset}")
    return DiagCurvature.from_arrays(arrays, param_shapes, temperature, prior_var)
