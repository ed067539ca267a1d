"""Local training throughput per core: today's loop against the stacked trainer.

For each model of the zoo measured (bias-free LeNet and MLP on 1x28x28 Fashion-MNIST rows,
the CNN on the same rows padded and replicated to 3x32x32), SGD lr 0.01 / momentum 0.9,
batch 64, one thread, M = 5 members of one client (distinct inits and seeds), one epoch of
``--samples`` rows per member:

* ``today``: ``train_local`` member after member (the ClientApp's loop before the stacked trainer);
* ``stacked, torch ops``: ``train_members`` with the compiled kernels off
  (``FEDFUSION_NO_KERNELS``): stacked parameters, hand-written backward, PyTorch ops only;
* ``stacked``: ``train_members`` as the ClientApp runs it (compiled kernels where they help);
* ``stacked, M=1``: ``train_members`` on one member, to separate what the better kernels buy
  from what stacking the members buys.

The variants run interleaved, round after round (``--rounds``), and every timing keeps the
load average beside it: the machine is shared, so the ratio to ``today`` is taken within each
round and the median over rounds is reported. Throughput is member-samples per second of the
process's CPU time (``time.thread_time``, one thread: samples/s per core, robust to other
processes on the core) and, beside it, per second of wall time.

The arithmetic floor: the model's forward + backward FLOPs per sample (PyTorch's
``FlopCounterMode`` over one training step of the reference loop: the convolutions' and
matmuls' FLOPs, no elementwise ops) divided into the FLOP/s one core reaches here on a large
float32 GEMM (``--gemm`` x ``--gemm`` matmul, best of 5, measured by this script). ``% floor`` is
the throughput as a share of that bound.

``--compile`` also times ``torch.compile`` (inductor, CPU) of today's LeNet step: compile
seconds and the step's throughput once compiled (measured on this machine: slower than eager).

    .venv/bin/python benchmarks/throughput.py            # ~3 minutes on 2 quiet cores

Prints a table and writes benchmarks/results/throughput.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from common import REPO
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from fedfusion.accel import kernels
from fedfusion.models import build_model
from fedfusion.training import TrainConfig, train_local, train_members

RESULTS = REPO / "benchmarks" / "results" / "throughput.json"
FMNIST = Path("/usr/share/datasets/fashion-mnist")
#: (model, input shape, rows per member per round at the default --samples scale)
MODELS = {"lenet": ((1, 28, 28), 1.0), "mlp": ((1, 28, 28), 2.0), "cnn": ((3, 32, 32), 0.125)}
MEMBERS = 5
CONFIG = TrainConfig(epochs=1, lr=0.01, momentum=0.9, batch_size=64)


def load_rows(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` Fashion-MNIST training rows, normalised, and their labels."""
    with gzip.open(FMNIST / "train-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16)[: count * 784]
    with gzip.open(FMNIST / "train-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)[:count]
    x = torch.from_numpy(images.astype(np.float32)).view(-1, 1, 28, 28).div(255)
    return (x - 0.2860) / 0.3530, torch.from_numpy(labels.astype(np.int64))


def model_inputs(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    if shape[0] == 1:
        return x
    return F.pad(x, (2, 2, 2, 2), value=float(x.min())).repeat(1, shape[0], 1, 1).contiguous()


def gemm_flops_per_s(size: int) -> float:
    """Best FLOP/s of a ``size`` x ``size`` float32 matmul on this thread (CPU time)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        a @ b
        best = min(best, time.thread_time() - start)
    return 2 * size**3 / best


def step_flops_per_sample(name: str, shape: tuple[int, int, int], x: torch.Tensor,
                          y: torch.Tensor) -> float:
    """Forward + backward FLOPs of one SGD step of the reference loop, per sample."""
    model = build_model(name, shape, 10)
    batch = CONFIG.batch_size
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x[:batch]), y[:batch]).backward()
    return counter.get_total_flops() / batch


def members(name: str, shape: tuple[int, int, int], count: int) -> list[torch.nn.Module]:
    out = []
    for m in range(count):
        torch.manual_seed(1000 + m)
        out.append(build_model(name, shape, 10))
    return out


def run_variant(variant: str, name: str, shape: tuple[int, int, int], x: torch.Tensor,
                y: torch.Tensor) -> dict[str, float]:
    """Train the variant's members once; member-samples per CPU second and per wall second."""
    count = 1 if variant == "stacked, M=1" else MEMBERS
    models = members(name, shape, count)
    seeds = list(range(count))
    previous = os.environ.get(kernels.DISABLE_ENV)
    if variant == "stacked, torch ops":
        os.environ[kernels.DISABLE_ENV] = "1"
    load = os.getloadavg()[0]
    cpu, wall = time.thread_time(), time.perf_counter()
    try:
        if variant == "today":
            for model, seed in zip(models, seeds, strict=True):
                train_local(model, x, y, CONFIG, seed)
        else:
            train_members(models, x, y, CONFIG, seeds, accelerate=True)
    finally:
        if previous is None:
            os.environ.pop(kernels.DISABLE_ENV, None)
        else:
            os.environ[kernels.DISABLE_ENV] = previous
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    samples = count * len(y) * CONFIG.epochs
    return {"samples_per_cpu_s": samples / cpu, "samples_per_wall_s": samples / wall,
            "cpu_s": cpu, "wall_s": wall, "load_avg": load}


def compiled_step(x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, float]:
    """torch.compile (inductor) of today's LeNet step: compile time and throughput."""
    model = build_model("lenet", (1, 28, 28), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG.lr, momentum=CONFIG.momentum)

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        return loss

    compiled = torch.compile(forward_backward, dynamic=False)
    batch = CONFIG.batch_size
    load = os.getloadavg()[0]
    start = time.perf_counter()
    compiled(x[:batch], y[:batch])
    compile_s = time.perf_counter() - start
    cpu = time.thread_time()
    for step in range(steps):
        rows = slice((step * batch) % (len(y) - batch), (step * batch) % (len(y) - batch) + batch)
        optimizer.zero_grad(set_to_none=True)
        compiled(x[rows], y[rows])
        optimizer.step()
    return {"compile_s": compile_s,
            "samples_per_cpu_s": steps * batch / (time.thread_time() - cpu), "load_avg": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6000,
                        help="rows per member per round for LeNet (MLP x2, CNN x1/8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="lenet,mlp,cnn")
    parser.add_argument("--gemm", type=int, default=2048)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    peak = gemm_flops_per_s(args.gemm)
    names = [n for n in args.models.split(",") if n]
    rows_needed = max(int(args.samples * MODELS[n][1]) for n in names)
    x_all, y_all = load_rows(max(rows_needed, 256))
    variants = ["today", "stacked, torch ops", "stacked", "stacked, M=1"]
    results: dict[str, dict] = {}
    for name in names:
        shape, scale = MODELS[name]
        count = int(args.samples * scale)
        x, y = model_inputs(x_all[:count], shape), y_all[:count]
        flops = step_flops_per_sample(name, shape, x, y)
        run_variant("stacked", name, shape, x[:256], y[:256])  # compile kernels, warm up
        timings: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                timings[variant].append(run_variant(variant, name, shape, x, y))
                print(f"{name:>5} {variant:>20}: "
                      f"{timings[variant][-1]['samples_per_cpu_s']:8.0f} samples/CPU-s "
                      f"(load {timings[variant][-1]['load_avg']:.1f})", flush=True)
        floor = peak / flops
        summary = {}
        for variant in variants:
            rates = [t["samples_per_cpu_s"] for t in timings[variant]]
            ratios = [t["samples_per_cpu_s"] / today["samples_per_cpu_s"]
                      for t, today in zip(timings[variant], timings["today"], strict=True)]
            summary[variant] = {
                "samples_per_cpu_s": statistics.median(rates),
                "samples_per_wall_s": statistics.median(
                    t["samples_per_wall_s"] for t in timings[variant]),
                "ratio_to_today": statistics.median(ratios),
                "percent_of_floor": 100 * statistics.median(rates) / floor,
            }
        results[name] = {"input_shape": shape, "samples_per_member": count,
                         "members": MEMBERS, "flops_per_sample": flops,
                         "floor_samples_per_s": floor, "summary": summary, "timings": timings}
    compiled = None
    if args.compile:
        x, y = model_inputs(x_all[:2048], (1, 28, 28)), y_all[:2048]
        compiled = compiled_step(x, y, steps=200)

    print(f"\nOne core: {peak / 1e9:.1f} GFLOP/s on a {args.gemm}^2 float32 GEMM; "
          f"load average at start {load_start[0]:.2f}, end {os.getloadavg()[0]:.2f}")
    print("| model | variant | samples/s per core (CPU time) | wall | x today | % of floor |")
    print("|---|---|---|---|---|---|")
    for name, result in results.items():
        for variant, s in result["summary"].items():
            print(f"| {name} | {variant} | {s['samples_per_cpu_s']:.0f} | "
                  f"{s['samples_per_wall_s']:.0f} | {s['ratio_to_today']:.2f} | "
                  f"{s['percent_of_floor']:.0f}% |")
        print(f"| {name} | arithmetic floor ({result['flops_per_sample'] / 1e6:.2f} MFLOP/sample)"
              f" | {result['floor_samples_per_s']:.0f} | | | 100% |")
    if compiled is not None:
        print(f"\ntorch.compile of today's LeNet step: {compiled['compile_s']:.1f} s to compile, "
              f"then {compiled['samples_per_cpu_s']:.0f} samples/CPU-s")
    RESULTS.write_text(json.dumps({
        "gemm_size": args.gemm, "gemm_flops_per_s": peak, "batch_size": CONFIG.batch_size,
        "threads": 1, "rounds": args.rounds, "models": results, "torch_compile": compiled,
        "load_avg_start": load_start, "load_avg_end": os.getloadavg()}, indent=1))
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
