"""AMS against the uniform ensemble, FedAvg and PFNM on Fashion-MNIST MLPs.

The AMS paper's MLP experiments (Tables 2-4, Figure 3) on FMNIST (MNIST is not available
offline here):

* Table 2: hetero-label partition (3..6 labels per client), N in {5, 10, 20} clients;
* Table 3: Dirichlet partition, alpha = 0.5, N in {5, 10, 20};
* Figure 3: heterogeneity sweep, N = 5, Dirichlet alpha in {5^-4, 5^-3, 5^-2, 5^-1, 1}
  (benchmarks/results/ams_sweep.png);
* Table 4: cross-architecture, client c holds an MLP with 1 + (c mod 5) hidden layers
  (1..5), on hetero-label, Dirichlet 0.5 and Dirichlet 0.01, N in {5, 10, 20}: only the
  ensemble and AMS apply (FedAvg and PFNM need one depth).

Methods: AMS-top1, AMS-full (ams-top-k = 0), uniform ensemble, FedAvg (the shared init the
server broadcasts), PFNM (sigma^2 = sigma0^2 = gamma0 = 1, 5 iterations), and AMS-top1
calibrated (``ams-calibration=temperature``, not in the paper: each model's temperature
fitted on the server's validation rows, selection by calibrated top probability). One-shot: every
federation is trained ONCE per (partition, N, seed) with ``run_client`` from the server's
broadcast init (the ClientApp's code path), its uploads cached with
``fedfusion.upload_store`` under ``--out``, and EVERY method fuses the SAME uploads through
``strategy.fuse_uploads`` and is evaluated by ``fedfusion.core.evaluation.evaluate`` on the
10,000 FMNIST test images. 3 seeds, mean +- sd (sample sd).

Budget: the whole script (60 federations) is sized for <= 20 minutes of wall on the 2
shared CPU cores of the development machine: MLPs 784-100-...-10 (bias-free, fedfusion's
default), a seeded 20,000-sample training subset (``train-subset``), 15 local epochs of
SGD (lr 0.01, momentum 0.9, batch 64), one thread. The paper trains 40 epochs of Adam on
all of MNIST; this is a smaller, cheaper replica, not the paper's numbers. Measured: 764 s
(12.7 min) for all 60 federations, one core, the other one idle (about 10 s of training and
3-6 s of fusion + evaluation per federation). A re-run reuses the cached uploads
(``--fresh`` retrains); ``--from-json`` only redraws the tables and the plot.

    .venv/bin/python benchmarks/ams.py [--seeds 0,1,2] [--parts t2,t3,sweep,t4]

Prints markdown tables, saves benchmarks/results/ams.json and ams_sweep.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from common import REPO

from fedfusion.app.client_round import run_client  # noqa: E402
from fedfusion.app.config import (
    Settings,  # noqa: E402
    default_model,  # noqa: E402
)
from fedfusion.app.federation import federated_split  # noqa: E402
from fedfusion.client_app import client_settings  # noqa: E402
from fedfusion.core.evaluation import evaluate  # noqa: E402
from fedfusion.core.predictors import ModelSpec  # noqa: E402
from fedfusion.strategies import (  # noqa: E402
    PFNM,
    AdaptiveModelSelection,
    FedAvg,
    FusionStrategy,
    UniformEnsemble,
)
from fedfusion.upload_store import load_uploads, save_uploads  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SUBSET, EPOCHS = 20_000, 15
ALPHAS = [5.0 ** -4, 5.0 ** -3, 5.0 ** -2, 5.0 ** -1, 1.0]
CLIENTS = [5, 10, 20]

#: method -> strategy (its constructor's options beside the model, clients and seed)
METHODS: dict[str, tuple[type[FusionStrategy], dict[str, Any]]] = {
    "ensemble": (UniformEnsemble, {}),
    "fedavg": (FedAvg, {}),
    "pfnm": (PFNM, {}),
    "ams-full": (AdaptiveModelSelection, {"top_k": 0}),
    "ams-top1": (AdaptiveModelSelection, {"top_k": 1}),
    # not in the paper: temperatures fitted on the server's validation rows (the only
    # method given them; no validation screen, so only the selection rule differs)
    "ams-top1-calibrated": (AdaptiveModelSelection, {"top_k": 1, "calibration": "temperature",
                                                     "val_screen": False}),
}
CROSS_METHODS = ("ensemble", "ams-full", "ams-top1", "ams-top1-calibrated")
LABELS = {"ensemble": "ensemble", "fedavg": "FedAvg", "pfnm": "PFNM", "ams-full": "AMS-full",
          "ams-top1": "AMS-top1", "ams-top1-calibrated": "AMS-top1 calibrated"}


def cross_architecture(num_clients: int) -> str:
    """client-models: client c gets an MLP with 1 + (c mod 5) hidden layers of 100."""
    return json.dumps([{"model-kwargs": {"hidden_layers": 1 + c % 5}}
                       for c in range(num_clients)])


def federation(settings: Settings, folder: Path, fresh: bool) -> tuple[list, float]:
    """Train the N clients once (or reuse the cached uploads); returns (uploads, train s)."""
    uploads_dir = folder / "uploads"
    if fresh and folder.exists():
        shutil.rmtree(folder)
    if (uploads_dir / "manifest.json").is_file():
        _, uploads, _ = load_uploads(uploads_dir, strict=True)
        return uploads, sum(float(u.metrics["train-time-s"]) for u in uploads)
    bundle = federated_split(settings).bundle
    spec = ModelSpec(default_model(settings, bundle.input_shape), bundle.input_shape,
                     bundle.num_classes, settings.parsed_model_kwargs())
    inits = FedAvg(spec, num_members=settings.num_members,
                   seed=settings.seed).initial_models()  # the broadcast
    # named as a strategy names it: a client of another depth trains from its own init
    broadcast = {"model": spec.name, "model-kwargs": json.dumps(spec.kwargs, sort_keys=True)}
    uploads = [run_client(client_settings(settings, c), c, inits, server_config=broadcast)
               for c in range(settings.num_clients)]
    save_uploads(uploads_dir, uploads, settings.to_mapping())
    return uploads, sum(float(u.metrics["train-time-s"]) for u in uploads)


def member_models(spec: ModelSpec, upload: Any) -> list:
    """The upload's members, each built on its own architecture."""
    variant = spec.variant(upload.model, upload.model_kwargs)
    return [variant.build(member["weights"]) for member in upload.members]


