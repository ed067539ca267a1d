"""FedBEns in the setting where the authors' code was measured on this machine, against it.

FMNIST, bias-free LeNet, C = 5 clients, M = 5 members, Kron Laplace, Dirichlet alpha 0.1,
seed 0, 20 local epochs, T = 0.1, sigma^2 = 0.1, 300 server steps with validation every 30:
one live ``flwr run`` (the product path: SuperLink + Ray, 5 SuperNodes of one CPU each), with
nothing else asked of the clients. Memory is sampled every 0.2 s from /proc while it runs:

* ``peak_gb``: peak of (MemTotal - MemAvailable) minus its value before the launch, i.e. the
  RAM the whole run (SuperLink, Ray, client actors, server) took from the machine, shared
  pages counted once; on a shared machine this includes what other programs took meanwhile,
  so ``run_anon_peak_gb`` is reported too: the peak over time of the summed anonymous memory
  (``RssAnon``) of the run's own processes (they carry an environment tag), which, like the
  machine-wide figure, leaves out shared library code;
* ``largest_process_peak_gb``: the largest resident set of any single process it started;
  ``largest_client_peak_gb`` the same over the client processes (Ray's ``ClientAppActor``
  workers), ``processes`` the peak of each kind of process (resident set: shared library
  pages count in every process that maps them, once in the machine-wide figure).

The wall time is split into: ``start-up`` (SuperLink, Ray and the ServerApp process up to
the ServerApp's first line of work, plus their shutdown: the launch's wall minus the
ServerApp's own), ``server setup`` (the ServerApp's data loading, strategy and initial models:
its wall minus the client phase, fusion and evaluation), the ``client phase`` (from sending the
train messages to holding every reply, 5 clients on 2 cores) and, within it, the clients'
summed CPU-side times (one thread each): ``data loading``, ``training``, ``fit`` (Kron) and
``other`` (model set-up, upload encoding; the rest of each client's handling of its message),
then ``server`` (fusion: the FedBEns optimisation) and ``evaluation`` (test set).

The authors' figures (``../shared/notes/fedbens-reference-run.md``: their code, same setting,
this kind of machine, one process with 2 threads) are printed beside ours.

    .venv/bin/python benchmarks/authors_setting.py        # a few minutes on 2 quiet cores
    .venv/bin/python benchmarks/authors_setting.py --alphas 0.1,0.4 --seeds 0,1,2

Prints the tables of each run and, with several runs, a summary and FedBEns' accuracy before
the stacked trainer (``benchmarks/results/fedbens.json``, same cells) against these runs; writes
benchmarks/results/authors_setting.json: every run in ``runs`` (those of earlier invocations
at other cells kept, each with its commit), the alpha 0.1 / seed 0 run at the top level.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from pathlib import Path

from common import PAPER_ALGORITHM, REPO, cell, kron_fit_s, live_run

RESULTS = REPO / "benchmarks" / "results" / "authors_setting.json"
#: FedBEns before the stacked trainer (benchmarks/fedbens.py, the same setting)
BEFORE = REPO / "benchmarks" / "results" / "fedbens.json"

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


def _name(pid: str) -> str:
    """A short kind for a process: its command's program, or Ray's actor/worker title."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    first = args[0].decode(errors="replace")
    if first.startswith("ray::"):
        return first.split()[0]
    for arg in args[:3]:
        text = arg.decode(errors="replace")
        if "flwr" in text or "flower" in text or "ray" in text.lower() or "gcs" in text:
            return Path(text).name
    return Path(first).name


#: an environment variable every process of this run inherits (the detached SuperLink, Ray
#: and its workers included): other programs on a shared machine are not counted
TAG = "FEDFUSION_BENCH_RUN"


