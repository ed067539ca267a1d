"""FedBEns against the paper (issue 4 benchmark), from one live client run per (alpha, seed).

FMNIST, LeNet, C=5, M=5, Kron Laplace (T=0.1, sigma^2=0.1), 20 local epochs. For each
(alpha, seed): one live `flwr run` of FedBEns (with the server validation set) that saves
the uploads; then replays of the SAME uploads: FedBEns without validation, FedBEns with
M = 1..4, and the uniform ensemble and FedAvg baselines. Prints a table, saves
benchmarks/results/fedbens.json.

    .venv/bin/python benchmarks/fedbens.py --alphas 0.1,0.4 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import time

from common import REPO, live_run

from fedfusion.config import Settings  # noqa: E402
from fedfusion.curvature import STRUCTURES  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402

PAPER_TABLE1 = {0.05: 59.89, 0.1: 75.91, 0.2: 79.03, 0.4: 84.42}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--alphas", default="0.05,0.1,0.2,0.4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--structure", default="kron")
    parser.add_argument("--curve-alphas", default="0.1",
                        help="alphas that also get the M = 1..M-1 and structure replays")
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-fedbens"))
    args = parser.parse_args()
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for alpha in (float(a) for a in args.alphas.split(",")):
            name = f"a{alpha:g}-s{seed}"
            extra = ",".join(f"curvature.{s}" for s in STRUCTURES if s != args.structure)
            start = time.perf_counter()
            live = live_run(f"strategy=fedbens alpha={alpha} seed={seed} num-clients=5 "
                            f"num-members={args.members} local-epochs={args.epochs} "
                            f"hessian-structure={args.structure} "
                            f"extra-sections='{extra}'", args.out, name)
            row = {"alpha": alpha, "seed": seed, "structure": args.structure,
                   "wall_s": time.perf_counter() - start,
                   "fedbens_val": live["test"]["accuracy"], "fedbens_val_nll": live["test"]["nll"],
                   "client_train_s_sum": live["timing"]["client_train_s_sum"],
                   "client_fit_s_sum": sum(c["section_time_s"][f"curvature.{args.structure}"]
                                           for c in live["clients"]),
                   "server_fuse_s": live["timing"]["server_fuse_s"],
                   "upload_mb_per_client": live["clients"][0]["upload_mb"]}
            row["fit_over_train"] = row["client_fit_s_sum"] / row["client_train_s_sum"]
            uploads = f"{args.out}/{name}/uploads"

            def replay(tag: str, name: str = name, uploads: str = uploads,
                       **changes: object) -> dict:
                settings = {"hessian_structure": args.structure, **changes}
                try:
                    return run_server(Settings(output_dir=args.out, run_name=f"{name}-{tag}",
                                               replay=uploads, **settings))
                except RuntimeError as exc:  # e.g. no upload carries that section
                    print(f"replay {tag} failed: {exc}")
                    return {"test": {"accuracy": float("nan")}}
            row["fedbens_noval"] = replay("noval", strategy="fedbens",
                                          server_validation=False)["test"]["accuracy"]
            extras = f"{alpha:g}" in args.curve_alphas.split(",")
            row["fedbens_by_m"] = {} if not extras else {
                m: replay(f"m{m}", strategy="fedbens", replay_members=m)["test"]["accuracy"]
                for m in range(1, args.members)}
            row["fedbens_by_m"][args.members] = row["fedbens_val"]
            row["by_structure"] = {} if not extras else {
                s: replay(s, strategy="fedbens", hessian_structure=s)["test"]["accuracy"]
                for s in STRUCTURES if s != args.structure}
            row["by_structure"][args.structure] = row["fedbens_val"]
            row["ensemble"] = replay("ensemble", strategy="ensemble")["test"]["accuracy"]
            row["fedavg"] = replay("fedavg", strategy="fedavg",
                                   replay_members=1)["test"]["accuracy"]
            rows.append(row)
            (REPO / "benchmarks" / "results" / "fedbens.json").write_text(
                json.dumps(rows, indent=1))
    print("\n| alpha | seed | FedBEns (val) | FedBEns (no val) | paper T1 | ensemble | FedAvg "
          "| fit/train | server s | upload MB/client |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['alpha']:g} | {r['seed']} | {100 * r['fedbens_val']:.2f} "
              f"| {100 * r['fedbens_noval']:.2f} | {PAPER_TABLE1.get(r['alpha'], float('nan'))} "
              f"| {100 * r['ensemble']:.2f} | {100 * r['fedavg']:.2f} "
              f"| {100 * r['fit_over_train']:.1f}% | {r['server_fuse_s']:.1f} "
              f"| {r['upload_mb_per_client']:.2f} |")
    print("\nStructure (accuracy %, same members):")
    for r in rows:
        per = " ".join(f"{s}:{100 * v:.2f}" for s, v in sorted(r["by_structure"].items()))
        print(f"  alpha {r['alpha']:g} seed {r['seed']}: {per}")
    print("\nM curve (accuracy %):")
    for r in rows:
        curve = " ".join(f"M={m}:{100 * v:.2f}" for m, v in sorted(r["fedbens_by_m"].items()))
        print(f"  alpha {r['alpha']:g} seed {r['seed']}: {curve}")


if __name__ == "__main__":
    main()
