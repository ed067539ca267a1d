"""FedBEns and its baselines against the paper, all from ONE client run per
(alpha, seed).

FMNIST, LeNet, C=5, M=5, Kron Laplace (T=0.1, sigma^2=0.1), 20 local epochs. For each
(alpha, seed): one live `flwr run` of FedBEns (with the server validation set) whose clients
also compute the diagonal curvature and RegMean's Gram matrices (``extra-sections``; plus
the diag + full-last-layer curvature at the ``--structure-alphas``), saving the uploads.
Then replays of the SAME uploads:

* FedBEns without validation, FedBEns with M = 1..4 (the first M members of every client),
  FedBEns with diag / diag_full curvature (at the structure alphas);
* the uniform ensemble of all C x M members;
* the paper's one-model-per-client baselines on member 0 of every client: FedAvg,
  FedFisher (K-FAC and diag), RegMean, Fisher merging, OTFusion, DENSE.

A replay that already finished is reused, so the script can be stopped and resumed.
``--stage live`` / ``--stage replay`` split the work over two processes that share the two
cores: the live runs of the next cells train while the replays of the finished ones run
(each process with one torch thread; the replay stage waits for each live run). Prints
the accuracy table (mean +- sd over seeds) and the cost table (paper Table 4: client and
server seconds, upload MB per client, per method), saves benchmarks/results/fedbens.json.

    .venv/bin/python benchmarks/fedbens.py --alphas 0.05,0.1,0.2,0.4 --seeds 0,1,2
    # or pipelined, in two shells (or one with &):
    .venv/bin/python benchmarks/fedbens.py --stage live &
    .venv/bin/python benchmarks/fedbens.py --stage replay
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from common import PAPER_ALGORITHM, REPO, live_run, section_mb, wait_for_live

from fedfusion.app.config import Settings  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "fedbens.json"

#: paper Table 1 (FMNIST, with validation), alpha 0.05 / 0.1 / 0.2 / 0.4
PAPER: dict[str, tuple[float | None, ...]] = {
    "fedbens": (59.89, 75.91, 79.03, 84.42),
    "fedbens_diag_full": (55.58, 70.04, 77.24, 81.81),
    "fedbens_noval": (59.15, None, None, 82.16),  # Table 3: no validation, 100 steps
    "fedfisher_kron": (53.92, 68.06, 72.89, 74.76),
    "regmean": (48.04, 56.40, 71.43, 74.45),
    "dense": (38.48, 47.16, 69.07, 77.91),
    "otfusion": (37.26, 43.54, 57.06, 67.29),
    "fisher_merge": (43.11, 57.38, 66.89, 78.16),
}
PAPER_ALPHAS = (0.05, 0.1, 0.2, 0.4)

#: method -> (run-config changes of the replay, upload sections it needs, members it uses)
BASELINES: dict[str, tuple[dict[str, object], tuple[str, ...], int]] = {
    "ensemble": ({"strategy": "ensemble"}, (), 0),
    "fedavg": ({"strategy": "fedavg"}, (), 1),
    "fedfisher_kron": ({"strategy": "fedfisher", "hessian_structure": "kron"},
                       ("curvature.kron",), 1),
    "fedfisher_diag": ({"strategy": "fedfisher", "hessian_structure": "diag"},
                       ("curvature.diag",), 1),
    "regmean": ({"strategy": "regmean"}, ("gram",), 1),
    "fisher_merge": ({"strategy": "fisher-merge"}, ("curvature.diag",), 1),
    "otfusion": ({"strategy": "otfusion"}, (), 1),
    "dense": ({"strategy": "dense"}, (), 1),
}
LABELS = {
    "fedbens": "FedBEns (Kron, validation)",
    "fedbens_noval": "FedBEns (Kron, no validation, 100 steps)",
    "fedbens_noval300": "FedBEns (Kron, no validation, 300 steps)",
    "fedbens_members": "FedBEns (Kron, validation), a run from every member (C x M modes)",
    "fedbens_clustered": "FedBEns (Kron, validation), 2M runs from the members' K-medoids",
    "fedbens_default": "FedBEns (Kron, validation), the library's defaults",
    "fedbens_paper": "FedBEns (Kron, validation), the paper's algorithm replayed",
    "fedbens_diag": "FedBEns (diag)", "fedbens_diag_full": "FedBEns (diag + full last layer)",
    "ensemble": "uniform ensemble (C x M members)", "fedavg": "FedAvg (member 0)",
    "fedfisher_kron": "FedFisher K-FAC", "fedfisher_diag": "FedFisher diag",
    "regmean": "RegMean", "fisher_merge": "Fisher merging", "otfusion": "OTFusion",
    "dense": "DENSE",
}


def replay(out: str, name: str, tag: str, **changes: object) -> dict:
    """Replay the cached uploads of run ``name`` into a strategy, reusing a finished replay."""
    folder = Path(out) / f"{name}-{tag}"
    done = folder / "results.json"
    if done.is_file():
        results = json.loads(done.read_text())
        if results.get("status") == "ok":
            return results
    # FedBEns replays are the paper's algorithm (its medians, every step) unless they ask
    # otherwise
    changes = {"fedbens_starts": "median", "server_patience": 0, **changes}
    try:
        return run_server(Settings(output_dir=out, run_name=f"{name}-{tag}",
                                   replay=f"{out}/{name}/uploads", server_threads=1, **changes))
    except Exception as exc:  # a failed replay is recorded, never fatal to the table
        print(f"replay {name}-{tag} failed: {type(exc).__name__}: {exc}")
        return {"status": "failed", "error": str(exc)}


def summary(results: dict) -> dict:
    if results.get("status") != "ok":
        return {"accuracy": math.nan, "nll": math.nan, "server_s": math.nan,
                "error": results.get("error")}
    return {"accuracy": results["test"]["accuracy"], "nll": results["test"]["nll"],
            "server_s": results["timing"]["server_fuse_s"]}


def staged_live(stage: str, out: str, name: str, run_config: str) -> dict | None:
    """The live run ``name``: launched (stages all / live) or awaited (replay); None when
    there is nothing to replay (the live stage, or a failed run)."""
    live = wait_for_live(out, name) if stage == "replay" else live_run(run_config, out, name)
    if stage == "live":
        return None
    if live.get("status") != "ok":
        print(f"live run {name} failed ({live.get('error')}): no row")
        return None
    return live


def live_timing(live: dict) -> dict[str, float]:
    """Wall seconds of the live run: whole, client phase (send -> every upload), server."""
    timing = live["timing"]
    return {"live_wall_s": timing["wall_s"], "client_train_s_sum": timing["client_train_s_sum"],
            "client_round_s": timing.get("client_round_s", math.nan),
            "server_live_s": timing["server_fuse_s"]}


def run_cell(alpha: float, seed: int, args: argparse.Namespace) -> dict | None:
    """One (alpha, seed): the live run (stages all / live), then its replays (all / replay)."""
    name = f"a{alpha:g}-s{seed}"
    with_structures = f"{alpha:g}" in args.structure_alphas.split(",")
    extra = ["curvature.diag", "gram"] + (["curvature.diag_full"] if with_structures else [])
    start = time.perf_counter()
    # one server thread: the replay stage may hold the other core (see server-threads)
    live = staged_live(args.stage, args.out, name,
                       f"strategy=fedbens alpha={alpha} seed={seed} num-clients=5 "
                       f"num-members={args.members} local-epochs={args.epochs} "
                       f"hessian-structure=kron extra-sections='{','.join(extra)}' "
                       f"server-threads=1 {PAPER_ALGORITHM}")
    if live is None:
        return None
    clients = live["clients"]
    members = sum(c["num_members"] for c in clients)
    row: dict = {
        "alpha": alpha, "seed": seed, **live_timing(live),
        # per member, summed over clients' members then divided: the cost of one member
        "train_s_per_member": live["timing"]["client_train_s_sum"] / members,
        "section_s_per_member": {
            sec: sum(c["section_time_s"].get(sec, 0.0) for c in clients) / members
            for sec in clients[0]["section_time_s"]},
        "section_mb_per_member": section_mb(f"{args.out}/{name}/uploads"),
        "methods": {"fedbens": summary(live)},
    }
    row["fit_over_train"] = (row["section_s_per_member"]["curvature.kron"]
                             / row["train_s_per_member"])
    row["methods"]["fedbens"]["mixture"] = live["strategy_report"].get("mixture", {})
    methods = row["methods"]
    # no validation: the paper's protocol (100 steps, the default) and the full 300 steps
    methods["fedbens_noval"] = summary(replay(args.out, name, "noval100", strategy="fedbens",
                                              server_validation=False))
    methods["fedbens_noval300"] = summary(replay(args.out, name, "noval300",
                                                 strategy="fedbens", server_validation=False,
                                                 server_steps_noval=300))
    for m in range(1, args.members):
        methods[f"fedbens_m{m}"] = summary(replay(args.out, name, f"m{m}", strategy="fedbens",
                                                  replay_members=m))
    # every live run uploads the diagonal (FedFisher diag, Fisher merging need it)
    for structure in ("diag", "diag_full") if with_structures else ("diag",):
        methods[f"fedbens_{structure}"] = summary(replay(
            args.out, name, structure, strategy="fedbens", hessian_structure=structure))
    for method, (changes, _, used) in BASELINES.items():
        if method == "dense":
            changes = {**changes, "dense_epochs": args.dense_epochs}
        methods[method] = summary(replay(args.out, name, method, replay_members=used,
                                         **changes))
    row["bench_wall_s"] = time.perf_counter() - start
    return row


def fmt(values: list[float], paper: float | None = None) -> str:
    """``mean +- sd`` in %, the paper's value in brackets, and ``(higher)`` / ``(lower)`` where
    the paper's value lies more than one of our sd away from our mean."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    ref = f" [{paper}]" if paper is not None else ""
    if len(values) == 1:
        return f"{100 * values[0]:.2f} (1 seed){ref}"
    mean, sd = 100 * statistics.mean(values), 100 * statistics.stdev(values)
    flag = ""
    if paper is not None and abs(mean - paper) > sd:
        flag = " (higher)" if mean > paper else " (lower)"
    return f"{mean:.2f} +- {sd:.2f}{ref}{flag}"