def _ours(pid: str, tag: bytes) -> bool:
    try:
        return tag in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _anon_kb(pid: str) -> int:
    """Private memory of a process: anonymous pages (not shared library code)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemorySampler(threading.Thread):
    """Every 0.2 s: machine memory above the baseline, each process of this run's peak, and
    the run's total anonymous memory (summed over its processes)."""

    def __init__(self, tag: str) -> None:
        super().__init__(daemon=True)
        self.tag = tag.encode()
        self.baseline_kb = _meminfo_used_kb()
        self.peak_kb = 0
        self.anon_peak_kb = 0
        self.process_peak_kb: dict[str, tuple[str, int]] = {}  # pid -> (kind, peak)
        self.process_anon_peak_kb: dict[str, int] = {}  # pid -> peak anonymous memory
        self.stop = threading.Event()

    def run(self) -> None:
        known: dict[str, bool] = {}
        while not self.stop.wait(0.2):
            self.peak_kb = max(self.peak_kb, _meminfo_used_kb() - self.baseline_kb)
            anon = 0
            for proc in Path("/proc").iterdir():
                pid = proc.name
                if not pid.isdigit():
                    continue
                if pid not in known:
                    known[pid] = _ours(pid, self.tag)
                if not known[pid]:
                    continue
                rss = _rss_kb(pid)
                private = _anon_kb(pid)
                anon += private
                self.process_anon_peak_kb[pid] = max(self.process_anon_peak_kb.get(pid, 0),
                                                     private)
                kind, peak = self.process_peak_kb.get(pid, ("", 0))
                if rss > peak:
                    # ray renames its workers once they host an actor: keep the last name
                    self.process_peak_kb[pid] = (_name(pid) or kind, rss)
            self.anon_peak_kb = max(self.anon_peak_kb, anon)

    def by_kind(self) -> dict[str, float]:
        """Peak resident set (GB) of the largest process of each kind."""
        kinds: dict[str, float] = {}
        for kind, peak in self.process_peak_kb.values():
            kinds[kind] = max(kinds.get(kind, 0.0), peak / 2**20)
        return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))

    def anon_by_kind(self) -> dict[str, float]:
        """Peak anonymous (private) memory (GB) of the largest process of each kind."""
        kinds: dict[str, float] = {}
        for pid, (kind, _) in self.process_peak_kb.items():
            kinds[kind] = max(kinds.get(kind, 0.0), self.process_anon_peak_kb.get(pid, 0) / 2**20)
        return kinds


