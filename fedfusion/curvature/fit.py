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
    the dense ``n x n`` block of that layer (``n = n_classes * n_features`` for a bias-free last
    layer, 840 for LeNet), computed in closed form by :func:`last_layer_block` from one forward
    pass: the exact GGN ``sum_n (diag p_n - p_n p_n^T) (x) psi_n psi_n^T`` for the GGN and MC
    backends (what laplace-torch's last-layer ``"full"`` Laplace returns with an exact-GGN
    backend; tested against it and against a dense Jacobian GGN), the empirical Fisher for
    ``*_ef``. laplace-torch forms the same block from dense per-sample Jacobians
    ``sum_n J_n^T H_n J_n``, ignoring ``J_n = I (x) psi_n^T``; the closed form is two GEMMs. The
    diagonal of an already fitted ``diag`` section of the same member is reused
    (``diagonal=``).

Backends (``backend=``): ``"<library>_<type>"`` with library ``curvlinops``, ``asdl``,
``backpack`` and type ``ggn`` (exact GGN; for K-FAC the "type-2" K-FAC, one backward pass per
class), ``mc`` (Monte-Carlo Fisher, one sampled label per input: an unbiased estimate of the
GGN from a single backward pass) or ``ef`` (empirical Fisher, gradients at the true labels: a
different, biased matrix). ``curvlinops_ggn`` is laplace-torch's default and the one the
FedBEns reference code uses; ``asdl_ggn`` gives the same K-FAC and diagonal. Known
limitations (measured in benchmarks/docs/curvature.md):

* ``curvlinops_ggn`` / ``curvlinops_mc`` with ``diag`` / ``diag_full`` go through laplace-torch's
  ``torch.func`` Jacobian of a whole batch (a vmap over batch x classes cotangents), whose
  memory grows with batch x classes: do not use them for the diagonal.
* ``curvlinops_mc`` builds a fresh Curvlinops K-FAC operator per batch with Curvlinops' fixed
  default seed, so every batch reuses the same random draws (``seed`` has no effect) and its
  error depends on the batch size.
* ``backpack_*`` K-FAC needs a plain ``nn.Sequential`` model and, through laplace-torch,
  returns convolution factors on another scale than Curvlinops / ASDL; ``backpack_ef`` has no
  K-FAC. Its diagonals are fine.

Default ``backend="asdl_mc"``: the MC Fisher back-propagates once per batch instead of once
per class, so it is several times cheaper than the exact GGN while its factors, log
determinant and quadratic forms stay close to it; the empirical Fisher is as cheap but
biased. Batch 256 is the default fit batch. Use ``backend="asdl_ggn"`` for the reference
code's exact K-FAC. The MC draws are seeded with ``seed`` inside a forked RNG state (ASDL /
BackPack), so a fit is reproducible and the global RNG is left alone.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from fedfusion import accel
from fedfusion.core.state import StateLayout
from fedfusion.curvature.base import Curvature, to_numpy
from fedfusion.curvature.diag import DiagCurvature, DiagFullCurvature, last_layer_names
from fedfusion.curvature.hybrid import check_kron_module, hybrid_kron_fit
from fedfusion.curvature.kron import KronCurvature, matrix_shape
from fedfusion.device import model_device
from fedfusion.grad_mode import gradients_on
from fedfusion.seeding import seeded

log = logging.getLogger("fedfusion")

#: backend name -> (laplace-torch curvature class in ``laplace.curvature``, its kwargs). Named,
#: not imported: laplace-torch and what it loads take ~0.3 GB of memory per process, which the
#: server (which never fits) does not need; :func:`_laplace` imports it on the first fit.
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "curvlinops_ggn": ("CurvlinopsGGN", {}),
    "curvlinops_mc": ("CurvlinopsGGN", {"stochastic": True}),
    "curvlinops_ef": ("CurvlinopsEF", {}),
    "asdl_ggn": ("AsdlGGN", {}),
    "asdl_mc": ("AsdlGGN", {"stochastic": True}),
    "asdl_ef": ("AsdlEF", {}),
    "backpack_ggn": ("BackPackGGN", {}),
    "backpack_mc": ("BackPackGGN", {"stochastic": True}),
    "backpack_ef": ("BackPackEF", {}),
}
DEFAULT_BACKEND = "asdl_mc"
STRUCTURES = ("kron", "diag", "diag_full")
CURVATURE_CLASSES: dict[str, type[Curvature]] = {
    cls.structure: cls for cls in (KronCurvature, DiagCurvature, DiagFullCurvature)
}