def print_tables(rows: list[dict], members: int) -> None:
    if not rows:
        return
    alphas = sorted({r["alpha"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    print(f"\nTest accuracy (%), FMNIST, LeNet, C=5, mean +- sd over seeds {seeds}; "
          "paper Table 1 in brackets")
    counts = {a: sum(r["alpha"] == a for r in rows) for a in alphas}
    print("| method | " + " | ".join(f"alpha {a:g} ({counts[a]} seeds)" for a in alphas) + " |")
    print("|---|" + "---|" * len(alphas))
    methods = ["fedbens", "fedbens_noval", "fedbens_noval300",
               *[f"fedbens_m{m}" for m in range(1, members)],
               "fedbens_diag", "fedbens_diag_full", *BASELINES]
    for method in methods:
        cells = []
        for alpha in alphas:
            values = [r["methods"][method]["accuracy"] for r in rows
                      if r["alpha"] == alpha and method in r["methods"]]
            paper = PAPER.get(method)
            value = paper[PAPER_ALPHAS.index(alpha)] if paper and alpha in PAPER_ALPHAS else None
            cells.append(fmt(values, value))
        if any(c != "-" for c in cells):
            label = LABELS.get(method, f"FedBEns, M = {method.removeprefix('fedbens_m')}")
            print(f"| {label} | " + " | ".join(cells) + " |")

    print("\nCost per client (paper Table 4 setting), mean over all runs: client seconds = "
          "training + statistics of the members a method uses; server seconds = fusion")
    print("| method | client s | server s | upload MB per client |")
    print("|---|---|---|---|")
    train = statistics.mean(r["train_s_per_member"] for r in rows)
    sec_s = {s: statistics.mean(r["section_s_per_member"].get(s, 0.0) for r in rows)
             for s in rows[0]["section_s_per_member"]}
    sec_mb = {s: statistics.mean(r["section_mb_per_member"].get(s, 0.0) for r in rows)
              for s in rows[0]["section_mb_per_member"]}
    costs = {"fedbens": (("curvature.kron",), members),
             **{m: (secs, used or members) for m, (_, secs, used) in BASELINES.items()}}
    for method, (sections, used) in costs.items():
        client = used * (train + sum(sec_s.get(s, 0.0) for s in sections))
        upload = used * (sec_mb["weights"] + sum(sec_mb.get(s, 0.0) for s in sections))
        server = [r["methods"][method]["server_s"] for r in rows]
        server = [v for v in server if not math.isnan(v)]
        print(f"| {LABELS[method]} | {client:.1f} | "
              f"{statistics.mean(server) if server else math.nan:.1f} | {upload:.2f} |")
    ratios = [100 * r["fit_over_train"] for r in rows]
    print(f"\nKron fit / local training time, per member: {statistics.mean(ratios):.1f}% "
          f"(min {min(ratios):.1f}%, max {max(ratios):.1f}%, {len(ratios)} runs)")
    print("Upload MB per member: " + ", ".join(f"{s} {mb:.3f}" for s, mb in sec_mb.items()))
    print("\nLive FedBEns runs (wall seconds, mean +- sd over the runs): "
          "whole `flwr run`, client phase, server fusion (5 x 300 steps + validation)")
    for key in ("live_wall_s", "client_round_s", "server_live_s"):
        values = [r[key] for r in rows if not math.isnan(r.get(key, math.nan))]
        if values:
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"  {key}: {statistics.mean(values):.1f} +- {sd:.1f} "
                  f"(min {min(values):.1f}, max {max(values):.1f})")


def plot(rows: list[dict], members: int, path: Path) -> None:
    """Left: accuracy against M (paper Figure 2); right: against alpha for the curvature
    structures and the ensemble / FedAvg references, with paper Table 1's FedBEns dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_sd(method: str, alpha: float) -> tuple[float, float]:
        values = [100 * r["methods"][method]["accuracy"] for r in rows
                  if r["alpha"] == alpha and method in r["methods"]
                  and not math.isnan(r["methods"][method]["accuracy"])]
        if not values:
            return math.nan, math.nan
        return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    alphas = sorted({r["alpha"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ms = list(range(1, members + 1))
    for alpha in alphas:
        stats = [mean_sd("fedbens" if m == members else f"fedbens_m{m}", alpha) for m in ms]
        axes[0].errorbar(ms, [v for v, _ in stats], yerr=[e for _, e in stats], marker="o",
                         capsize=3, label=f"alpha {alpha:g}")
    axes[0].set(xlabel="M (members per client)", ylabel="test accuracy (%)",
                title="FedBEns (Kron) against M", xticks=ms)
    axes[0].legend()
    for method in ("fedbens", "fedbens_noval", "fedbens_diag", "fedbens_diag_full", "ensemble",
                   "fedfisher_kron", "fedavg"):
        stats = [mean_sd(method, a) for a in alphas]
        if all(math.isnan(v) for v, _ in stats):
            continue
        axes[1].errorbar(alphas, [v for v, _ in stats], yerr=[e for _, e in stats],
                         marker="o", capsize=3, label=LABELS[method])
    paper = [PAPER["fedbens"][PAPER_ALPHAS.index(a)] for a in alphas if a in PAPER_ALPHAS]
    # (the paper's Table 1 FedBEns, with validation)
    axes[1].plot([a for a in alphas if a in PAPER_ALPHAS], paper, "k--", label="paper FedBEns")
    axes[1].set(xscale="log", xlabel="Dirichlet alpha", ylabel="test accuracy (%)",
                title="FMNIST, LeNet, C=5 (mean +- sd over seeds)")
    axes[1].set_xticks(alphas, [f"{a:g}" for a in alphas])
    axes[1].minorticks_off()
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--alphas", default="0.05,0.1,0.2,0.4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--structure-alphas", default="0.05,0.1,0.2,0.4",
                        help="alphas whose clients also fit diag_full (Kron/diag/diag_full)")
    parser.add_argument("--dense-epochs", type=int, default=200)
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-fedbens"))
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--tables-only", action="store_true",
                        help="print the tables of the saved results and exit")
    parser.add_argument("--stage", choices=("all", "live", "replay"), default="all",
                        help="live: only the live runs; replay: wait for each live run, then "
                             "replay it (run both at once to use both cores)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # replays in this process; the live runs set their own threads
    results = Path(args.results)
    rows = json.loads(results.read_text()) if results.is_file() else []
    rows = [r for r in rows if "methods" in r]  # rows of this script's format
    backfilled = False
    for row in rows:  # rows written before live_timing() existed: read the live run again
        live_file = Path(args.out) / f"a{row['alpha']:g}-s{row['seed']}" / "results.json"
        if "client_round_s" not in row and live_file.is_file():
            row.update(live_timing(json.loads(live_file.read_text())))
            backfilled = True
    if backfilled:
        results.write_text(json.dumps(rows, indent=1))
    if not args.tables_only:
        for seed in (int(s) for s in args.seeds.split(",")):
            for alpha in (float(a) for a in args.alphas.split(",")):
                row = run_cell(alpha, seed, args)
                if row is None:
                    continue
                if results.is_file():  # keep rows another process wrote meanwhile
                    rows = [r for r in json.loads(results.read_text()) if "methods" in r]
                rows = [r for r in rows if (r["alpha"], r["seed"]) != (alpha, seed)] + [row]
                results.write_text(json.dumps(rows, indent=1))
                print_tables(rows, args.members)
    print_tables(rows, args.members)
    if rows:
        plot(rows, args.members, results.with_suffix(".png"))


if __name__ == "__main__":
    main()
