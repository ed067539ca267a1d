"""FedBEns' server on the CPU against the GPU at C = 5, 40 and 100.

The uploads are the C = 100, M = 5 set of ``benchmarks/scale.py`` (FMNIST, LeNet, Kron,
Dirichlet alpha 0.3, 20 local epochs, seed 0: ``outputs/bench-scale/c100_m5_s0/uploads``).
Where that folder is absent (a lent GPU machine starts bare) the clients are trained on the
spot with the same settings, by ``--workers`` processes that each run the App's ClientApp for
their share of the clients (:class:`~fedfusion.app.inprocess.InProcessGrid`; the other
clients' nodes fail in that process and are left out of its round).

Each cell fuses the first C clients' uploads (as ``scale.py``'s server stage does) with the
library's ``FedBEns`` (the paper's algorithm: median starts, 300 Adam steps for every run;
the 500-row validation set)
on ``cpu`` (every core) and on ``cuda``, in this process, after a warm-up fusion on each
device: the fusion's time and its phases (stacking the posterior, the starts, the
optimisation), and the test accuracy of the fused ensemble; the GPU both with its steps as
CUDA graphs (the default) and eager. ``--defaults`` adds each device with the library's
defaults (clustered starts, each run stopping once its score stalls); ``--profile``
``torch.profiler``'s table of 20 optimiser steps at the largest C on the GPU.

    python benchmarks/server_device.py [--cells 5,40,100] [--workers N] [--defaults]
        [--variants "cpu defaults,gpu defaults"] [--profile]

Prints a table and saves ``benchmarks/results/server_device.json``. Without a CUDA device it
measures the CPU alone and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedfusion.app.config import Settings, build_strategy, default_model  # noqa: E402
from fedfusion.app.federation import federated_split  # noqa: E402
from fedfusion.core.architecture import ModelSpec  # noqa: E402
from fedfusion.core.evaluation import evaluate  # noqa: E402
from fedfusion.upload_store import load_uploads  # noqa: E402
from fedfusion.wire import ClientUpload  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "server_device.json"
UPLOADS = REPO / "outputs" / "bench-scale" / "c100_m5_s0" / "uploads"
#: the upload set's run config (benchmarks/scale.py's "c100_m5_s0")
#: the paper's algorithm: median starts, every run all its steps
PAPER_SERVER = {"fedbens-starts": "median", "server-patience": 0}
#: the fusions a cell can run (``--variants``)
VARIANTS = ("cpu", "gpu", "gpu eager", "cpu defaults", "gpu defaults")
RUN_CONFIG = {"strategy": "fedbens", "hessian-structure": "kron", "alpha": 0.3, "seed": 0,
              "num-clients": 100, "num-members": 5, **PAPER_SERVER}


def train_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run config of an upload set trained here."""
    return {**RUN_CONFIG, "num-clients": args.train_clients, "local-epochs": args.local_epochs,
            "train-subset": args.train_subset}


def train_part(part: int, parts: int, out: str, run_config: dict[str, Any]) -> None:
    """One worker: the clients ``i`` with ``i % parts == part`` train and upload; the round's
    fusion is a single step (its result is not used)."""
    settings = Settings.from_mapping({**run_config, "output-dir": out,
                                      "run-name": f"part{part}", "server-steps": 1})
    clients = settings.num_clients
    from fedfusion.app.inprocess import InProcessGrid
    from fedfusion.server_app import run_server

    others = [i for i in range(clients) if i % parts != part]
    run_server(settings, InProcessGrid(settings, crash=others))