def import_laplace() -> float:
    """Import laplace-torch now; returns the seconds it took (0 once imported).

    About 2 s on the first call in a process. Clients call it before their first timed fit
    so that the one-time import is not counted as the fit time of their first member."""
    if "laplace" in sys.modules:
        return 0.0
    start = time.perf_counter()
    # laplace-torch calls logging.info() at import: with no handler on the root logger that
    # runs logging.basicConfig(), and the caller's own basicConfig() later does nothing
    root = logging.getLogger()
    guard = None if root.handlers else logging.NullHandler()
    if guard is not None:
        root.addHandler(guard)
    try:
        with quiet_laplace():
            import laplace  # noqa: F401
    finally:
        if guard is not None:
            root.removeHandler(guard)
    return time.perf_counter() - start


@contextlib.contextmanager
def quiet_laplace() -> Iterator[None]:
    """laplace-torch's import and fits without the two FutureWarnings torch 2.14 raises for
    what its dependencies use (``torch.jit.script``; ASDL's non-full backward hooks, once per
    layer and fit: its diagonal still equals the exact GGN's, tests/curvature/
    test_attention.py); the caller's warning filters are restored after."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.jit\.script` is deprecated", FutureWarning)
        # only the variant ASDL is immune to (it reads grad_output, this one loses grad_input);
        # the variants that lose grad_output would mean a wrong fit and stay loud
        warnings.filterwarnings("ignore", "Using a non-full backward hook when the forward "
                                "contains multiple autograd Nodes", FutureWarning)
        yield


def uses_laplace(model: nn.Module, structure: str, backend: str = DEFAULT_BACKEND,
                 accelerate: bool | None = None) -> bool:
    """Whether :func:`fit_curvature` of ``model`` with ``structure``, ``backend`` and
    ``accelerate`` goes through laplace-torch (a client need not import it, ~2 s and 0.3 GB,
    when it does not)."""
    if structure != "kron":
        return True
    if is_hybrid(model):
        return False
    if backend == "asdl_mc" and accel.requested(accelerate):
        from fedfusion.accel.fast_kron import supports

        return not supports(model)
    return True


def is_hybrid(model: nn.Module) -> bool:
    """Whether ``model`` has parameters outside ``nn.Linear`` / ``nn.Conv2d`` modules
    (BatchNorm, LayerNorm, ``nn.MultiheadAttention``, ...), which laplace-torch's Kron backends
    do not know: its Kron curvature is then fitted by :mod:`fedfusion.curvature.hybrid`."""
    return _first_hybrid_module(model) is not None


def _first_hybrid_module(model: nn.Module) -> str | None:
    """``"<module class> parameter '<name>'"`` of the first parameter outside the Linear /
    Conv2d modules laplace-torch sees called (an attention's ``out_proj`` is an ``nn.Linear``
    its attention module never calls), or None."""
    layout = StateLayout.of(model)
    attention = [name for name, m in model.named_modules()
                 if isinstance(m, nn.MultiheadAttention)]
    for name in layout.parameters:
        inside = any(name.startswith(f"{prefix}.") or not prefix for prefix in attention)
        if name not in layout.kron or inside:
            return f"{layout.owners[name]} parameter {name!r}"
    return None


def _laplace(
    model: nn.Module,
    loader: DataLoader,
    backend: str,
    temperature: float,
    prior_var: float,
    accelerate: bool,
    **kwargs: Any,
) -> Any:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    import_laplace()
    with quiet_laplace():
        from laplace import Laplace, curvature

        class_name, backend_kwargs = BACKENDS[backend]
        backend_cls = getattr(curvature, class_name)
        la = Laplace(
            model,
            "classification",
            prior_precision=1.0 / prior_var,
            temperature=temperature,
            backend=backend_cls,
            backend_kwargs=dict(backend_kwargs),
            **kwargs,
        )
        if accelerate and backend.startswith("asdl"):
            from fedfusion.accel.asdl_speedup import patched

            with patched():  # conv K-FAC factors without a transposed copy of the batch
                la.fit(loader)
        else:
            la.fit(loader)
    return la


@gradients_on()
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
    accelerate: bool | None = None,
    **laplace_kwargs: Any,
) -> Any:
    """laplace-torch ``Laplace(...)`` fitted on ``(x, y)`` (``subset_of_weights="all"`` unless
    given) for a deep copy of ``model``; the RNG of MC backends is seeded with ``seed`` inside a
    forked RNG state. ``accelerate`` (see :mod:`fedfusion.accel`): ASDL's conv factors in their
    batched form during this fit."""
    model = copy.deepcopy(model).eval()
    # whole batches by slicing the tensors (a per-sample collate costs ~3 % of a LeNet fit)
    batches = BatchSampler(SequentialSampler(range(len(y))), batch_size, drop_last=False)
    loader = DataLoader(TensorDataset(x, y), sampler=batches, batch_size=None)
    laplace_kwargs.setdefault("subset_of_weights", "all")
    # laplace-torch moves each batch to the model's device; its MC draws happen there
    device = model_device(model)
    with seeded(seed, device):
        return _laplace(
            model,
            loader,
            backend,
            temperature,
            prior_var,
            accel.requested(accelerate),
            hessian_structure=hessian_structure,
            **laplace_kwargs,
        )


def param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the parameters that require grad."""
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


