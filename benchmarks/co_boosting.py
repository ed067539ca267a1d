"""Co-Boosting against DENSE, FedAvg and the uniform ensemble on the same uploads.

FMNIST, bias-free LeNet, 5 clients, Dirichlet alpha 0.1, 5 local epochs on a 10,000-image
training subset, 500 validation images: one in-process FedAvg run saves the uploads
(reused when present), then the SAME uploads are replayed into ``ensemble``, ``dense`` and
``co-boosting`` (default budget: ``dense-epochs`` = 200) for each seed. One torch thread.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/co_boosting.py [--seeds 0,1]

Prints a table and saves benchmarks/results/co_boosting.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import REPO

from fedfusion.app.config import Settings  # noqa: E402
from fedfusion.app.inprocess import InProcessGrid  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402


def uploads_of(settings: Settings) -> tuple[str, dict]:
    """The live FedAvg run's uploads folder and results (run once, reused after)."""
    done = Path(settings.output_dir) / settings.run_name / "results.json"
    if done.is_file() and json.loads(done.read_text()).get("status") == "ok":
        return str(done.parent / "uploads"), json.loads(done.read_text())
    live = run_server(settings, InProcessGrid(settings))
    return f"{live['output_dir']}/uploads", live


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--strategies", default="ensemble,dense,co-boosting")
    parser.add_argument("--run-config", default="", help="extra keys, e.g. dense-epochs=100")
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-co-boosting"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    extra = {}
    if args.run_config:
        from fedfusion.app.replay import parse_run_config
        extra = {k.replace("-", "_"): v for k, v in parse_run_config(args.run_config).items()}
    live_settings = Settings(strategy="fedavg", num_clients=5, alpha=0.1, local_epochs=5,
                             train_subset=10000, val_size=500, seed=0, save_uploads=True,
                             output_dir=args.out, run_name="live")
    uploads, live = uploads_of(live_settings)
    rows = [{"strategy": "fedavg", "seed": 0, "accuracy": live["test"]["accuracy"],
             "nll": live["test"]["nll"], "fuse_s": live["timing"].get("server_fuse_s")}]
    for seed in (int(s) for s in args.seeds.split(",")):
        for strategy in args.strategies.split(","):
            if strategy == "ensemble" and seed != int(args.seeds.split(",")[0]):
                continue  # deterministic: one seed says it all
            start = time.perf_counter()
            result = run_server(live_settings.replace(
                strategy=strategy, replay=uploads, seed=seed,
                run_name=f"{strategy}-s{seed}{'-' + args.run_config if extra else ''}"
                .replace(" ", "_").replace("=", ""), **extra))
            report = result.get("strategy_report", {})
            rows.append({"strategy": strategy, "seed": seed,
                         "accuracy": result["test"]["accuracy"], "nll": result["test"]["nll"],
                         "best_iteration": report.get("best", {}).get("iteration"),
                         "client_weights": report.get("client_weights"),
                         "wall_s": time.perf_counter() - start, "run_config": args.run_config})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| strategy | seed | test accuracy | NLL | best iteration | wall s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['seed']} | {100 * r['accuracy']:.2f}% | {r['nll']:.3f} "
              f"| {r.get('best_iteration', '')} | {r.get('wall_s') or 0:.0f} |")
    out = REPO / "benchmarks" / "results" / "co_boosting.json"
    previous = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps(previous + rows, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
