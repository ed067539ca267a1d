"""FedBEns in the setting where the authors' code was measured on this machine, against it.

FMNIST, bias-free LeNet, C = 5 clients, M = 5 members, Kron Laplace, Dirichlet alpha 0.1,
seed 0, 20 local epochs, T = 0.1, sigma^2 = 0.1, 300 server steps with validation every 30:
one live ``flwr run`` (the product path: SuperLink + Ray, 5 SuperNodes of one CPU each), with
nothing else asked of the clients. Memory is sampled every 0.2 s from /proc while it runs:

* ``machine_peak_gb``: peak of (MemTotal - MemAvailable) minus its value before the launch,
  i.e. the RAM the whole run (SuperLink, Ray, client actors, server) took from the machine,
  shared pages counted once;
* ``largest_process_peak_gb``: the largest resident set of any single process it started.

The authors' figures (``../shared/notes/fedbens-reference-run.md``: their code, same setting,
this kind of machine, one process with 2 threads) are printed beside ours.

    .venv/bin/python benchmarks/authors_setting.py        # about 6 minutes on 2 quiet cores

Prints a table and writes benchmarks/results/authors_setting.json.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from common import REPO, live_run

RESULTS = REPO / "benchmarks" / "results" / "authors_setting.json"

#: the authors' code on this machine (alpha 0.1, seed 0; fedbens-reference-run.md)
AUTHORS = {"accuracy_pct": 75.38, "nll": 0.691, "client_train_s": 581.0, "client_fit_s": 256.0,
           "server_s": 117.0, "wall_s": 16.7 * 60, "peak_gb": 1.6}


def _meminfo_used_kb() -> int:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return fields["MemTotal"] - fields["MemAvailable"]


def _rss_kb(pid: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemorySampler(threading.Thread):
    """Peak machine memory above the baseline, and the largest new process, every 0.2 s."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.baseline_kb = _meminfo_used_kb()
        self.before = {p.name for p in Path("/proc").iterdir() if p.name.isdigit()}
        self.peak_kb = 0
        self.largest_kb = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.peak_kb = max(self.peak_kb, _meminfo_used_kb() - self.baseline_kb)
            for proc in Path("/proc").iterdir():
                if proc.name.isdigit() and proc.name not in self.before:
                    self.largest_kb = max(self.largest_kb, _rss_kb(proc.name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-authors-setting"))
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    name = f"a{args.alpha:g}-s{args.seed}"
    done = Path(args.out) / name / "results.json"
    if done.is_file():
        done.unlink()  # always a fresh run: this script measures time and memory
    sampler = MemorySampler()
    load_start = os.getloadavg()
    sampler.start()
    start = time.perf_counter()
    results = live_run(f"strategy=fedbens alpha={args.alpha} seed={args.seed} num-clients=5 "
                       "num-members=5 local-epochs=20 hessian-structure=kron", args.out, name)
    launch_s = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    timing = results["timing"]
    clients = results["clients"]
    ours = {
        "accuracy_pct": 100 * results["test"]["accuracy"], "nll": results["test"]["nll"],
        "client_train_s": timing["client_train_s_sum"],
        "client_fit_s": sum(c["section_time_s"].get("curvature.kron", 0.0) for c in clients),
        "client_round_s": timing["client_round_s"],
        "server_s": timing["server_fuse_s"], "wall_s": launch_s,
        "peak_gb": sampler.peak_kb / 2**20, "largest_process_peak_gb": sampler.largest_kb / 2**20,
    }
    rows = [
        ("test accuracy (%)", "accuracy_pct", ".2f"),
        ("test NLL", "nll", ".3f"),
        ("client training, s (ours: sum of 25 members, 1 thread each)", "client_train_s", ".0f"),
        ("client Kron fit, s (ours: sum of 25 members)", "client_fit_s", ".0f"),
        ("client phase wall, s (train + fit + upload, 5 clients on 2 cores)", "client_round_s",
         ".0f"),
        ("server (5 modes x 300 steps + selection), s", "server_s", ".1f"),
        ("whole run incl. SuperLink + Ray start, s", "wall_s", ".0f"),
        ("peak memory, GB (ours: machine-wide, whole run)", "peak_gb", ".2f"),
        ("largest single process, GB", "largest_process_peak_gb", ".2f"),
    ]
    authors = {**AUTHORS, "client_round_s": AUTHORS["client_train_s"] + AUTHORS["client_fit_s"],
               "largest_process_peak_gb": AUTHORS["peak_gb"]}
    print(f"\nFedBEns, FMNIST LeNet, C=5, M=5, Kron, alpha {args.alpha:g}, seed {args.seed} "
          f"(load average before: {load_start[0]:.2f})")
    print("| measure | fedfusion | authors' code |")
    print("|---|---|---|")
    for label, key, spec in rows:
        print(f"| {label} | {format(ours[key], spec)} | {format(authors[key], spec)} |")
    RESULTS.write_text(json.dumps({
        "alpha": args.alpha, "seed": args.seed, "ours": ours, "authors": AUTHORS,
        "fit_over_train": ours["client_fit_s"] / ours["client_train_s"],
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "run": str(done.parent)}, indent=1))
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