def measure(alpha: float, seed: int, local_epochs: int, out: str) -> dict:
    """One live run in the authors' setting at (``alpha``, ``seed``): its tables printed, its
    record returned."""
    name = f"a{alpha:g}-s{seed}" + (f"-e{local_epochs}" if local_epochs != 20 else "")
    done = Path(out) / name / "results.json"
    if done.is_file():
        done.unlink()  # always a fresh run: this script measures time and memory
    tag = f"{TAG}={os.getpid()}-{time.time_ns()}"
    os.environ[TAG] = tag.split("=", 1)[1]
    sampler = MemorySampler(tag)
    load_start = os.getloadavg()
    sampler.start()
    start = time.perf_counter()
    results = live_run(f"strategy=fedbens alpha={alpha} seed={seed} num-clients=5 "
                       f"num-members=5 local-epochs={local_epochs} hessian-structure=kron "
                       f"{PAPER_ALGORITHM}",
                       out, name)
    launch_s = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    timing = results["timing"]
    clients = results["clients"]
    kinds = sampler.by_kind()
    client_kinds = [k for k in kinds if "ClientAppActor" in k]
    fit_s = kron_fit_s(clients)
    load_s = sum(c.get("load_time_s", 0.0) for c in clients)
    client_s = sum(c.get("client_time_s", 0.0) for c in clients)
    ours = {
        "accuracy_pct": 100 * results["test"]["accuracy"], "nll": results["test"]["nll"],
        "client_train_s": timing["client_train_s_sum"],
        "client_fit_s": fit_s,
        "client_round_s": timing["client_round_s"],
        "server_s": timing["server_fuse_s"], "wall_s": launch_s,
        "peak_gb": sampler.peak_kb / 2**20,
        "run_anon_peak_gb": sampler.anon_peak_kb / 2**20,
        "largest_process_peak_gb": max(kinds.values(), default=0.0),
        "largest_client_peak_gb": max((kinds[k] for k in client_kinds), default=0.0),
    }
    split = {
        "start-up (SuperLink, Ray, ServerApp process; shutdown)": launch_s - timing["wall_s"],
        "server setup (data loading, strategy, initial models)": timing["wall_s"] - timing[
            "client_round_s"] - timing["server_fuse_s"] - timing["server_eval_s"],
        "client phase, wall (5 clients on 2 cores)": timing["client_round_s"],
        "  clients' data loading, summed": load_s,
        "  clients' training, summed": ours["client_train_s"],
        "  clients' Kron fit, summed": fit_s,
        "  clients' other (set-up, upload encoding), summed": client_s - load_s - ours[
            "client_train_s"] - sum(c["stats_time_s"] for c in clients),
        "server (FedBEns fusion)": timing["server_fuse_s"],
        "evaluation (test set)": timing["server_eval_s"],
    }
    rows = [
        ("test accuracy (%)", "accuracy_pct", ".2f"),
        ("test NLL", "nll", ".3f"),
        ("client training, s (ours: sum over 5 clients, 1 thread each)", "client_train_s",
         ".0f"),
        ("client Kron fit, s (ours: sum of 25 members)", "client_fit_s", ".0f"),
        ("client phase wall, s (train + fit + upload, 5 clients on 2 cores)", "client_round_s",
         ".0f"),
        ("server (5 modes x 300 steps + selection), s", "server_s", ".1f"),
        ("whole run incl. SuperLink + Ray start, s", "wall_s", ".0f"),
        ("peak memory, GB (ours: machine-wide, whole run)", "peak_gb", ".2f"),
        ("peak memory, GB (ours: the run's processes, anonymous pages summed)",
         "run_anon_peak_gb", ".2f"),
        ("largest single process, GB", "largest_process_peak_gb", ".2f"),
        ("largest client process, GB", "largest_client_peak_gb", ".2f"),
    ]
    authors = {**AUTHORS, "client_round_s": AUTHORS["client_train_s"] + AUTHORS["client_fit_s"],
               "run_anon_peak_gb": AUTHORS["peak_gb"],
               "largest_process_peak_gb": AUTHORS["peak_gb"],
               "largest_client_peak_gb": AUTHORS["peak_gb"]}
    load_end = os.getloadavg()
    print(f"\nFedBEns, FMNIST LeNet, C=5, M=5, Kron, alpha {alpha:g}, seed {seed} "
          f"(load average before: {load_start[0]:.2f}, after: {load_end[0]:.2f})")
    print("| measure | fedfusion | authors' code (alpha 0.1, seed 0) |")
    print("|---|---|---|")
    for label, key, spec in rows:
        print(f"| {label} | {format(ours[key], spec)} | {format(authors[key], spec)} |")
    print(f"\nKron fit / training: {100 * fit_s / ours['client_train_s']:.1f}%")
    print("\n| where the time went | s |")
    print("|---|---|")
    for label, seconds in split.items():
        print(f"| {label} | {seconds:.1f} |")
    private = sampler.anon_by_kind()
    print("\n| process (largest of its kind) | peak resident set, GB | of which private "
          "(anonymous), GB |")
    print("|---|---|---|")
    for kind, gb in kinds.items():
        if gb >= 0.05:
            print(f"| {kind} | {gb:.2f} | {private.get(kind, 0.0):.2f} |")
    return {
        "alpha": alpha, "seed": seed, "local_epochs": local_epochs, "ours": ours,
        "fit_over_train": fit_s / ours["client_train_s"], "time_split_s": split,
        "process_peak_gb": kinds, "process_private_peak_gb": private, "per_client": [
            {k: c.get(k) for k in ("client_id", "num_examples", "train_time_s", "load_time_s",
                                   "client_time_s", "section_time_s", "upload_mb")}
            for c in clients],
        "load_avg_start": load_start, "load_avg_end": load_end, "run": str(done.parent),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "code": code_version()}


