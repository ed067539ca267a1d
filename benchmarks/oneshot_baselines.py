"""One-shot FedAvg and the uniform ensemble on Fashion-MNIST.

FMNIST, bias-free LeNet, C=5 clients, Dirichlet alpha in {0.05, 0.1, 0.2, 0.4}, 20 local
epochs, seed 0. For each alpha: one live `flwr run` simulation (Ray backend, 5 SuperNodes,
one CPU each) with FedAvg, saving the uploads, then the SAME uploads replayed into the
uniform ensemble. Prints a table and saves benchmarks/results/oneshot_baselines.json.

    .venv/bin/python benchmarks/oneshot_baselines.py [--alphas 0.05,0.1] [--epochs 20]
"""

from __future__ import annotations

import argparse
import json
import time

from common import REPO, live_run

from fedfusion.app.config import Settings  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--alphas", default="0.05,0.1,0.2,0.4")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-oneshot"))
    args = parser.parse_args()
    rows = []
    for alpha in (float(a) for a in args.alphas.split(",")):
        name = f"a{alpha:g}-s{args.seed}"
        start = time.perf_counter()
        live = live_run(f"strategy=fedavg alpha={alpha} seed={args.seed} num-clients=5 "
                        f"local-epochs={args.epochs}", args.out, name)
        wall = time.perf_counter() - start
        ensemble = run_server(Settings(strategy="ensemble", output_dir=args.out,
                                       run_name=f"{name}-ensemble",
                                       replay=f"{args.out}/{name}/uploads"))
        samples = sum(c["num_examples"] for c in live["clients"]) * args.epochs
        rows.append({
            "alpha": alpha, "seed": args.seed, "epochs": args.epochs,
            "fedavg_acc": live["test"]["accuracy"], "fedavg_nll": live["test"]["nll"],
            "ensemble_acc": ensemble["test"]["accuracy"], "ensemble_nll": ensemble["test"]["nll"],
            "client_train_s_sum": live["timing"]["client_train_s_sum"],
            "samples_per_s_per_client": samples / live["timing"]["client_train_s_sum"],
            "samples_per_s_federation": samples / live["timing"]["wall_s"],
            "wall_s_flwr_run": wall, "server_wall_s": live["timing"]["wall_s"],
            "upload_mb_per_client": live["clients"][0]["upload_mb"],
        })
    print("\n| alpha | FedAvg one-shot acc | Ensemble acc | client samples/s (1 thread) "
          "| federation samples/s | `flwr run` wall s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['alpha']:g} | {100 * r['fedavg_acc']:.2f}% | {100 * r['ensemble_acc']:.2f}% "
              f"| {r['samples_per_s_per_client']:.0f} | {r['samples_per_s_federation']:.0f} "
              f"| {r['wall_s_flwr_run']:.0f} |")
    out = REPO / "benchmarks" / "results" / "oneshot_baselines.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