def evaluate_methods(settings: Settings, uploads: list, methods: Sequence[str]
                     ) -> dict[str, Any]:
    bundle = federated_split(settings).bundle
    spec = ModelSpec("mlp", bundle.input_shape, bundle.num_classes,
                     settings.parsed_model_kwargs())
    row: dict[str, Any] = {}
    for method in methods:
        kind, options = METHODS[method]
        if options.get("calibration") == "temperature":
            options = {**options, "val": (bundle.val.x, bundle.val.y)}
        strategy = kind(spec, num_clients=settings.num_clients, seed=settings.seed, **options)
        start = time.perf_counter()
        predictor = strategy.fuse_uploads(uploads)
        fuse_s = time.perf_counter() - start
        metrics = evaluate(predictor, bundle.test.x, bundle.test.y)
        row[method] = {**metrics, "fuse_s": fuse_s}
        if method == "pfnm":
            row[method]["global_hidden_sizes"] = (
                strategy.report()["members"][0]["global_hidden_sizes"])
    clients = [evaluate(m, bundle.test.x, bundle.test.y)["accuracy"]
               for u in uploads for m in member_models(spec, u)]
    row["client_mean_acc"] = float(np.mean(clients))
    return row


def experiments(parts: Sequence[str]) -> list[dict[str, Any]]:
    """(part, partition label, settings overrides, methods) of every federation family."""
    out = []
    if "t2" in parts:
        out += [dict(part="t2", partition="hetero-label", n=n,
                     over=dict(partitioner="hetero-label"), methods=list(METHODS))
                for n in CLIENTS]
    if "t3" in parts:
        out += [dict(part="t3", partition="dirichlet 0.5", n=n,
                     over=dict(partitioner="dirichlet", alpha=0.5), methods=list(METHODS))
                for n in CLIENTS]
    if "sweep" in parts:
        out += [dict(part="sweep", partition=f"dirichlet {a:.6g}", n=5, alpha=a,
                     over=dict(partitioner="dirichlet", alpha=a), methods=list(METHODS))
                for a in ALPHAS]
    if "t4" in parts:
        for label, over in (("hetero-label", dict(partitioner="hetero-label")),
                            ("dirichlet 0.5", dict(partitioner="dirichlet", alpha=0.5)),
                            ("dirichlet 0.01", dict(partitioner="dirichlet", alpha=0.01))):
            out += [dict(part="t4", partition=label, n=n,
                         over=dict(over, client_models=cross_architecture(n)),
                         methods=list(CROSS_METHODS)) for n in CLIENTS]
    return out


def mean_sd(values: Sequence[float]) -> str:
    values = [100 * v for v in values]
    sd = np.std(values, ddof=1) if len(values) > 1 else 0.0
    return f"{np.mean(values):.2f} +- {sd:.2f}"