@gradients_on()
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
    diagonal: DiagCurvature | None = None,
    accelerate: bool | None = None,
) -> Curvature:
    """Laplace curvature of the trained ``model`` (the MAP) on the client data ``(x, y)``.

    Returns a :class:`Curvature` of the given ``structure`` (``kron``, ``diag``,
    ``diag_full``) whose precision is ``H / temperature + I / prior_var``; ``model`` itself is
    not modified (laplace-torch works on a deep copy). ``diagonal``: this member's ``diag``
    fit with the same settings, if already computed; ``diag`` / ``diag_full`` reuse it.
    ``accelerate`` (default: ``FEDFUSION_ACCEL``, else off; see :mod:`fedfusion.accel`): the
    ``asdl_mc`` Kron factors of a plain conv/linear chain on the stacked trainer's compiled
    layers, the same factors to float tolerance without laplace-torch.
    """
    if structure not in STRUCTURES:
        raise ValueError(f"unknown structure {structure!r}; available: {', '.join(STRUCTURES)}")
    shapes = param_shapes(model)
    if list(shapes) != [name for name, _ in model.named_parameters()]:
        raise ValueError("all parameters must require grad (the Laplace is over all weights)")
    common = dict(
        temperature=temperature,
        prior_var=prior_var,
        backend=backend,
        batch_size=batch_size,
        seed=seed,
        accelerate=accelerate,
    )
    if structure == "kron":
        for name, module in model.named_modules():
            if isinstance(module, nn.Conv2d):
                check_kron_module(name, module)
        if is_hybrid(model):  # BatchNorm, LayerNorm, ...: laplace-torch's Kron cannot
            if backend != DEFAULT_BACKEND:
                raise ValueError(
                    f"curvature backend {backend!r} has no Kron factors for the "
                    f"{_first_hybrid_module(model)}; use the default backend "
                    f"{DEFAULT_BACKEND!r} (Kron blocks for Linear/Conv2d, diagonal blocks for "
                    "the rest) or the 'diag' structure")
            matrices, diagonals = hybrid_kron_fit(model, x, seed, batch_size)
            return KronCurvature.from_kron_matrices(matrices, shapes, temperature, prior_var,
                                                    diagonals)
        if backend == "asdl_mc" and accel.requested(accelerate):  # the same factors, faster
            from fedfusion.accel.fast_kron import kron_mc_factors

            matrices = kron_mc_factors(model, x, seed, batch_size)
            if matrices is not None:
                return KronCurvature.from_kron_matrices(matrices, shapes, temperature, prior_var)
        la = fit_laplace(model, x, y, "kron", **common)
        if len(la.H_facs.kfacs) != len(shapes) and backend == DEFAULT_BACKEND:
            # laplace-torch drops a layer its forward pass never calls (unused, or its
            # weight read without calling it): the own fit gives it zero factors or names it
            log.info("Kron curvature: laplace-torch fitted %d of %d parameters; own fit instead",
                     len(la.H_facs.kfacs), len(shapes))
            matrices, _ = hybrid_kron_fit(model, x, seed, batch_size)
            return KronCurvature.from_kron_matrices(matrices, shapes, temperature, prior_var)
        return kron_from_laplace(la, shapes, temperature, prior_var)
    if diagonal is None:
        diagonal = _fit_diagonal(model, x, y, shapes, common)
    if structure == "diag":
        return diagonal
    block = last_layer_block(model, _last_linear_name(model, shapes), x, y,
                             "ef" if backend.endswith("_ef") else "ggn", batch_size)
    arrays = dict(diagonal.to_arrays())
    last = last_layer_names(shapes)
    for name in last:
        del arrays[f"{name}/ggn_diag"]
    # A GGN block is PSD in exact arithmetic; float32 accumulation over thousands of samples
    # leaves small negative eigenvalues, so project onto the PSD cone (in float64) before upload.
    evals, evecs = torch.linalg.eigh(0.5 * (block + block.T))
    block = (evecs * evals.clamp(min=0)) @ evecs.T
    dtype = next(model.parameters()).dtype
    arrays[f"{last[0]}/ggn_full"] = to_numpy((0.5 * (block + block.T)).to(dtype))
    return DiagFullCurvature.from_arrays(arrays, shapes, temperature, prior_var)


