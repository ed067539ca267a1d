"""Client cost of the FedBEns curvature (issue 4 target: Kron fit <= 10% of local training).

Trains one bias-free LeNet member exactly as a client does (``fedfusion.training.train_local``:
SGD 0.01 / 0.9, batch 64, 20 epochs) on 12,000 random FMNIST training samples, one thread, then
times the default Kron fit (``asdl_mc``, batch 256) with the batched ASDL convolution factors
(:mod:`fedfusion.curvature.asdl_speedup`) and with ASDL's own functions, alternating, and
keeps the minimum over ``--repeats`` of each (the least disturbed time on a shared machine;
training is timed as the fastest epoch x epochs for the same reason).

    .venv/bin/python benchmarks/fit_ratio.py

Prints a table and writes benchmarks/results/fit_ratio.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import torch
from asdl.operations.conv import Conv2d
from curvature_backends import load_fmnist

from fedfusion.curvature import DEFAULT_BACKEND, asdl_speedup, fit_curvature
from fedfusion.models import build_model
from fedfusion.training import TrainConfig, train_local

RESULTS = Path(__file__).resolve().parent / "results" / "fit_ratio.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=12_000)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    x_all, y_all = load_fmnist("train")
    idx = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(0))[: args.samples]
    x, y = x_all[idx].contiguous(), y_all[idx].contiguous()
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10)
    epoch_s = []
    for epoch in range(args.epochs):  # one epoch per call, to time each
        epoch_s.append(train_local(model, x, y, TrainConfig(epochs=1), seed=epoch).seconds)
    train_s = min(epoch_s) * args.epochs
    print(f"LeNet member, {len(y)} samples, {args.epochs} epochs: {train_s:.1f} s "
          f"(fastest epoch {min(epoch_s):.2f} s, total {sum(epoch_s):.1f} s)", flush=True)

    assert asdl_speedup.install()
    patched = {name: Conv2d.__dict__[name] for name in asdl_speedup.ORIGINAL}
    variants = {"batched conv factors (default)": patched,
                "ASDL's own conv factors": {n: staticmethod(f)
                                            for n, f in asdl_speedup.ORIGINAL.items()}}
    fit_s: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(args.repeats):
        for label, functions in variants.items():
            for name, function in functions.items():
                setattr(Conv2d, name, function)
            start = time.perf_counter()
            fit_curvature(model, x, y, "kron", backend=DEFAULT_BACKEND)
            fit_s[label].append(time.perf_counter() - start)
    for name, function in patched.items():
        setattr(Conv2d, name, function)

    rows = [{"variant": label, "fit_s": min(times), "fit_s_all": times,
             "fit_over_train": min(times) / train_s} for label, times in fit_s.items()]
    print(f"\n| Kron fit ({DEFAULT_BACKEND}, batch 256) | fit s | fit / training |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['fit_s']:.2f} | {100 * r['fit_over_train']:.1f}% |")
    RESULTS.write_text(json.dumps({
        "samples": len(y), "epochs": args.epochs, "train_s": train_s, "epoch_s": epoch_s,
        "rows": rows, "threads": 1, "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
    }, indent=1))
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