def table(rows: list[dict[str, Any]], part: str, methods: Sequence[str], key: str) -> str:
    groups: dict[tuple, list] = {}
    for r in rows:
        if r["part"] == part:
            groups.setdefault((r["partition"], r["n"]), []).append(r)
    lines = [f"| partition | N | {key} | " + " | ".join(LABELS[m] for m in methods)
             + " | mean client |", "|---" * (len(methods) + 4) + "|"]
    for (partition, n), rs in groups.items():
        extra = (f"{np.mean([r['pfnm']['global_hidden_sizes'][0] for r in rs]):.0f}"
                 if key == "PFNM width" else "[1,5]")
        best = max(methods, key=lambda m: np.mean([r[m]["accuracy"] for r in rs]))
        cells = [mean_sd([r[m]["accuracy"] for r in rs]) for m in methods]
        cells = [f"**{c}**" if m == best else c for m, c in zip(methods, cells, strict=True)]
        lines.append(f"| {partition} | {n} | {extra} | " + " | ".join(cells)
                     + f" | {mean_sd([r['client_mean_acc'] for r in rs])} |")
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], path: Path, wall_s: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in rows if r["part"] == "sweep"]
    alphas = sorted({r["alpha"] for r in sweep})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, marker in zip(METHODS, "osD^vP", strict=True):
        accs = [[100 * r[method]["accuracy"] for r in sweep if r["alpha"] == a] for a in alphas]
        mean = np.array([np.mean(a) for a in accs])
        sd = np.array([np.std(a, ddof=1) if len(a) > 1 else 0.0 for a in accs])
        ax.errorbar(alphas, mean, yerr=sd, marker=marker, capsize=3, label=LABELS[method])
    ax.set_xscale("log", base=5)
    ax.set_xticks(alphas, [f"$5^{{{round(np.log(a) / np.log(5))}}}$" for a in alphas])
    ax.set_xlabel("Dirichlet alpha (smaller = more heterogeneous)")
    ax.set_ylabel("test accuracy (%)")
    seeds = len({r["seed"] for r in sweep})
    ax.set_title(f"FMNIST, 5 clients, MLP 784-100-10, {SUBSET} samples x {EPOCHS} epochs, "
                 f"mean +- sd over {seeds} seeds\n(AMS paper Fig. 3 setting; the whole "
                 f"benchmark: {len(rows)} federations in {wall_s / 60:.0f} min on 1 CPU core)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--parts", default="t2,t3,sweep,t4")
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-ams"))
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--json", default=str(RESULTS / "ams.json"))
    parser.add_argument("--from-json", action="store_true",
                        help="only print the tables and redraw the plot from --json")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.json).read_text())
        report(saved["rows"], saved["wall_s"])
        return
    logging.getLogger("fedfusion").setLevel(logging.WARNING)
    wall = time.perf_counter()
    base = Settings(dataset="fmnist", model="mlp", model_kwargs='{"hidden_layers": 1}',
                    train_subset=SUBSET, local_epochs=EPOCHS, client_threads=1)
    rows = []
    for exp in experiments(args.parts.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            settings = base.replace(num_clients=exp["n"], seed=seed, **exp["over"])
            name = f"{exp['part']}-{exp['partition'].replace(' ', '')}-n{exp['n']}-s{seed}"
            start = time.perf_counter()
            uploads, train_s = federation(settings, Path(args.out) / name, args.fresh)
            row = {"part": exp["part"], "partition": exp["partition"], "n": exp["n"],
                   "alpha": exp.get("alpha"), "seed": seed, "train_s": train_s,
                   **evaluate_methods(settings, uploads, exp["methods"])}
            row["wall_s"] = time.perf_counter() - start
            rows.append(row)
            print(f"{name}: " + ", ".join(f"{m} {100 * row[m]['accuracy']:.1f}%"
                                         for m in exp["methods"])
                  + f" | train {train_s:.0f} s, total {row['wall_s']:.0f} s", flush=True)
    total = time.perf_counter() - wall
    report(rows, total)
    Path(args.json).write_text(json.dumps({
        "setting": {"dataset": "fmnist", "train_subset": SUBSET, "local_epochs": EPOCHS,
                    "model": "mlp 784-100-10 (bias-free)", "optimizer": "SGD lr 0.01 m 0.9",
                    "batch_size": 64, "pfnm": "sigma^2 = sigma0^2 = gamma0 = 1, 5 iterations",
                    "seeds": args.seeds},
        "wall_s": total, "rows": rows}, indent=1))
    print(f"saved {args.json}")


def report(rows: list[dict[str, Any]], total: float) -> None:
    parts = {r["part"] for r in rows}
    if "t2" in parts:
        print("\nTable 2 (hetero-label, 3..6 labels per client), test accuracy %:\n")
        print(table(rows, "t2", list(METHODS), "PFNM width"))
    if "t3" in parts:
        print("\nTable 3 (Dirichlet alpha = 0.5), test accuracy %:\n")
        print(table(rows, "t3", list(METHODS), "PFNM width"))
    if "sweep" in parts:
        print("\nFigure 3 (N = 5, Dirichlet alpha sweep), test accuracy %:\n")
        print(table(rows, "sweep", list(METHODS), "PFNM width"))
        print(f"saved {plot_sweep(rows, RESULTS / 'ams_sweep.png', total)}")
    if "t4" in parts:
        print("\nTable 4 (cross-architecture: MLPs with 1..5 hidden layers), test accuracy %:\n")
        print(table(rows, "t4", list(CROSS_METHODS), "depths"))
    print(f"\nwall {total:.0f} s for {len(rows)} federations")


if __name__ == "__main__":
    main()
