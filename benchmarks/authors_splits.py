"""FedBEns on the FedBEns authors' own Fashion-MNIST splits, beside the paper.

The clients' rows and the server's 500 validation rows come from
``../shared/data/fedbens-authors-splits.npz`` (``partition-file``, ``val-source='file'``), so
our numbers and the paper's are measured on the same data; ``--seed`` changes only the inits
and batch orders, as in the authors' code. Setting: LeNet, M = 5, 20 local epochs, Kron
Laplace, T = 0.1, sigma^2 = 0.1. Each cell (table, alpha, seed) is ONE live ``flwr run``
whose clients also upload the diagonal and diag + full-last-layer curvature and RegMean's
Gram matrices; everything else is a server-side replay of those uploads:

* ``table1``: C = 5, alpha 0.05 / 0.1 / 0.2 / 0.4. FedBEns Kron (validation), FedBEns
  diag + full last layer, every baseline of the paper on member 0 (FedAvg, FedFisher K-FAC
  and diag, RegMean, Fisher merging, OTFusion, DENSE on ``--dense-seeds`` only: 190 s of
  server each), the uniform ensemble; Table 3 (no validation, 100 steps) from the same
  uploads; Table 7 at alpha 0.05 / 0.4 (all clients M = 1 against 3 clients M = 1 and 2
  clients M = 3, by keeping each client's first members); Figure 5 (prior variance) and the
  temperature sweep on ``--sweep-seeds``. With ``--norm mnist`` a second set of cells is
  trained on inputs normalised with the MNIST constants (0.1307, 0.3081) the authors' code
  uses, FedBEns only (the normalisation ablation).
* ``table2``: alpha 0.3, C = 10, 20, 40; FedBEns Kron and the baselines.
* ``table7``: the paper's system-heterogeneity protocol at alpha 0.05 / 0.4: a live run with
  M = 3 members trained from one init plus N(0, 0.001^2) noise (``init-perturbation``), then
  replays keeping 1 member of clients 0-2 and 3 of clients 3-4, against 1 member everywhere,
  predicting with one model (the members-0 run's mode) as the paper does. (Table 1's cells
  also replay this split from their independently initialised members, ``fedbens_hetero*``:
  there the extra members sit in other basins and carry no mixture weight.)
* ``tables``: print the tables of the saved results and draw the plots.
* ``why``: for every (alpha, seed) trained with both normalisations, what the input scale
  changes in the uploads: each member's own test accuracy, its weight norms, and per layer
  the share of posterior-precision directions where the likelihood H / T outweighs the fixed
  prior precision 1 / sigma^2 (``benchmarks/results/authors_splits_why.json``).

Resumable: a finished live run or replay is reused. ``--stage live`` and ``--stage replay``
split the work over two processes that share the two cores (run both; the replay stage
waits for each live run). Results: ``benchmarks/results/authors_splits.json`` (one row per
cell), plots ``authors_splits.png`` and ``authors_splits_sweeps.png``.

    .venv/bin/python benchmarks/authors_splits.py table1 --seeds 0,1,2,3,4 --stage live &
    .venv/bin/python benchmarks/authors_splits.py table1 --seeds 0,1,2,3,4 --stage replay
    .venv/bin/python benchmarks/authors_splits.py table2 --seeds 0,1,2
    .venv/bin/python benchmarks/authors_splits.py tables
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from common import PAPER_ALGORITHM, REPO, cell, kron_fit_s
from fedbens import (
    BASELINES,
    LABELS,
    PAPER,
    PAPER_ALPHAS,
    live_timing,
    replay,
    staged_live,
    summary,
)

from fedfusion.app.config import Settings

SPLITS = (REPO.parent / "shared" / "data" / "fedbens-authors-splits.npz").resolve()
RESULTS = REPO / "benchmarks" / "results" / "authors_splits.json"
OUT = REPO / "outputs" / "bench-authors-splits"
EXTRA_SECTIONS = "curvature.diag,curvature.diag_full,gram"
#: the authors' input normalisation (MNIST's statistics), against FMNIST's own
NORMS = {"dataset": "", "mnist": "input-mean='0.1307' input-std='0.3081'"}
PRIOR_VARS = (0.01, 0.03, 0.1, 0.3, 1.0)
TEMPERATURES = (0.03, 0.1, 0.3, 1.0)
LIVE_PRIOR_VAR, LIVE_TEMPERATURE = 0.1, 0.1
#: paper Table 2 (FMNIST, alpha 0.3): FedBEns Kron by number of clients
PAPER_TABLE2 = {10: 80.57, 20: 80.83, 40: 77.27}
#: paper Table 7 (FMNIST): all clients M = 1, and 3 clients M = 1 + 2 clients M = 3
PAPER_TABLE7 = {0.05: (57.02, 59.57), 0.4: (77.07, 78.31)}
HETERO_MEMBERS = "1,1,1,3,3"


def cell_name(clients: int, alpha: float, seed: int, norm: str, table: str = "table1") -> str:
    return (f"C{clients}_a{alpha:g}-s{seed}" + ("" if norm == "dataset" else f"-{norm}")
            + ("-t7" if table == "table7" else ""))


def run_cell(table: str, clients: int, alpha: float, seed: int, norm: str,
             args: argparse.Namespace) -> dict | None:
    """One cell: the live run (stages all / live), then its replays (all / replay)."""
    name = cell_name(clients, alpha, seed, norm, table)
    # the normalisation ablation and Table 7 train FedBEns' own sections only
    full = norm == "dataset" and table != "table7"
    out = str(args.out)
    start = time.perf_counter()
    members = "num-members=3 init-perturbation=0.001" if table == "table7" else "num-members=5"
    extra = f"extra-sections='{EXTRA_SECTIONS}'" if full else ""
    live = staged_live(
        args.stage, out, name,
        f"strategy=fedbens alpha={alpha} seed={seed} num-clients={clients} "
        f"local-epochs={args.epochs} hessian-structure=kron server-threads=1 "
        f"{members} {extra} "
        f"partition-file='{SPLITS}' partition-key='C{clients}_a{alpha:g}' "
        f"val-source='file' {NORMS[norm]} {PAPER_ALGORITHM}")
    if live is None:
        return None
    clients_table = live["clients"]
    members = sum(c["num_members"] for c in clients_table)
    kron_s = kron_fit_s(clients_table)
    row: dict = {
        "table": table, "clients": clients, "alpha": alpha, "seed": seed, "norm": norm,
        "partition_sha256": live["settings"]["partition-sha256"],
        **live_timing(live),
        "train_s_per_member": live["timing"]["client_train_s_sum"] / members,
        "fit_over_train": kron_s / live["timing"]["client_train_s_sum"],
        "methods": {"fedbens": summary(live)},
    }
    methods = row["methods"]

    def add(method: str, tag: str, **changes: object) -> None:
        if not args.only or method in args.only:
            methods[method] = summary(replay(out, name, tag, **changes))

    if table == "table7":
        add("fedbens_m1", "m1", strategy="fedbens", replay_members=1)
        add("fedbens_hetero", "hetero1", strategy="fedbens", fedbens_modes=1,
            replay_client_members=HETERO_MEMBERS)
        row["bench_wall_s"] = time.perf_counter() - start
        return row
    add("fedbens_noval", "noval100", strategy="fedbens", server_validation=False)
    if table == "table1":
        # beyond the paper: a run from every uploaded member (C x M modes) instead of M
        # medians; Table 1 only, since its cost grows with (C x M)^2
        add("fedbens_members", "starts_members", strategy="fedbens", fedbens_starts="members")
    if table in ("table1", "table2"):
        # the paper's algorithm replayed: the comparisons below need it whatever server
        # settings the live run fused with
        add("fedbens_paper", "paper", strategy="fedbens")
        # 2M runs from the members' K-medoids: the member starts at twice the paper's runs
        add("fedbens_clustered", "starts_clustered", strategy="fedbens",
            fedbens_starts="clustered")
        # the library's defaults: their starts and early stop, nothing pinned
        add("fedbens_default", "starts_default", strategy="fedbens",
            fedbens_starts=Settings.fedbens_starts, server_patience=Settings.server_patience)
    if full:
        add("fedbens_diag_full", "diag_full", strategy="fedbens", hessian_structure="diag_full")
        for method, (changes, _, used) in BASELINES.items():
            if method == "dense" and seed not in args.dense_seeds:
                continue
            add(method, method, replay_members=used, **changes)
    if table == "table1" and alpha in PAPER_TABLE7 and full:
        # the paper returns one model in both settings: the mode of the members-0 run
        add("fedbens_m1", "m1", strategy="fedbens", replay_members=1)
        add("fedbens_hetero", "hetero1", strategy="fedbens", fedbens_modes=1,
            replay_client_members=HETERO_MEMBERS)
        add("fedbens_hetero_ensemble", "hetero", strategy="fedbens",
            replay_client_members=HETERO_MEMBERS)
    if table == "table1" and seed in args.sweep_seeds and full:
        for prior_var in PRIOR_VARS:
            if prior_var != LIVE_PRIOR_VAR:
                add(f"fedbens_prior{prior_var:g}", f"prior{prior_var:g}", strategy="fedbens",
                    prior_var=prior_var)
        for temperature in TEMPERATURES:
            if temperature != LIVE_TEMPERATURE:
                add(f"fedbens_T{temperature:g}", f"T{temperature:g}", strategy="fedbens",
                    temperature=temperature)
    row["bench_wall_s"] = time.perf_counter() - start
    return row


def cells(args: argparse.Namespace) -> list[tuple[str, int, float, int, str]]:
    """(table, clients, alpha, seed, norm) in run order: seed-major, so that a partial
    campaign covers every alpha."""
    found = []
    for seed in args.seeds:
        if args.command == "table1":
            for alpha in args.alphas:
                for norm in args.norms:
                    found.append(("table1", 5, alpha, seed, norm))
        elif args.command == "table7":
            for alpha in PAPER_TABLE7:
                found.append(("table7", 5, alpha, seed, "dataset"))
        else:
            for clients in (10, 20, 40):
                found.append(("table2", clients, 0.3, seed, "dataset"))
    return found


def load_rows(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.is_file() else []


def save_row(path: Path, row: dict) -> list[dict]:
    """Merge ``row`` into the results file (rows another process wrote meanwhile stay)."""
    key = ("table", "clients", "alpha", "seed", "norm")
    rows = [r for r in load_rows(path) if tuple(r[k] for k in key) != tuple(row[k] for k in key)]
    rows.append(row)
    rows.sort(key=lambda r: tuple(str(r[k]) for k in key))
    path.write_text(json.dumps(rows, indent=1))
    return rows


def stats(rows: list[dict], method: str, **where: object) -> list[float]:
    return [100 * r["methods"][method]["accuracy"] for r in rows
            if all(r[k] == v for k, v in where.items()) and method in r["methods"]
            and not math.isnan(r["methods"][method]["accuracy"])]


def print_tables(rows: list[dict]) -> None:
    t1 = [r for r in rows if r["table"] == "table1"]
    alphas = sorted({r["alpha"] for r in t1})
    if t1:
        print("\nTable 1 (+ Table 3): FMNIST, LeNet, C = 5, the authors' splits and validation "
              "rows; test accuracy %, mean +- sd (seeds) [paper] difference")
        print("| method | " + " | ".join(f"alpha {a:g}" for a in alphas) + " |")
        print("|---|" + "---|" * len(alphas))
        methods = ["fedbens", "fedbens_noval", "fedbens_members", "fedbens_clustered",
                   "fedbens_diag_full", *BASELINES]
        for norm in ("dataset", "mnist"):
            for method in methods if norm == "dataset" else methods[:4]:
                paper = PAPER.get(method)
                cells_ = [cell(stats(t1, method, alpha=a, norm=norm),
                               paper[PAPER_ALPHAS.index(a)] if paper else None) for a in alphas]
                if all(c == "-" for c in cells_):
                    continue
                label = LABELS[method] + ("" if norm == "dataset" else
                                          ", MNIST input normalisation")
                print(f"| {label} | " + " | ".join(cells_) + " |")
        print("\nTable 7 from Table 1's uploads (independent inits): clients 3 and 4 "
              "have M = 3; one model (the members-0 run's mode) as in the paper, and the "
              "ensemble of the 3 runs' modes")
        print("| alpha | all clients M = 1 | 3 clients M = 1, 2 clients M = 3 | same, "
              "ensemble of 3 modes |")
        print("|---|---|---|---|")
        for alpha, (paper_m1, paper_hetero) in PAPER_TABLE7.items():
            m1 = cell(stats(t1, "fedbens_m1", alpha=alpha, norm="dataset"), paper_m1)
            hetero = cell(stats(t1, "fedbens_hetero", alpha=alpha, norm="dataset"), paper_hetero)
            ensemble = cell(stats(t1, "fedbens_hetero_ensemble", alpha=alpha, norm="dataset"))
            print(f"| {alpha:g} | {m1} | {hetero} | {ensemble} |")
        print("\nFigure 5 / temperature sweep (FedBEns Kron, validation), replayed server-side")
        for label, values, live, prefix in (("prior variance", PRIOR_VARS, LIVE_PRIOR_VAR,
                                             "prior"), ("temperature", TEMPERATURES,
                                                        LIVE_TEMPERATURE, "T")):
            print(f"| {label} | " + " | ".join(f"alpha {a:g}" for a in alphas) + " |")
            print("|---|" + "---|" * len(alphas))
            for value in values:
                method = "fedbens" if value == live else f"fedbens_{prefix}{value:g}"
                swept = [r for r in t1 if f"fedbens_{prefix}{values[0]:g}" in r["methods"]]
                print(f"| {value:g} | " + " | ".join(
                    cell(stats(swept, method, alpha=a, norm="dataset")) for a in alphas) + " |")
        print_against_paper(t1, alphas)
    print_table7([r for r in rows if r["table"] == "table7"])
    t2 = [r for r in rows if r["table"] == "table2"]
    if t2:
        print("\nTable 2: alpha 0.3, the authors' splits; test accuracy %")
        counts = sorted({r["clients"] for r in t2})
        print("| method | " + " | ".join(f"C = {c}" for c in counts) + " |")
        print("|---|" + "---|" * len(counts))
        for method in ["fedbens", "fedbens_noval", "fedbens_clustered", "fedbens_diag_full",
                       *BASELINES]:
            cells_ = [cell(stats(t2, method, clients=c),
                           PAPER_TABLE2.get(c) if method == "fedbens" else None) for c in counts]
            if any(c != "-" for c in cells_):
                print(f"| {LABELS[method]} | " + " | ".join(cells_) + " |")
    if rows:
        fit = [100 * r["fit_over_train"] for r in rows]
        print(f"\nKron fit / local training: max {max(fit):.1f}% over {len(fit)} live runs; "
              f"live run wall: mean {statistics.mean(r['live_wall_s'] for r in rows):.0f} s")


def print_against_paper(t1: list[dict], alphas: list[float]) -> None:
    """FedBEns (the paper's algorithm, and with member starts) against the paper, per alpha
    and on the four-alpha average; then the member starts cell by cell (same uploads)."""
    print("\nFedBEns against the paper (FMNIST normalisation): mean over seeds, difference")
    for method in ("fedbens", "fedbens_members"):
        diffs = [statistics.mean(v) - PAPER["fedbens"][PAPER_ALPHAS.index(a)]
                 for a in alphas if (v := stats(t1, method, alpha=a, norm="dataset"))]
        print(f"  {LABELS[method]}: " + ", ".join(f"{d:+.2f}" for d in diffs)
              + (f"; average {statistics.mean(diffs):+.2f}" if diffs else ""))
    gains = [100 * (r["methods"]["fedbens_members"]["accuracy"]
                    - r["methods"]["fedbens"]["accuracy"])
             for r in t1 if "fedbens_members" in r["methods"]]
    if gains:
        print(f"  member starts against the medians, per cell (both normalisations): better in "
              f"{sum(g > 0 for g in gains)} of {len(gains)}, {min(gains):+.2f} to "
              f"{max(gains):+.2f}, mean {statistics.mean(gains):+.2f} points")
    for other in ("fedbens", "fedbens_members"):
        diffs = [100 * (r["methods"]["fedbens_clustered"]["accuracy"]
                        - r["methods"][other]["accuracy"])
                 for r in t1 if "fedbens_clustered" in r["methods"] and other in r["methods"]]
        if diffs:
            print(f"  clustered starts (2M runs) against {LABELS[other]}, per cell: better in "
                  f"{sum(d > 0 for d in diffs)} of {len(diffs)}, {min(diffs):+.2f} to "
                  f"{max(diffs):+.2f}, mean {statistics.mean(diffs):+.2f} points")


def print_table7(t7: list[dict]) -> None:
    if not t7:
        return
    print("\nTable 7 (the paper's protocol): clients 3-4 train M = 3 members from one init "
          "(+ N(0, 0.001^2)), clients 0-2 keep member 0; one model (the members-0 run's mode)")
    print("| alpha | all clients M = 1 | 3 clients M = 1, 2 clients M = 3 |")
    print("|---|---|---|")
    for alpha, (paper_m1, paper_hetero) in PAPER_TABLE7.items():
        print(f"| {alpha:g} | {cell(stats(t7, 'fedbens_m1', alpha=alpha), paper_m1)} | "
              f"{cell(stats(t7, 'fedbens_hetero', alpha=alpha), paper_hetero)} |")


def plot(rows: list[dict], path: Path) -> None:
    """Left: Table 1 against alpha, ours (solid) and the paper (dashed); right: the sweeps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t1 = [r for r in rows if r["table"] == "table1"]
    alphas = sorted({r["alpha"] for r in t1})
    if not alphas:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, method in enumerate(("fedbens", "fedbens_diag_full", "fedfisher_kron", "regmean",
                                "fedavg", "ensemble")):
        color = f"C{i}"
        means = [statistics.mean(v) if (v := stats(t1, method, alpha=a, norm="dataset"))
                 else math.nan for a in alphas]
        axes[0].plot(alphas, means, "o-", color=color, label=LABELS[method])
        if method in PAPER:
            axes[0].plot(PAPER_ALPHAS, PAPER[method], "--", color=color)
    means = [statistics.mean(v) if (v := stats(t1, "fedbens", alpha=a, norm="mnist"))
             else math.nan for a in alphas]
    axes[0].plot(alphas, means, "s:", color="k", label="FedBEns, MNIST normalisation")
    axes[0].set(xscale="log", xlabel="Dirichlet alpha", ylabel="test accuracy (%)",
                title="Authors' splits: ours (solid) vs paper (dashed)")
    axes[0].set_xticks(PAPER_ALPHAS, [f"{a:g}" for a in PAPER_ALPHAS])
    axes[0].minorticks_off()
    axes[0].legend(fontsize=7)
    for ax, values, live, prefix, label in (
            (axes[1], PRIOR_VARS, LIVE_PRIOR_VAR, "prior", "prior variance sigma^2"),
            (axes[2], TEMPERATURES, LIVE_TEMPERATURE, "T", "temperature T")):
        swept = [r for r in t1 if f"fedbens_{prefix}{values[0]:g}" in r["methods"]]
        for alpha in alphas:
            means = [statistics.mean(v) if (v := stats(
                swept, "fedbens" if x == live else f"fedbens_{prefix}{x:g}", alpha=alpha,
                norm="dataset")) else math.nan for x in values]
            ax.plot(values, means, "o-", label=f"alpha {alpha:g}")
        ax.set(xscale="log", xlabel=label, ylabel="test accuracy (%)",
               title=f"FedBEns Kron against {label} (replayed)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def why(args: argparse.Namespace) -> None:
    """Per (alpha, seed) with both normalisations: what the input scale changes upstream of
    the server (the members and their Laplace curvature), printed and saved."""
    from fedfusion.app.federation import federated_split
    from fedfusion.core.architecture import ModelSpec
    from fedfusion.core.evaluation import evaluate
    from fedfusion.curvature import curvature_from_arrays
    from fedfusion.upload_store import load_uploads
    from fedfusion.wire import WEIGHTS

    table = []
    for alpha in args.alphas:
        for seed in args.seeds:
            folders = {norm: args.out / cell_name(5, alpha, seed, norm) / "uploads"
                       for norm in NORMS}
            if not all((f / "manifest.json").is_file() for f in folders.values()):
                continue
            for norm, folder in folders.items():
                run_config, uploads, _ = load_uploads(folder, strict=True)
                settings = Settings.from_mapping(run_config)
                test = federated_split(settings).bundle.test
                spec = ModelSpec("lenet", (1, 28, 28), 10)
                shapes = dict(spec.param_shapes())
                accuracy, weight_rms, dominated = [], {}, {}
                for upload in uploads:
                    for member in upload.members:
                        model = spec.build(member[WEIGHTS])
                        accuracy.append(100 * evaluate(model, test.x, test.y, "cpu")["accuracy"])
                        curvature = curvature_from_arrays(
                            "kron", member["curvature.kron"], shapes, LIVE_TEMPERATURE,
                            LIVE_PRIOR_VAR)
                        for name, factors in curvature.factors.items():
                            likelihood = factors.likelihood_eigvals(LIVE_TEMPERATURE)
                            dominated.setdefault(name, []).append(
                                float((likelihood > 1 / LIVE_PRIOR_VAR).float().mean()))
                            weight_rms.setdefault(name, []).append(
                                float(np.sqrt(np.mean(member[WEIGHTS][name] ** 2))))
                row = {"alpha": alpha, "seed": seed, "norm": norm,
                       "member_accuracy_mean": statistics.mean(accuracy),
                       "member_accuracy_min": min(accuracy), "member_accuracy_max": max(accuracy),
                       "likelihood_dominated_share": {k: statistics.mean(v)
                                                      for k, v in dominated.items()},
                       "weight_rms": {k: statistics.mean(v) for k, v in weight_rms.items()}}
                table.append(row)
                print(f"alpha {alpha:g} seed {seed} {norm:>7}: members "
                      f"{row['member_accuracy_mean']:.2f}% ({row['member_accuracy_min']:.1f}-"
                      f"{row['member_accuracy_max']:.1f}); "
                      "H/T > 1/sigma^2 share: " + ", ".join(
                          f"{k.removesuffix('.weight')} {100 * v:.1f}%"
                          for k, v in row["likelihood_dominated_share"].items()), flush=True)
    out = args.results.with_name("authors_splits_why.json")
    out.write_text(json.dumps(table, indent=1))
    print(f"saved {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("table1", "table2", "table7", "tables", "why"))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--alphas", default="0.05,0.1,0.2,0.4")
    parser.add_argument("--norms", default="dataset,mnist",
                        help="input normalisations of table1's cells (dataset, mnist)")
    parser.add_argument("--dense-seeds", default="0", help="seeds whose cells replay DENSE")
    parser.add_argument("--sweep-seeds", default="0,1,2",
                        help="seeds whose cells replay the prior / temperature sweeps")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--stage", choices=("all", "live", "replay"), default="all")
    parser.add_argument("--only", default="",
                        help="replay only these methods (comma-separated, e.g. "
                             "fedbens_clustered,fedbens_members); default every one")
    args = parser.parse_args()
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    args.seeds, args.dense_seeds, args.sweep_seeds = (
        ints(args.seeds), ints(args.dense_seeds), ints(args.sweep_seeds))
    args.alphas = [float(a) for a in args.alphas.split(",")]
    args.norms = [n for n in args.norms.split(",") if n]
    args.only = {m for m in args.only.split(",") if m}
    for norm in args.norms:
        if norm not in NORMS:
            parser.error(f"unknown --norms entry {norm!r}; choose from {', '.join(NORMS)}")
    if not SPLITS.is_file():
        parser.error(f"{SPLITS} is missing (the authors' splits, see shared/data/README.md)")
    torch.set_num_threads(1)  # replays in this process; the live runs set their own threads
    if args.command == "why":
        why(args)
        return
    if args.command != "tables":
        for table, clients, alpha, seed, norm in cells(args):
            row = run_cell(table, clients, alpha, seed, norm, args)
            if row is not None:
                print_tables(save_row(args.results, row))
    rows = load_rows(args.results)
    print_tables(rows)
    if rows and args.stage != "live":
        plot(rows, args.results.with_suffix(".png"))


if __name__ == "__main__":
    main()