def train_uploads(out: Path, workers: int, args: argparse.Namespace) -> list[ClientUpload]:
    """Train the upload set with ``workers`` processes; return every client's upload."""
    print(f"training {args.train_clients} clients x {RUN_CONFIG['num-members']} members with "
          f"{workers} processes ...", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    forward = ["--train-clients", str(args.train_clients), "--local-epochs",
               str(args.local_epochs), "--train-subset", str(args.train_subset)]
    procs = [subprocess.Popen([sys.executable, __file__, "--train-part", f"{k},{workers}",
                               "--out", str(out), *forward],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for k in range(workers)]
    uploads: list[ClientUpload] = []
    for k, proc in enumerate(procs):
        _, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"training worker {k} failed:\n{err[-3000:]}")
        _, part, failures = load_uploads(out / f"part{k}" / "uploads", strict=True)
        uploads += part
    print(f"  {len(uploads)} uploads in {time.perf_counter() - start:.0f} s", flush=True)
    return sorted(uploads, key=lambda u: u.client_id)


def fuse_cell(settings: Settings, spec: ModelSpec, split: Any, uploads: list[ClientUpload],
              device: str, **overrides: Any) -> dict[str, Any]:
    """One FedBEns fusion of ``uploads`` on ``device`` (``overrides``: settings fields):
    times, phases, test accuracy."""
    settings = settings.replace(num_clients=len(uploads), server_device=device, **overrides)
    strategy = build_strategy(settings, spec, split.bundle.val, device)
    predictor = strategy.fuse_uploads(uploads)
    if device == "cuda":
        torch.cuda.synchronize()
    metrics = evaluate(predictor, split.bundle.test.x, split.bundle.test.y, device, 2000)
    report = strategy.report()
    mixture = report.get("mixture", {})
    return {"device": device, "cuda_graphs": device == "cuda" and settings.server_cuda_graphs,
            "clients": len(uploads), "fuse_s": strategy.fuse_seconds,
            "phases_s": report.get("phase_seconds", {}), "test_accuracy": metrics["accuracy"],
            "excluded": len(strategy.exclusions),
            "refreshes": mixture.get("refreshes"), "active_pairs": mixture.get("active_pairs"),
            "starts": report.get("starts"), "run_stops": report.get("run_stops")}


def profile_steps(settings: Settings, spec: ModelSpec, split: Any,
                  uploads: list[ClientUpload]) -> str:
    """``torch.profiler``'s table (by GPU time) of 20 FedBEns optimiser steps on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    from fedfusion.strategies.fedbens import FedBEns

    settings = settings.replace(num_clients=len(uploads), server_device="cuda",
                                server_steps=20, server_eval_every=1000)
    strategy = build_strategy(settings, spec, split.bundle.val, "cuda")
    assert isinstance(strategy, FedBEns)
    optimise = strategy.optimise

    def profiled(*args: Any, **kwargs: Any) -> Any:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = optimise(*args, **kwargs)
        profiled.table = prof.key_averages().table(  # type: ignore[attr-defined]
            sort_by="cuda_time_total", row_limit=30)
        profiled.ops = sum(e.count for e in prof.key_averages()  # type: ignore[attr-defined]
                           if e.key.startswith("aten::"))
        return out

    strategy.optimise = profiled  # type: ignore[method-assign]
    strategy.fuse_uploads(uploads)
    return (f"aten operations in 21 objective evaluations and 20 steps: {profiled.ops}\n"
            f"{profiled.table}")


def print_table(rows: list[dict[str, Any]]) -> None:
    """Per cell and variant: fuse seconds, the speed-up over the CPU with the same algorithm
    (``cpu`` for ``gpu`` and ``gpu eager``, ``cpu defaults`` for ``gpu defaults``), test
    accuracy."""
    width = max(len(r["variant"]) for r in rows) + 2
    print(f"\n{'C':>5}  {'variant':<{width}}{'fuse s':>9}{'vs CPU':>9}{'accuracy %':>12}")
    for row in rows:
        cpu = next((r for r in rows if r["clients"] == row["clients"]
                    and r["variant"] == "cpu" + row["variant"].partition(" defaults")[1]),
                   None)
        ratio = f"{cpu['fuse_s'] / row['fuse_s']:.1f}x" if cpu else "-"
        print(f"{row['clients']:>5}  {row['variant']:<{width}}{row['fuse_s']:>9.2f}"
              f"{ratio:>9}{100 * row['test_accuracy']:>12.2f}")
    if not any(r["device"] == "cuda" for r in rows):
        print("no CUDA device: the GPU is not measured")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="5,40,100", help="client counts C")
    parser.add_argument("--uploads", default=str(UPLOADS))
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--train-clients", type=int, default=100)
    parser.add_argument("--local-epochs", type=int, default=20, help="clients trained here")
    parser.add_argument("--train-subset", type=int, default=0, help="clients trained here")
    parser.add_argument("--out", default=str(Path.home() / "fedfusion-outputs" / "server_device"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--defaults", action="store_true",
                        help="also fuse with the library's defaults (clustered starts, "
                             "per-run early stop) on each device")
    parser.add_argument("--variants", help="only these variants, comma-separated (of: "
                        + ", ".join(VARIANTS) + "; those of a device absent here are skipped)")
    parser.add_argument("--train-part", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    wanted = [v.strip() for v in args.variants.split(",")] if args.variants else None
    if wanted and set(wanted) - set(VARIANTS):
        parser.error(f"--variants: unknown {sorted(set(wanted) - set(VARIANTS))}; the "
                     f"variants are {', '.join(VARIANTS)}")
    if args.train_part:
        part, parts = map(int, args.train_part.split(","))
        train_part(part, parts, args.out, train_config(args))
        return 0
    cells = [int(c) for c in args.cells.split(",")]
    if Path(args.uploads).is_dir():
        run_config, uploads, failures = load_uploads(args.uploads, strict=True)
        source = f"{args.uploads} (benchmarks/scale.py)"
        settings = Settings.from_mapping({**run_config, **PAPER_SERVER})
    else:
        uploads = train_uploads(Path(args.out), args.workers, args)
        source = f"trained here by {args.workers} processes"
        settings = Settings.from_mapping(train_config(args))
    uploads = sorted(uploads, key=lambda u: u.client_id)
    split = federated_split(settings)
    bundle = split.bundle
    spec = ModelSpec(default_model(settings, bundle.input_shape), bundle.input_shape,
                     bundle.num_classes, settings.parsed_model_kwargs())
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    #: (label, device, constructor overrides): the GPU with its steps as CUDA graphs (the
    #: default) and eager, op by op
    variants = [("cpu", "cpu", {})] + ([("gpu", "cuda", {}), ("gpu eager", "cuda",
                                                             {"server_cuda_graphs": False})]
                                       if "cuda" in devices else [])
    if args.defaults or any(v.endswith("defaults") for v in wanted or []):
        # clustered starts, each run stopping on its own
        defaults = {"fedbens_starts": Settings.fedbens_starts,
                    "server_patience": Settings.server_patience}
        variants += [(f"{label} defaults", device, defaults)
                     for label, device in (("cpu", "cpu"), ("gpu", "cuda")) if device in devices]
    if wanted:
        variants = [v for v in variants if v[0] in wanted]
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    print(f"devices: {devices}; CPU threads {threads}"
          + (f"; {torch.cuda.get_device_name()}" if "cuda" in devices else
             "; no CUDA device: the GPU column stays 'not measured'"), flush=True)
    for device in devices:  # warm-up: CUDA context, kernels, allocator, thread pool
        fuse_cell(settings.replace(server_steps=5), spec, split, uploads[:5], device)
    rows: list[dict[str, Any]] = []

    def save(profile: str | None = None) -> None:  # after every row: a run cut short keeps them
        RESULTS.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "uploads": source,
            "run_config": {k: settings.to_mapping()[k] for k in train_config(args)},
            "gpu": torch.cuda.get_device_name() if "cuda" in devices else None,
            "cpu_threads": threads, "torch": torch.__version__, "rows": rows,
            "profile": profile}, indent=1))

    for clients in cells:
        for label, device, overrides in variants:
            print(f"C = {clients}, {label} ...", flush=True)
            row = {"variant": label, **fuse_cell(settings, spec, split, uploads[:clients],
                                                 device, **overrides)}
            print(f"  fuse {row['fuse_s']:.2f} s (" + ", ".join(
                f"{k} {v:.2f}" for k, v in row["phases_s"].items())
                + f"), accuracy {100 * row['test_accuracy']:.2f}%", flush=True)
            rows.append(row)
            save()
    profile = profile_steps(settings, spec, split, uploads[:max(cells)]) if (
        args.profile and "cuda" in devices) else None
    if profile:
        print(profile)
    print_table(rows)
    save(profile)
    print(f"saved {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
