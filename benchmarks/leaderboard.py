"""Every one-shot method on the same uploads, by inference budget.

Per cell, ONE live federation (in this process: fedfusion's own ClientApp through
``InProcessGrid``): FedBEns with its defaults, M = 5 members per client, Kron curvature plus
the diagonal and RegMean's Grams for the baselines, 20 local epochs, every client keeping
10% of its rows out of local training (``holdout-fraction=0.1``, FENS' proxy set; every
method of the cell is trained on the same 90%). Every method, FedBEns' defaults included (the
live run predates changes of the defaults), is a replay of those uploads
(``fedfusion.app.replay``); FENS' aggregator rounds run with the same clients in
process. Iterative FedAvg with the same total local epochs (20 rounds of 1 epoch, one
member) is the upper reference line.

Cells: ``table1`` (C = 5, the FedBEns authors' splits and validation rows, alpha 0.05 / 0.1
/ 0.2 / 0.4), ``table2`` (alpha 0.3, C = 10 / 20 / 40), ``c100`` (alpha 0.3, C = 100,
Dirichlet split of our own). Resumable: a finished live run or replay is reused.

    .venv/bin/python benchmarks/leaderboard.py table1 --seeds 0,1,2
    .venv/bin/python benchmarks/leaderboard.py table2 --seeds 0
    .venv/bin/python benchmarks/leaderboard.py tables     # the table, the targets, the plot

Rows: ``benchmarks/results/leaderboard.json``, a list of
``{setting, alpha, clients, seed, method, accuracy, nll, ece, forward_passes,
upload_bytes_per_client, download_bytes_per_client, rounds, server_s}``; accuracy in 0..1;
methods as ``strategy=`` spells them, ``ensemble-K`` for the uniform ensemble of K members
(member m of client c in the order m-major, c-minor: member 0 of every client first),
``ensemble-selected-K`` for the K members greedy ensemble selection picks on the server's
validation set (``ensemble-size=K``), ``fedbens-modes`` for FedBEns predicting with its
modes (``fedbens-prediction=modes``), and
``<method>-distilled`` for one network distilled from that method's predictor
(``distill='val'``). Plot: ``leaderboard.png``.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import REPO

from fedfusion.app.config import Settings
from fedfusion.app.inprocess import InProcessGrid
from fedfusion.server_app import run_server

SPLITS = (REPO.parent / "shared" / "data" / "fedbens-authors-splits.npz").resolve()
RESULTS = REPO / "benchmarks" / "results" / "leaderboard.json"
OUT = REPO / "outputs" / "bench-leaderboard"
MEMBERS = 5
EXTRA_SECTIONS = "curvature.diag,gram"
#: the FedBEns paper's Table 1 (FedBEns, FMNIST, C = 5), the one-pass target
PAPER_TABLE1 = {0.05: 59.89, 0.1: 75.91, 0.2: 79.03, 0.4: 84.42}
#: method -> replay run-config changes (the cell's uploads; the live run is "fedbens")
REPLAYS: dict[str, dict[str, Any]] = {
    "fedbens": {"strategy": "fedbens"},
    "fedbens-modes": {"strategy": "fedbens", "fedbens_prediction": "modes"},
    "fedbens-paper": {"strategy": "fedbens", "fedbens_starts": "median", "server_patience": 0,
                      "fedbens_prediction": "modes"},
    "fedavg": {"strategy": "fedavg"},
    "fedfisher": {"strategy": "fedfisher"},
    "regmean": {"strategy": "regmean"},
    "fisher-merge": {"strategy": "fisher-merge"},
    "dense": {"strategy": "dense"},
    "co-boosting": {"strategy": "co-boosting"},
    "ensemble": {"strategy": "ensemble"},
    "ams": {"strategy": "ams"},
    "fens": {"strategy": "fens"},
    "ensemble-distilled": {"strategy": "ensemble", "distill": "val"},
    "fedbens-distilled": {"strategy": "fedbens", "distill": "val"},
    "fens-distilled": {"strategy": "fens", "distill": "val"},
}
#: the budget groups of the table, in its order
BUDGETS = ("upper line", "1 network", f"{MEMBERS} networks (M)", f"{2 * MEMBERS} networks (2M)",
           "every member")
SHORT = {"table1": "T1", "table2": "T2", "c100": "C100"}

def settings_of(setting: str, clients: int, alpha: float, seed: int) -> dict[str, Any]:
    """The live run's data and training settings of a cell."""
    common = {"num_clients": clients, "alpha": alpha, "seed": seed, "num_members": MEMBERS,
              "local_epochs": 20, "holdout_fraction": 0.1, "hessian_structure": "kron",
              "extra_sections": EXTRA_SECTIONS, "server_threads": 1}
    if setting == "c100":
        return {**common, "partitioner": "dirichlet"}
    return {**common, "partition_file": str(SPLITS), "partition_key": f"C{clients}_a{alpha:g}",
            "val_source": "file"}


