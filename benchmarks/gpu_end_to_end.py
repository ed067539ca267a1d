"""FedBEns, ours and the authors' code, side by side on one GPU: whole run, client phase,
server, accuracy (issue 40, item 2).

The setting of ``../shared/notes/fedbens-reference-run.md``: FMNIST, bias-free LeNet, C = 5,
M = 5, 20 local epochs, Kron Laplace, T = 0.1, sigma^2 = 0.1, the paper's server algorithm
(median starts, 300 Adam steps, validation every 30), on the authors' own split and
validation rows (``fedbens-authors-splits.npz``), at each ``--alphas``, ``--seed``:

* **ours**: the App's ServerApp and ClientApp in this process (``InProcessGrid``: Flower's
  Message API without SuperLink or Ray, the 5 clients one after the other, as the authors'
  code runs them), ``client-device='auto'`` (the GPU) and the server on the GPU;
* **authors**: their ``main_FedBEns_kron.py``, unchanged, in a child process
  (``benchmarks/authors_code.py``: their native CUDA setting, phases timed by wrappers).

Every run is a fresh process of its own (its CUDA start-up and data loading counted, as in
theirs), one at a time, alpha by alpha (ours, then theirs), then a short comparison of our
training engines on the card (:func:`training_engines`). ``--deadline-s`` starts no run
expected to end past it (its side's last run's time), so a device lease keeps whole pairs,
and stops a run still going at it: recorded as ``unfinished`` with the seconds it ran (a
lower bound, its ratio in ``speedup_at_least``) and the phases it finished.
With no GPU the same script runs on the CPU (``--cpu``: their code's one word 'cuda'
replaced), as a dry run with ``--epochs 1``.

    python benchmarks/gpu_end_to_end.py --authors-code DIR/One_shot_FL --data-dir FMNIST_IDX \\
        [--splits ../shared/data/fedbens-authors-splits.npz] [--alphas 0.1,0.4] [--seed 0] \\
        [--epochs 20] [--authors-site DIR] [--cpu] [--json benchmarks/results/gpu_end_to_end.json]

Writes the JSON after every finished run (so a run cut short keeps what it measured):
``device`` (the card's name), ``clients_on_gpu``, ``ours`` / ``authors`` (the first alpha:
``wall_s``, ``client_s``, ``server_s``, ``accuracy`` in 0..1, ``nll``), every alpha in
``cells`` and the ratios in ``speedup``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import PAPER_ALGORITHM, REPO, kron_fit_s, live_run_in_process

from fedfusion.datasets.loading import IDX_FILES

RESULTS = REPO / "benchmarks" / "results" / "gpu_end_to_end.json"
SPLITS = REPO.parent / "shared" / "data" / "fedbens-authors-splits.npz"
AUTHORS_CODE = REPO / "benchmarks" / "authors_code.py"


def ours(alpha: float, seed: int, epochs: int, splits: Path, out: str) -> dict[str, Any]:
    """One in-process run of the App at (alpha, seed); its figures."""
    name = f"a{alpha:g}-s{seed}-e{epochs}"
    done = Path(out) / name / "results.json"
    if done.is_file():
        done.unlink()  # always a fresh run: this measures time
    start = time.perf_counter()
    results = live_run_in_process(
        f"strategy=fedbens alpha={alpha} seed={seed} num-clients=5 num-members=5 "
        f"local-epochs={epochs} hessian-structure=kron partition-file='{splits}' "
        f"partition-key=C5_a{alpha:g} val-source=file {PAPER_ALGORITHM}", out, name)
    wall = time.perf_counter() - start
    if results.get("status") != "ok":
        return {"error": f"our run at alpha {alpha:g} failed: {results.get('error')}"}
    timing, clients = results["timing"], results["clients"]
    return {
        "wall_s": wall, "client_s": timing["client_round_s"],
        "client_train_s": timing["client_train_s_sum"],
        "client_fit_s": kron_fit_s(clients),
        "server_s": timing["server_fuse_s"], "eval_s": timing["server_eval_s"],
        "accuracy": results["test"]["accuracy"], "nll": results["test"]["nll"],
        "client_devices": sorted({str(c.get("device")) for c in clients}),
        "path": "in-process: the App's ServerApp and ClientApp (InProcessGrid), no SuperLink/Ray",
    }


def training_engines(device: str, rows: int = 15000, members: int = 5) -> dict[str, Any]:
    """One epoch of ``members`` LeNets on ``rows`` FMNIST rows on ``device``: the members as
    one computation (``accelerate``: the vmapped engine on a GPU, its full-batch steps CUDA
    graphs, the stacked one on the CPU), the vmapped engine without graphs (GPU), and one
    member after the other, each after a warm-up run."""
    from fedfusion.accel.vmapped import train_vmapped
    from fedfusion.datasets import load_dataset
    from fedfusion.models import build_model
    from fedfusion.training import TrainConfig, train_members

    bundle = load_dataset("fmnist")
    x, y = bundle.train.x[:rows], bundle.train.y[:rows]
    config = TrainConfig(epochs=1)

    def accelerated(models: list[torch.nn.Module]) -> None:
        train_members(models, x, y, config, list(range(members)), accelerate=True)

    def vmapped_eager(models: list[torch.nn.Module]) -> None:
        train_vmapped(models, x, y, 1, config.lr, config.momentum, config.batch_size,
                      list(range(members)), cuda_graphs=False)

    def one_by_one(models: list[torch.nn.Module]) -> None:
        train_members(models, x, y, config, list(range(members)), accelerate=False)

    engines = {"accelerated": accelerated, "one_by_one": one_by_one}
    if device != "cpu":
        engines["vmapped_eager"] = vmapped_eager
    seconds = {}
    for name, engine in engines.items():
        for _ in range(2):  # the first run warms up
            torch.manual_seed(0)
            models = [build_model("lenet", (1, 28, 28), 10).to(device) for _ in range(members)]
            start = time.perf_counter()
            engine(models)
            if device != "cpu":
                torch.cuda.synchronize()
            seconds[name] = time.perf_counter() - start
    return {"rows": rows, "members": members, "epochs": 1, "device": device,
            "engine": "stacked" if device == "cpu" else "vmapped, CUDA graphs",
            **{f"{name}_s": value for name, value in seconds.items()},
            "speedup": seconds["one_by_one"] / seconds["accelerated"]}


def child(command: list[str], target: Path, log: Path, env: dict[str, str] | None = None,
          timeout: float | None = None) -> dict[str, Any]:
    """``command`` in a fresh process (its own CUDA start-up and data loading, as each run
    of the authors' code has), writing its figures to ``target``; an ``error`` naming the
    log's end where it failed; where it ran past ``timeout`` seconds, stopped and recorded
    as ``unfinished``, with ``ran_s`` (a lower bound on its whole run) and the phases it
    finished (``phases_s``: the lines :mod:`authors_code` prints)."""
    target.unlink(missing_ok=True)
    start = time.perf_counter()
    with log.open("w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  check=False, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            ran = time.perf_counter() - start
            return {"unfinished": f"stopped after {ran:.0f} s (--deadline-s)", "ran_s": ran,
                    "phases_s": finished_phases(log.read_text(errors="replace"))}
    if code != 0 or not target.is_file():
        return {"error": f"exit {code}; the end of {log}:\n{log.read_text()[-1500:]}"}
    return json.loads(target.read_text())


def finished_phases(text: str) -> dict[str, float]:
    """The last seconds each phase reported in a log of :mod:`authors_code`."""
    from authors_code import PHASE_LINE

    phases = {}
    for line in text.splitlines():
        if line.startswith(PHASE_LINE):
            fields = line[len(PHASE_LINE):].split()
            if len(fields) == 2:
                phases[fields[0]] = float(fields[1])
    return phases


def ours_in_child(alpha: float, args: argparse.Namespace, work: Path,
                  timeout: float | None) -> dict[str, Any]:
    target = work / f"ours-a{alpha:g}.json"
    command = [sys.executable, __file__, "--ours-cell", str(alpha), "--cell-json", str(target),
               "--seed", str(args.seed), "--epochs", str(args.epochs), "--splits",
               str(args.splits), "--out", args.out, "--data-dir", str(args.data_dir),
               "--authors-code", str(args.authors_code)]
    return child(command, target, work / f"ours-a{alpha:g}.log", timeout=timeout)


def authors_in_child(alpha: float, args: argparse.Namespace, work: Path,
                     timeout: float | None) -> dict[str, Any]:
    """Their script at ``alpha`` with ``--authors-site`` (their pinned packages, e.g.
    laplace-torch 0.2.2.2) first on its path."""
    env = dict(os.environ)
    if args.authors_site:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (args.authors_site, env.get("PYTHONPATH")) if p)
    target = work / f"authors-a{alpha:g}.json"
    command = [sys.executable, str(AUTHORS_CODE), "--code", str(args.authors_code.resolve()),
               "--work", str(work), "--alpha", str(alpha), "--seed", str(args.seed),
               "--epochs", str(args.epochs), "--json", str(target)] + (
                   ["--cpu"] if args.cpu else [])
    return child(command, target, work / f"authors-a{alpha:g}.log", env, timeout)


def prepare_authors_work(data_dir: Path, work: Path) -> None:
    """Their code reads FMNIST through torchvision from ./data/fashionmnist: the four IDX
    files, unpacked, in FashionMNIST/raw (present files are not downloaded)."""
    raw = work / "data" / "fashionmnist" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in (stem for pair in IDX_FILES.values() for stem in pair):
        if (raw / name).is_file():
            continue
        if (data_dir / name).is_file():
            (raw / name).symlink_to((data_dir / name).resolve())
        elif (data_dir / f"{name}.gz").is_file():
            import gzip

            (raw / name).write_bytes(gzip.decompress((data_dir / f"{name}.gz").read_bytes()))
        else:
            raise SystemExit(f"{data_dir} holds neither {name} nor {name}.gz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--authors-code", type=Path, required=True,
                        help="their One_shot_FL folder (github jacopot96/FedBEns at b2c9813)")
    parser.add_argument("--data-dir", type=Path, required=True,
                        help="the four FMNIST IDX files (.gz or unpacked)")
    parser.add_argument("--splits", type=Path, default=SPLITS)
    parser.add_argument("--alphas", default="0.1,0.4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--authors-site", default="",
                        help="a folder of the packages their code pins, first on its path")
    parser.add_argument("--skip-authors", action="store_true")
    parser.add_argument("--deadline-s", type=float, default=0,
                        help="start no run expected to end past this many seconds (its side's "
                             "last run's time), stop one still running at it; 0 = none")
    parser.add_argument("--cpu", action="store_true", help="a dry run without a GPU")
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-gpu-end-to-end"))
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--ours-cell", type=float, help=argparse.SUPPRESS)  # the child's work
    parser.add_argument("--cell-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["FEDFUSION_DATA_DIR"] = str(args.data_dir.resolve())
    if args.ours_cell is not None:
        args.cell_json.write_text(json.dumps(
            ours(args.ours_cell, args.seed, args.epochs, args.splits, args.out)))
        return
    alphas = [float(a) for a in args.alphas.split(",")]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if gpu is None and not args.cpu:
        raise SystemExit("no CUDA device here: pass --cpu for a dry run on the CPU")
    work = Path(tempfile.mkdtemp(prefix="fedbens-side-by-side-"))
    record: dict[str, Any] = {
        "device": gpu or "cpu", "torch": torch.__version__, "clients_on_gpu": None,
        "setting": {"alphas": alphas, "seed": args.seed, "local_epochs": args.epochs,
                    "clients": 5, "members": 5, "structure": "kron",
                    "server": "the paper's algorithm (median starts, 300 Adam steps)",
                    "split": "the authors' (fedbens-authors-splits.npz)",
                    "runs": "each in a fresh process, one at a time: ours then theirs, "
                            "alpha by alpha"},
        "cells": [{"alpha": alpha, "seed": args.seed} for alpha in alphas],
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu_cores": len(os.sched_getaffinity(0)), "logs": str(work)}

    def save() -> None:
        cells = record["cells"]
        record["ours"], record["authors"] = cells[0].get("ours"), cells[0].get("authors")
        done = [c for c in cells if "wall_s" in c.get("ours", {})
                and "wall_s" in c.get("authors", {})]
        record["speedup"] = {f"{c['alpha']:g}": {k: c["authors"][k] / c["ours"][k]
                                                 for k in ("wall_s", "client_s", "server_s")}
                             for c in done}
        # theirs stopped at the deadline: its time so far over ours, a lower bound
        record["speedup_at_least"] = {
            f"{c['alpha']:g}": {"wall_s": c["authors"]["ran_s"] / c["ours"]["wall_s"]}
            for c in cells if "wall_s" in c.get("ours", {})
            and "ran_s" in c.get("authors", {})}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))

    runs = {"ours": ours_in_child, "authors": authors_in_child}
    if args.skip_authors:
        del runs["authors"]
    else:
        prepare_authors_work(args.data_dir, work)
    started, took = time.perf_counter(), {}
    for cell in record["cells"]:  # alpha by alpha: a lease cut short keeps whole pairs
        for who, run in runs.items():
            elapsed = time.perf_counter() - started
            if args.deadline_s and elapsed + took.get(who, 0.0) > args.deadline_s:
                cell[who] = {"skipped": f"--deadline-s {args.deadline_s:g}: {elapsed:.0f} s "
                                        f"gone, its last run took {took.get(who, 0.0):.0f} s"}
                print(f"{who}, alpha {cell['alpha']:g}: {cell[who]['skipped']}", flush=True)
                continue
            print(f"{who}, alpha {cell['alpha']:g} ...", flush=True)
            cell[who] = run(cell["alpha"], args, work,
                            args.deadline_s - elapsed if args.deadline_s else None)
            took[who] = time.perf_counter() - started - elapsed
            print(json.dumps(cell[who])[:2000], flush=True)
            devices = [d for c in record["cells"]
                       for d in c.get("ours", {}).get("client_devices", [])]
            record["clients_on_gpu"] = bool(devices) and all(
                d.startswith("cuda") for d in devices)
            save()
    record["training_engines"] = training_engines("cpu" if args.cpu else "cuda")
    print(f"training engines: {json.dumps(record['training_engines'])}", flush=True)
    save()
    print("\n| alpha | who | accuracy % | NLL | whole run s | client phase s | server s |")
    print("|---|---|---|---|---|---|---|")
    for cell in record["cells"]:
        for who in ("ours", "authors"):
            f = cell.get(who, {})
            if "wall_s" in f:
                print(f"| {cell['alpha']:g} | {who} | {100 * f['accuracy']:.2f} | "
                      f"{f['nll']:.3f} | {f['wall_s']:.1f} | {f['client_s']:.1f} | "
                      f"{f['server_s']:.1f} |")
    for alpha, ratio in record["speedup"].items():
        print(f"alpha {alpha}: ours is {ratio['wall_s']:.1f}x faster whole run, "
              f"{ratio['client_s']:.1f}x client phase, {ratio['server_s']:.1f}x server")
    for alpha, ratio in record["speedup_at_least"].items():
        print(f"alpha {alpha}: theirs stopped unfinished; ours is at least "
              f"{ratio['wall_s']:.1f}x faster whole run")
    print(f"saved {args.json}")
    failed = [f"{who} at alpha {c['alpha']:g}" for c in record["cells"]
              for who in ("ours", "authors") if "error" in c.get(who, {})]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (errors in {args.json})")


if __name__ == "__main__":
    main()