def code_version() -> str:
    """The checkout's commit, with ``+changes`` when the working tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+changes" if git(
        "status", "--porcelain", "--untracked-files=no") else "")


def accuracy_before_after(runs: list[dict]) -> list[dict]:
    """Per alpha: FedBEns' test accuracy of these runs against the same (alpha, seed) cells
    of ``benchmarks/results/fedbens.json``, measured before the stacked trainer (members trained one
    after another with PyTorch's layers; same setting, those clients also uploaded extra
    sections, which do not change training)."""
    before = json.loads(BEFORE.read_text()) if BEFORE.is_file() else []
    rows = []
    for alpha in sorted({r["alpha"] for r in runs}):
        after = {r["seed"]: r["ours"]["accuracy_pct"] for r in runs if r["alpha"] == alpha}
        old = {r["seed"]: 100 * r["methods"]["fedbens"]["accuracy"] for r in before
               if r["alpha"] == alpha and r["seed"] in after and "fedbens" in r["methods"]}
        rows.append({"alpha": alpha, "seeds": sorted(after), "after": after, "before": old})
    print("\n| alpha | seeds | before issue 16, % | after, % | per seed, before -> after |")
    print("|---|---|---|---|---|")
    for row in rows:
        pairs = ", ".join(f"{row['before'].get(s, float('nan')):.2f} -> {row['after'][s]:.2f}"
                          for s in row["seeds"])
        print(f"| {row['alpha']:g} | {','.join(map(str, row['seeds']))} | "
              f"{cell(list(row['before'].values()))} | {cell(list(row['after'].values()))} | "
              f"{pairs} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-authors-setting"))
    parser.add_argument("--alphas", default="0.1", help="comma-separated, e.g. 0.1,0.4")
    parser.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1,2")
    parser.add_argument("--local-epochs", type=int, default=20,
                        help="20 is the authors' setting; fewer for a quick look")
    args = parser.parse_args()
    target = RESULTS if args.local_epochs == 20 else RESULTS.with_name(
        f"authors_setting-e{args.local_epochs}.json")
    measured = [measure(float(alpha), int(seed), args.local_epochs, args.out)
                for alpha in args.alphas.split(",") for seed in args.seeds.split(",")]
    # the runs of earlier invocations at other (alpha, seed) cells are kept
    cells = {(r["alpha"], r["seed"]) for r in measured}
    earlier = json.loads(target.read_text()).get("runs", []) if target.is_file() else []
    runs = sorted([r for r in earlier if (r["alpha"], r["seed"]) not in cells] + measured,
                  key=lambda r: (r["alpha"], r["seed"]))
    if len(runs) > 1:
        print("\n| alpha | seed | accuracy % | wall s | client phase s | server s | "
              "fit / training | machine peak GB | largest client process GB | code |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            o = r["ours"]
            print(f"| {r['alpha']:g} | {r['seed']} | {o['accuracy_pct']:.2f} | "
                  f"{o['wall_s']:.0f} | {o['client_round_s']:.0f} | {o['server_s']:.1f} | "
                  f"{100 * r['fit_over_train']:.1f}% | {o['peak_gb']:.2f} | "
                  f"{o['largest_client_peak_gb']:.2f} | {r.get('code', '?')} |")
    accuracy = accuracy_before_after(runs) if args.local_epochs == 20 else []
    # the headline is the authors' cell (alpha 0.1, seed 0) where measured
    headline = next((r for r in runs if (r["alpha"], r["seed"]) == (0.1, 0)), measured[0])
    target.write_text(json.dumps({**headline, "authors": AUTHORS, "runs": runs,
                                  "accuracy_before_after": accuracy}, indent=1))
    print(f"saved {target}")


if __name__ == "__main__":
    main()
