"""Benchmark laplace-torch curvature backends for the client-side Laplace fit.

Trains one bias-free LeNet on 12,000 real Fashion-MNIST training samples (SGD lr 0.01, momentum
0.9, batch 64, 20 epochs, one thread, timed), then times ``fit_curvature`` for every backend
(``fedfusion.curvature.BACKENDS``) and fit batch size, per structure, and compares each result
with the exact GGN (``curvlinops_ggn``, laplace-torch's default, batch 256):

* ``kron``: per layer, the relative Frobenius error of the likelihood curvature
  ``||B (x) A - B* (x) A*||_F / ||B* (x) A*||_F`` and of the posterior precision
  ``Lambda = B (x) A / T + I / sigma2``, computed exactly from the factors via
  ``||X (x) Y||_F^2 = ||X||_F^2 ||Y||_F^2`` and ``<X (x) Y, U (x) V> = <X, U> <Y, V>`` (the dense
  120*256 x 120*256 block of the first fc layer alone would need 7.5 GB);
* ``diag`` / ``diag_full``: the relative error of the diagonal (and of the dense last block);
* the log-determinant of ``Lambda`` and its difference to the exact one;
* a downstream check: the quadratic form ``(w2 - w1)^T Lambda (w2 - w1)`` at the weights ``w2``
  of a second member trained from another init (the kind of point the server objective
  evaluates), as a relative difference to the exact one;
* for the MC backend, the spread of the log-determinant over MC seeds next to its spread
  between two independently trained members.

The exact reference is ``curvlinops_ggn`` for ``kron`` and ``asdl_ggn`` for ``diag`` /
``diag_full`` (same matrix, to 1e-7): laplace-torch's Curvlinops GGN/MC diagonal goes through
``torch.func`` Jacobians of a whole batch (a vmap over batch x classes cotangents), which needs
more than 20 GB at batch 256 and 170-460 s at batch 16-32 on LeNet, so those two rows are
skipped for the diagonal structures.

Timing on a shared machine: every fit is timed ``--repeats`` times (default 2) and the minimum
is kept; the training time is the fastest epoch times the number of epochs (the measured total
is stored as well), and the load average at the start and end is recorded in the JSON.
``fit/train`` is the ratio of these two least-disturbed times.

The MAP's test accuracy is the same for every backend, so it is reported once. BackPack's
K-FAC only extends ``nn.Sequential`` models: the ``backpack_*`` rows run on
``nn.Sequential(*features, *classifier)``, the same function with the same weights.

Usage: ``python benchmarks/curvature_backends.py [--quick]``; prints a table and writes
``benchmarks/results/curvature_backends.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedfusion.curvature import (  # noqa: E402
    BACKENDS,
    DEFAULT_BACKEND,
    STRUCTURES,
    Curvature,
    DiagCurvature,
    DiagFullCurvature,
    KronCurvature,
    StackedGaussians,
    fit_curvature,
)
from fedfusion.models import build_model  # noqa: E402

FMNIST = Path("/usr/share/datasets/fashion-mnist")
RESULTS = ROOT / "benchmarks" / "results" / "curvature_backends.json"
MEAN, STD = 0.2860, 0.3530
T, SIGMA2 = 0.1, 0.1
REFERENCE = {"kron": "curvlinops_ggn", "diag": "asdl_ggn", "diag_full": "asdl_ggn"}
SKIP = {
    ("diag", "curvlinops_ggn"),
    ("diag", "curvlinops_mc"),
    ("diag_full", "curvlinops_ggn"),
    ("diag_full", "curvlinops_mc"),
}
SKIP_REASON = "laplace-torch's whole-batch torch.func Jacobians: >20 GB at batch 256"


def load_fmnist(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST IDX files -> normalised ``[N, 1, 28, 28]`` float32 images, int64 labels."""
    prefix = "train" if split == "train" else "t10k"
    with gzip.open(FMNIST / f"{prefix}-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(FMNIST / f"{prefix}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = (images.astype(np.float32) / 255.0 - MEAN) / STD
    return torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))


