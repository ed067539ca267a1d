"""The server's fusion on the CPU against the GPU, from the same client uploads.

One in-process federation (no Ray: the App's InProcessGrid) trains the clients once and
keeps their uploads (weights, Kron, diag and Gram sections); every strategy then replays them
with ``server-device=cpu`` and ``server-device=cuda``: fuse time, evaluation time and test
accuracy side by side. The server's cost depends on the number and size of the uploads, not
on local epochs, so ``--local-epochs`` may be small to save client time (accuracy is then
lower than in the paper's setting).

    python benchmarks/server_device.py [--local-epochs 2] [--out DIR]

Prints a table and saves ``benchmarks/results/server_device.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedfusion.app.config import Settings  # noqa: E402
from fedfusion.app.inprocess import InProcessGrid  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402

STRATEGIES = ("fedbens", "fedfisher", "regmean", "fisher-merge", "otfusion", "ensemble")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--train-subset", type=int, default=10000,
                        help="client pool size (the fits' cost; 0 = all 59,500 rows)")
    parser.add_argument("--out", default=str(Path.home() / "fedfusion-outputs" / "server_device"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("server_device: no CUDA device here; this benchmark compares CPU and GPU")
        return 2
    common = {"num_clients": 5, "alpha": args.alpha, "num_members": args.members, "seed": 0,
              "local_epochs": args.local_epochs, "train_subset": args.train_subset,
              "output_dir": args.out}
    live = Settings(strategy="fedbens", run_name="live", server_device="cpu",
                    fedbens_starts="median",
                    extra_sections="curvature.diag,gram", **common)
    start = time.perf_counter()
    run_server(live, InProcessGrid(live))
    client_s = time.perf_counter() - start
    uploads = str(Path(args.out) / "live" / "uploads")
    rows = []
    for strategy in STRATEGIES:
        for device in ("cpu", "cuda"):
            settings = Settings(strategy=strategy, replay=uploads, server_device=device,
                                fedbens_starts="median",
                                server_threads=os.cpu_count() or 1,
                                run_name=f"{strategy}-{device}", output_dir=args.out)
            results = run_server(settings)
            rows.append({"strategy": strategy, "device": device,
                         "fuse_s": results["timing"]["server_fuse_s"],
                         "eval_s": results["timing"]["server_eval_s"],
                         "accuracy": results["test"]["accuracy"], "nll": results["test"]["nll"]})
    print(f"\nlive client phase (in-process, sequential): {client_s:.1f} s; "
          f"{torch.cuda.get_device_name()}")
    print(f"{'strategy':<14}{'cpu fuse s':>12}{'gpu fuse s':>12}{'speed-up':>10}"
          f"{'cpu acc %':>11}{'gpu acc %':>11}")
    for strategy in STRATEGIES:
        cpu, gpu = (next(r for r in rows if r["strategy"] == strategy and r["device"] == d)
                    for d in ("cpu", "cuda"))
        print(f"{strategy:<14}{cpu['fuse_s']:>12.2f}{gpu['fuse_s']:>12.2f}"
              f"{cpu['fuse_s'] / gpu['fuse_s']:>9.1f}x{100 * cpu['accuracy']:>11.2f}"
              f"{100 * gpu['accuracy']:>11.2f}")
    out = REPO / "benchmarks" / "results" / "server_device.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                               "cpu_threads": torch.get_num_threads(),
                               "settings": {**common, "output_dir": None},
                               "client_phase_s": client_s, "rows": rows}, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
