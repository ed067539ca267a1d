"""Client cost of the FedBEns curvature (the target: Kron fit <= 10% of local training).

Trains M = 5 bias-free LeNet members exactly as a client does (``fedfusion.training.
train_members``, the stacked trainer: SGD 0.01 / 0.9, batch 64, 20 epochs) on 12,000 random
FMNIST training samples, one thread; a member's training time is the stacked time / M. Then
times the default Kron fit (``asdl_mc``, batch 256) of one member three ways, alternating:
on the stacked trainer's layers (:mod:`fedfusion.accel.fast_kron`, the default), through
laplace-torch with the batched ASDL convolution factors
(:mod:`fedfusion.accel.asdl_speedup`) and with ASDL's own functions; keeps the minimum
over ``--repeats`` of each (the least disturbed time on a shared machine; training is timed
as the fastest epoch x epochs for the same reason). All three give the same factors.

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
from curvature_backends import load_fmnist

from fedfusion.accel import fast_kron
from fedfusion.curvature import DEFAULT_BACKEND, fit_curvature
from fedfusion.models import build_model
from fedfusion.training import TrainConfig, train_members

RESULTS = Path(__file__).resolve().parent / "results" / "fit_ratio.json"
MEMBERS = 5


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
    members = []
    for m in range(MEMBERS):
        torch.manual_seed(m)
        members.append(build_model("lenet", (1, 28, 28), 10))
    epoch_s = []
    for epoch in range(args.epochs):  # one epoch per call, to time each
        stats = train_members(members, x, y, TrainConfig(epochs=1), list(range(epoch, epoch + 5)),
                              accelerate=True)
        epoch_s.append(sum(s.seconds for s in stats) / MEMBERS)  # per member
    train_s = min(epoch_s) * args.epochs
    print(f"LeNet member ({MEMBERS} stacked), {len(y)} samples, {args.epochs} epochs: "
          f"{train_s:.1f} s per member (fastest epoch {min(epoch_s):.2f} s, total "
          f"{sum(epoch_s):.1f} s)", flush=True)
    model = members[0]

    stacked_fit = fast_kron.kron_mc_factors
    variants = {  # (the compiled fit or None, accelerate)
        "stacked-layer fit (accelerate=True, the App's default)": (stacked_fit, True),
        "laplace-torch, batched conv factors": (None, True),
        "laplace-torch, ASDL's own conv factors (library default)": (None, False),
    }
    fit_s: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(args.repeats):
        for label, (fast, accelerate) in variants.items():
            fast_kron.kron_mc_factors = fast or (lambda *_args: None)
            start = time.perf_counter()
            fit_curvature(model, x, y, "kron", backend=DEFAULT_BACKEND, accelerate=accelerate)
            fit_s[label].append(time.perf_counter() - start)
    fast_kron.kron_mc_factors = stacked_fit

    rows = [{"variant": label, "fit_s": min(times), "fit_s_all": times,
             "fit_over_train": min(times) / train_s} for label, times in fit_s.items()]
    print(f"\n| Kron fit ({DEFAULT_BACKEND}, batch 256) | fit s | fit / training |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['fit_s']:.2f} | {100 * r['fit_over_train']:.1f}% |")
    RESULTS.write_text(json.dumps({
        "samples": len(y), "epochs": args.epochs, "members_stacked": MEMBERS,
        "train_s_per_member": train_s, "epoch_s_per_member": epoch_s,
        "rows": rows, "threads": 1, "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
    }, indent=1))
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