def _fit_diagonal(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  shapes: dict[str, tuple[int, ...]], common: dict[str, Any]) -> DiagCurvature:
    """laplace-torch's diagonal; for a module it does not know (its backends skip such a
    module's parameters or fail on them), the MC-Fisher diagonal of
    :mod:`fedfusion.curvature.hybrid` for the default backend, else an error naming it."""
    temperature, prior_var = common["temperature"], common["prior_var"]
    try:
        la = fit_laplace(model, x, y, "diag", **common)
        return diag_from_laplace(la, shapes, temperature, prior_var)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        if common["backend"] != DEFAULT_BACKEND:
            raise ValueError(f"curvature backend {common['backend']!r} cannot fit the diagonal "
                             f"of this model ({type(exc).__name__}: {exc}); use the default "
                             f"backend {DEFAULT_BACKEND!r}") from exc
        log.info("diag curvature: laplace-torch failed (%s: %s); MC-Fisher diagonal instead",
                 type(exc).__name__, str(exc)[:200])
    _, diagonals = hybrid_kron_fit(model, x, common["seed"], common["batch_size"], kron=False)
    return DiagCurvature(diagonals, shapes, temperature, prior_var)


@torch.no_grad()
def last_layer_block(
    model: nn.Module,
    layer_name: str,
    x: torch.Tensor,
    y: torch.Tensor,
    fisher: str = "ggn",
    batch_size: int = 256,
) -> torch.Tensor:
    """Dense curvature of the ``nn.Linear`` ``layer_name`` summed over ``(x, y)``, float64,
    in laplace-torch's order of its parameters (``vec(W)`` row-major, then the bias).

    With ``psi_n`` the layer's input (and a trailing 1 for the bias), the logits' Jacobian with
    respect to the layer's parameters is ``I_K (x) psi_n^T`` up to that order, so the block is
    ``sum_n G_n (x) psi_n psi_n^T``: ``fisher="ggn"``: ``G_n = diag(p_n) - p_n p_n^T`` (the exact
    GGN of the cross-entropy), i.e. ``blockdiag_k(sum_n p_nk psi_n psi_n^T) - V^T V`` with rows
    ``V_n = p_n (x) psi_n``; ``fisher="ef"``: ``G_n = g_n g_n^T``, ``g_n = p_n - e_{y_n}`` (the
    empirical Fisher), i.e. ``V^T V`` with ``V_n = g_n (x) psi_n``. Batches are reduced in the
    model's dtype and summed in float64.
    """
    if fisher not in ("ggn", "ef"):
        raise ValueError(f"fisher must be 'ggn' or 'ef', got {fisher!r}")
    layer = dict(model.named_modules())[layer_name]
    classes, features = layer.out_features, layer.in_features
    width = features + (layer.bias is not None)
    inputs: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda _m, args, _out: inputs.append(args[0]))
    was_training = model.training
    model.eval()
    device = model_device(model)  # (x, y) may stay on the CPU: one batch at a time moves
    outer = torch.zeros(classes * width, classes * width, dtype=torch.float64, device=device)
    class_blocks = torch.zeros(classes, width, width, dtype=torch.float64, device=device)
    try:
        for start in range(0, len(y), batch_size):
            inputs.clear()
            prob = model(x[start : start + batch_size].to(device)).softmax(-1)
            psi = inputs[0].reshape(len(prob), features)
            if layer.bias is not None:
                psi = torch.cat([psi, torch.ones_like(psi[:, :1])], dim=1)
            if fisher == "ggn":
                class_blocks += torch.einsum("nk,nf,ng->kfg", prob, psi, psi).double()
                rows = prob
            else:
                rows = prob - nn.functional.one_hot(y[start : start + batch_size].to(device),
                                                    classes)
            v = (rows[:, :, None] * psi[:, None, :]).reshape(len(prob), -1)
            outer += (v.T @ v).double()
    finally:
        handle.remove()
        model.train(was_training)
    block = torch.block_diag(*class_blocks) - outer if fisher == "ggn" else outer
    # (class k, column j) -> laplace-torch's position: W[k, j] at k * features + j, b[k] after W
    position = [k * features + j if j < features else classes * features + k
                for k in range(classes) for j in range(width)]
    order = torch.argsort(torch.tensor(position, device=block.device))
    return block[order][:, order]


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