def train_lenet(
    x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int
) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(seed)
    model = build_model("lenet", (1, 28, 28), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    epoch_seconds = []
    for _ in range(epochs):
        start = time.perf_counter()
        model.train()
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        epoch_seconds.append(time.perf_counter() - start)
    return model, epoch_seconds


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = sum(
        (model(xb).argmax(-1) == yb).sum().item()
        for xb, yb in zip(x.split(2000), y.split(2000), strict=True)
    )
    return correct / len(y)


def sequential(model: nn.Module) -> nn.Module:
    """The LeNet as one ``nn.Sequential`` sharing its parameters (for BackPack)."""
    return nn.Sequential(*model.features, *model.classifier)


# ---------------------------------------------------------------------------------------------
# comparisons with the exact GGN


def _factor_matrices(curv: KronCurvature, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    fac = curv.factors[name]
    b = fac.eigvecs_out.double() @ torch.diag(fac.eigvals_out.double()) @ fac.eigvecs_out.double().T
    a = fac.eigvecs_in.double() @ torch.diag(fac.eigvals_in.double()) @ fac.eigvecs_in.double().T
    return b, a


def kron_errors(curv: KronCurvature, ref: KronCurvature) -> dict[str, dict[str, float]]:
    """Per layer: relative Frobenius errors of ``B (x) A`` and of ``Lambda`` w.r.t. ``ref``."""
    out = {}
    delta = ref.prior_precision
    for name in ref.param_shapes:
        b, a = _factor_matrices(curv, name)
        b0, a0 = _factor_matrices(ref, name)
        inner = lambda x, y: float((x * y).sum())  # noqa: E731
        n = b.shape[0] * a.shape[0]
        diff_sq = inner(b, b) * inner(a, a) + inner(b0, b0) * inner(a0, a0)
        diff_sq -= 2 * inner(b, b0) * inner(a, a0)
        ref_sq = inner(b0, b0) * inner(a0, a0)
        prec_sq = ref_sq / T**2 + 2 * delta * float(torch.trace(b0) * torch.trace(a0)) / T
        prec_sq += delta**2 * n
        diff = math.sqrt(max(diff_sq, 0.0))
        out[name] = {"H": diff / math.sqrt(ref_sq), "precision": diff / T / math.sqrt(prec_sq)}
    return out


def _diag_vectors(curv: Curvature) -> dict[str, torch.Tensor]:
    if isinstance(curv, DiagCurvature | DiagFullCurvature):
        vecs = {name: h.double().flatten() for name, h in curv.diag.items()}
        if isinstance(curv, DiagFullCurvature):
            vecs[curv.full_key] = curv.last_block.double().flatten()
        return vecs
    raise TypeError(type(curv))


def diag_errors(curv: Curvature, ref: Curvature) -> dict[str, dict[str, float]]:
    """Per parameter (and dense last block): relative errors of ``h`` and of ``h/T + delta``."""
    out = {}
    delta = ref.prior_precision
    ref_vecs, vecs = _diag_vectors(ref), _diag_vectors(curv)
    for name, h0 in ref_vecs.items():
        diff = float((vecs[name] - h0).norm())
        if name.endswith("/ggn_full"):
            n = int(math.isqrt(h0.numel()))
            prec0 = h0.reshape(n, n) / T + delta * torch.eye(n, dtype=torch.float64)
        else:
            prec0 = h0 / T + delta
        out[name] = {"H": diff / float(h0.norm()), "precision": diff / T / float(prec0.norm())}
    return out


# ---------------------------------------------------------------------------------------------


def run_fit(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, structure: str, backend: str, batch: int
) -> tuple[Curvature | None, float, str]:
    fit_model = sequential(model) if backend.startswith("backpack") else model
    start = time.perf_counter()
    try:
        curv = fit_curvature(
            fit_model,
            x,
            y,
            structure,
            temperature=T,
            prior_var=SIGMA2,
            backend=backend,
            batch_size=batch,
        )
    except Exception as exc:  # noqa: BLE001 - a backend that does not apply is a result too
        return None, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"[:200]
    seconds = time.perf_counter() - start
    if backend.startswith("backpack"):  # rename 0.weight -> features.0.weight etc.
        names = [n for n, _ in model.named_parameters()]
        arrays = {}
        for key, value in curv.to_arrays().items():
            pname, suffix = key.split("/")
            idx = [n for n, _ in fit_model.named_parameters()].index(pname)
            arrays[f"{names[idx]}/{suffix}"] = value
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        curv = type(curv).from_arrays(arrays, shapes, T, SIGMA2)
    return curv, seconds, ""


def quad_at(curv: Curvature, mean: nn.Module, other: nn.Module) -> float:
    """``(w2 - w1)^T Lambda (w2 - w1)`` with ``w1`` = ``mean``'s and ``w2`` = ``other``'s
    weights, through the batched server code (float64)."""
    means = [{n: p.detach().double() for n, p in mean.named_parameters()}]
    stacked = StackedGaussians.from_members(means, [curv], "cpu")
    w = {n: p.detach().double()[None] for n, p in other.named_parameters()}
    return float(stacked.quadratic_form(w)[0, 0])


def compare(
    structure: str, curv: Curvature, ref: Curvature, ref_quad: float, model, other
) -> dict[str, Any]:
    errs = kron_errors(curv, ref) if structure == "kron" else diag_errors(curv, ref)
    logdet = curv.precision_logdet()
    quad = quad_at(curv, model, other)
    return {
        "layer_errors": errs,
        "max_H_rel_err": max(e["H"] for e in errs.values()),
        "max_precision_rel_err": max(e["precision"] for e in errs.values()),
        "logdet": logdet,
        "logdet_diff": logdet - ref.precision_logdet(),
        "quad_other_member": quad,
        "quad_rel_diff": quad / ref_quad - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs, batch 256 only")
    parser.add_argument("--samples", type=int, default=12_000)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=2, help="fit timings: min over repeats")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    epochs = 2 if args.quick else args.epochs
    batches = [256] if args.quick else [128, 256, 512, 1000]
    load_start = os.getloadavg()

    x_all, y_all = load_fmnist("train")
    gen = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(y_all), generator=gen)[: args.samples]
    x, y = x_all[idx], y_all[idx]
    x_test, y_test = load_fmnist("test")

    model, epoch_seconds = train_lenet(x, y, epochs, seed=0)
    train_total = float(sum(epoch_seconds))
    # on a shared machine the fastest epoch x epochs is the least disturbed training time; fits
    # are timed the same way (min over --repeats), so fit/train compares like with like
    train_seconds = min(epoch_seconds) * epochs
    test_acc = accuracy(model, x_test, y_test)
    print(
        f"LeNet, {len(y)} FMNIST samples, {epochs} epochs: {train_seconds:.1f} s "
        f"(fastest epoch {train_seconds / epochs:.2f} s, total {train_total:.1f} s), "
        f"MAP test accuracy {test_acc:.4f}",
        flush=True,
    )
    other, _ = train_lenet(x, y, epochs, seed=1)  # a second member, another init

    rows: list[dict[str, Any]] = []
    header = (
        f"{'structure':<10} {'backend':<15} {'batch':>5} {'fit s':>7} {'fit/train':>9} "
        f"{'H err':>9} {'prec err':>9} {'logdet':>10} {'dlogdet':>8} {'dquad':>8}"
    )
    print("H err / prec err: max over layers of the relative Frobenius error vs the exact GGN;")
    print("dquad: relative change of (w2-w1)^T Lambda (w2-w1) at a second member's weights")
    print(header)
    print("-" * len(header))
    for structure in STRUCTURES:
        ref, _, _ = run_fit(model, x, y, structure, REFERENCE[structure], 256)
        assert ref is not None
        ref_quad = quad_at(ref, model, other)
        for backend in BACKENDS:
            sweep = structure == "kron" and not backend.startswith("backpack")
            for batch in batches if sweep else [256]:
                row: dict[str, Any] = {"structure": structure, "backend": backend, "batch": batch}
                rows.append(row)
                if (structure, backend) in SKIP:
                    row["error"] = SKIP_REASON
                    print(f"{structure:<10} {backend:<15} {batch:>5} skipped: {SKIP_REASON}")
                    continue
                times = []
                for _ in range(args.repeats):
                    curv, seconds, error = run_fit(model, x, y, structure, backend, batch)
                    times.append(seconds)
                    if curv is None:
                        break
                seconds = min(times)
                row.update(
                    fit_seconds=seconds,
                    fit_seconds_all=times,
                    fit_over_train=seconds / train_seconds,
                )
                if curv is None:
                    row["error"] = error
                    print(f"{structure:<10} {backend:<15} {batch:>5} fails: {error[:70]}")
                    continue
                row.update(compare(structure, curv, ref, ref_quad, model, other))
                print(
                    f"{structure:<10} {backend:<15} {batch:>5} {seconds:>7.2f} "
                    f"{seconds / train_seconds:>9.1%} {row['max_H_rel_err']:>9.2e} "
                    f"{row['max_precision_rel_err']:>9.2e} {row['logdet']:>10.1f} "
                    f"{row['logdet_diff']:>+8.1f} {row['quad_rel_diff']:>+8.2%}",
                    flush=True,
                )

    # MC noise of the default backend vs the spread between members
    noise: dict[str, Any] = {"backend": DEFAULT_BACKEND, "structure": "kron"}
    mc = [
        fit_curvature(model, x, y, "kron", backend=DEFAULT_BACKEND, seed=seed).precision_logdet()
        for seed in range(4)
    ]
    exact = [
        fit_curvature(m, x, y, "kron", backend="asdl_ggn").precision_logdet()
        for m in (model, other)
    ]
    noise.update(
        mc_logdets=mc,
        mc_logdet_std=float(np.std(mc, ddof=1)),
        mc_logdet_bias=float(np.mean(mc) - exact[0]),
        exact_logdets_two_members=exact,
        member_logdet_gap=exact[1] - exact[0],
    )
    print(
        f"\n{DEFAULT_BACKEND} kron log det over 4 MC seeds: std {noise['mc_logdet_std']:.1f}, "
        f"bias {noise['mc_logdet_bias']:+.1f}; exact log det of two members differs by "
        f"{noise['member_logdet_gap']:+.1f} (values ~{exact[0]:.0f})"
    )

    result = {
        "setting": {
            "model": "lenet (bias-free, 44,190 params)",
            "samples": len(y),
            "epochs": epochs,
            "optimizer": "SGD lr 0.01 momentum 0.9 batch 64",
            "threads": 1,
            "temperature": T,
            "prior_var": SIGMA2,
            "reference": REFERENCE,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
        },
        "train_seconds": train_seconds,
        "train_seconds_measured_total": train_total,
        "epoch_seconds": epoch_seconds,
        "map_test_accuracy": test_acc,
        "rows": rows,
        "mc_noise": noise,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