def run(folder: Path, grid_settings: Settings | None = None, **values: Any) -> dict:
    """A run (live when ``grid_settings`` is given, else a replay), reused when finished."""
    done = folder / "results.json"
    if done.is_file():
        results = json.loads(done.read_text())
        if results.get("status") == "ok":
            return results
    settings = Settings(output_dir=str(folder.parent), run_name=folder.name, **values)
    start = time.perf_counter()
    try:
        results = run_server(settings, InProcessGrid(settings) if grid_settings else None)
    except Exception as exc:  # one failed method never sinks the table
        print(f"{folder.name} failed: {type(exc).__name__}: {exc}", flush=True)
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    print(f"{folder.name}: {100 * results['test']['accuracy']:.2f}% in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return results


def row_of(results: dict, **key: Any) -> dict:
    cost = results.get("cost", {})
    test = results.get("test", {})
    return {**key, "accuracy": test.get("accuracy", math.nan), "nll": test.get("nll", math.nan),
            "ece": test.get("ece", math.nan), "forward_passes": cost.get("forward_passes"),
            "upload_bytes_per_client": cost.get("upload_bytes_per_client"),
            "download_bytes_per_client": cost.get("download_bytes_per_client"),
            "rounds": cost.get("rounds"),
            "server_s": results.get("timing", {}).get("server_fuse_s", math.nan)}


def ensemble_members(clients: int, k: int) -> dict[str, Any]:
    """Replay changes keeping K members: member 0 of every client first, then member 1..."""
    per_client = [k // clients + (c < k % clients) for c in range(clients)]
    kept = [c for c in range(clients) if per_client[c]]
    changes: dict[str, Any] = {"strategy": "ensemble"}
    if len(kept) < clients:
        changes["replay_clients"] = ",".join(map(str, kept))
    if any(n != per_client[0] for n in per_client) or per_client[0] != MEMBERS:
        changes["replay_client_members"] = ",".join(str(max(n, 1)) for n in per_client)
    return changes


def run_cell(setting: str, clients: int, alpha: float, seed: int, only: set[str]) -> list[dict]:
    name = f"{setting}-C{clients}_a{alpha:g}-s{seed}"
    key = {"setting": setting, "alpha": alpha, "clients": clients, "seed": seed}
    values = settings_of(setting, clients, alpha, seed)
    live_settings = Settings(strategy="fedbens", **values)
    live = run(OUT / name, live_settings, strategy="fedbens", **values)
    if live.get("status") != "ok":
        return []
    rows = []
    uploads = str(OUT / name / "uploads")
    sizes = sorted(k for k in {MEMBERS, 2 * MEMBERS} if k < clients * MEMBERS)
    methods = {**REPLAYS, **{f"ensemble-{k}": ensemble_members(clients, k) for k in sizes},
               **{f"ensemble-selected-{k}": {"strategy": "ensemble", "ensemble_size": k}
                  for k in sizes}}
    for method, changes in methods.items():
        if only and method not in only:
            continue
        results = run(OUT / f"{name}-{method}", replay=uploads, server_threads=1, **changes)
        if results.get("status") == "ok":
            rows.append(row_of(results, method=method, **key))
    # the upper reference: iterative FedAvg, 20 rounds x 1 local epoch, one member
    iterative = {**values, "num_members": 1, "local_epochs": 1, "num_rounds": 20,
                 "extra_sections": "", "holdout_fraction": 0.0, "save_uploads": False}
    if not only or "fedavg-iterative" in only:
        results = run(OUT / f"{name}-fedavg-iterative", Settings(**iterative),
                      strategy="fedavg", **iterative)
        if results.get("status") == "ok":
            rows.append(row_of(results, method="fedavg-iterative", **key))
    return rows


def save(rows: list[dict]) -> None:
    key = ("setting", "alpha", "clients", "seed", "method")
    new = {tuple(r[k] for k in key) for r in rows}
    kept = [r for r in load() if tuple(r[k] for k in key) not in new]
    RESULTS.write_text(json.dumps(sorted(kept + rows, key=lambda r: tuple(
        str(r[k]) for k in key)), indent=1) + "\n")


def load() -> list[dict]:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else []


def cell_of(row: dict) -> tuple[str, int, float]:
    return row["setting"], row["clients"], row["alpha"]


def ordered_cells(rows: list[dict]) -> list[tuple[str, int, float]]:
    """The cells of ``rows`` in the table's order: Table 1, Table 2, C100."""
    return sorted({cell_of(r) for r in rows},
                  key=lambda c: (list(SHORT).index(c[0]), c[1], c[2]))


def budget(row: dict) -> str:
    if row["method"] == "fedavg-iterative":
        return BUDGETS[0]
    passes = row["forward_passes"] or 0
    if passes <= 1:
        return BUDGETS[1]
    if passes <= 2 * MEMBERS:
        return BUDGETS[2] if passes <= MEMBERS else BUDGETS[3]
    return BUDGETS[4]


def print_tables(rows: list[dict]) -> None:
    """The markdown table of docs/leaderboard.md: accuracy % mean +- sd over the seeds (NLL)."""
    cells_ = ordered_cells(rows)
    seeds = {c: max(collections.Counter(r["method"] for r in rows if cell_of(r) == c).values())
             for c in cells_}
    head = " | ".join(f"{SHORT[s]} C={c} a={a:g} ({n} seed{'s' * (n > 1)})"
                      for (s, c, a), n in seeds.items())
    print(f"\n| budget | method | {head} |\n|---|---|" + "---|" * len(cells_))
    first = {r["method"]: r for r in reversed(rows)}
    for method in sorted(first, key=lambda m: (BUDGETS.index(budget(first[m])), m)):
        values = []
        for c in cells_:
            mine = [r for r in rows if r["method"] == method and cell_of(r) == c]
            if not mine:
                values.append("not run")
                continue
            accs = [100 * r["accuracy"] for r in mine]
            text = f"{statistics.mean(accs):.2f}"
            text += f" ± {statistics.stdev(accs):.2f}" if len(accs) > 1 else ""
            text += f" [{len(accs)} seed]" if len(accs) < seeds[c] else ""
            values.append(f"{text} ({statistics.mean(r['nll'] for r in mine):.3f})")
        print(f"| {budget(first[method])} | {method} | " + " | ".join(values) + " |")


def print_targets(rows: list[dict]) -> None:
    """Issue 36's targets per cell, as means over the seeds both sides ran."""
    def mean(method: str, cell_: tuple, seeds: set[int] | None = None) -> float | None:
        accs = [100 * r["accuracy"] for r in rows if r["method"] == method
                and cell_of(r) == cell_ and (seeds is None or r["seed"] in seeds)]
        return statistics.mean(accs) if accs else None

    def seeds_of(method: str, cell_: tuple) -> set[int]:
        return {r["seed"] for r in rows if r["method"] == method and cell_of(r) == cell_}

    def line(name: str, ours: str, theirs: str, cell_: tuple, margin: float = 0.0,
             paper: float | None = None) -> None:
        seeds = seeds_of(ours, cell_)
        if paper is None:
            seeds &= seeds_of(theirs, cell_)
        a = mean(ours, cell_, seeds)
        b = paper if paper is not None else mean(theirs, cell_, seeds)
        if a is None or b is None:
            print(f"{name:<34} {SHORT[cell_[0]]} C={cell_[1]} a={cell_[2]:g}: not run")
            return
        verdict = "met" if a >= b - margin else f"MISSED by {b - margin - a:.2f}"
        print(f"{name:<34} {SHORT[cell_[0]]} C={cell_[1]} a={cell_[2]:g}: {ours} {a:.2f} vs "
              f"{theirs} {b:.2f} (seeds {sorted(seeds)}): {verdict}")

    cells_ = ordered_cells(rows)
    print("\ntargets (mean test accuracy % over the seeds both methods ran)")
    for c in cells_:
        line("fens >= ensemble", "fens", "ensemble", c)
        if c[0] == "table1" and c[2] >= 0.2:
            line("fens within 3 of fedavg-iterative", "fens", "fedavg-iterative", c, margin=3)
        if c[0] == "table1":
            best = max((m for m in {r["method"] for r in rows} if budget(
                next(r for r in rows if r["method"] == m)) == BUDGETS[1]),
                key=lambda m: mean(m, c) or -1.0)
            line("one network >= paper's Table 1", best, "paper", c, paper=PAPER_TABLE1[c[2]])
        line(f"fedbens >= ensemble-{2 * MEMBERS}", "fedbens", f"ensemble-{2 * MEMBERS}", c)
        line("co-boosting >= dense", "co-boosting", "dense", c)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells_ = ordered_cells(rows)
    columns = min(4, len(cells_))
    lines = -(-len(cells_) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 4 * lines), squeeze=False)
    for ax in axes.flat[len(cells_):]:
        ax.set_visible(False)
    for ax, c in zip(axes.flat, cells_, strict=False):
        mine = [r for r in rows if cell_of(r) == c]
        for method in sorted({r["method"] for r in mine}):
            accs = [100 * r["accuracy"] for r in mine if r["method"] == method]
            passes = next(r["forward_passes"] for r in mine if r["method"] == method)
            ax.scatter([passes], [statistics.mean(accs)], s=18)
            ax.annotate(method, (passes, statistics.mean(accs)), fontsize=6)
        ax.set_xscale("log")
        ax.set_title(f"{c[0]}: C = {c[1]}, alpha {c[2]:g}", fontsize=9)
        ax.set_xlabel("forward passes per prediction")
        ax.set_ylabel("test accuracy %")
    fig.tight_layout()
    fig.savefig(RESULTS.with_suffix(".png"), dpi=130)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("table1", "table2", "c100", "tables"))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--alphas", default="0.05,0.1,0.2,0.4")
    parser.add_argument("--clients", default="10,20,40", help="table2's cells")
    parser.add_argument("--only", default="", help="methods to run (default: all)")
    args = parser.parse_args(argv)
    only = {m for m in args.only.split(",") if m}
    if args.command != "tables":
        seeds = [int(s) for s in args.seeds.split(",")]
        if args.command == "table1":
            grid = [("table1", 5, float(a)) for a in args.alphas.split(",")]
        elif args.command == "table2":
            grid = [("table2", int(c), 0.3) for c in args.clients.split(",")]
        else:
            grid = [("c100", 100, 0.3)]
        for seed in seeds:
            for setting, clients, alpha in grid:
                save(run_cell(setting, clients, alpha, seed, only))
    rows = load()
    if rows:
        print_tables(rows)
        print_targets(rows)
        plot(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
