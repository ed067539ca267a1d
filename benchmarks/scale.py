"""FedBEns at 100 clients and beyond: the simulation, the server's cost against C.

FMNIST, LeNet, Kron (T = 0.1, sigma^2 = 0.1), Dirichlet alpha = 0.3, 20 local epochs, 500
server validation rows, seed 0. Stages (each resumable: a finished run is reused):

* ``live``: one ``flwr run`` of FedBEns with C = 100 clients, M = 5 (Ray backend, 2 actors),
  its uploads saved; wall time, the machine's memory in use (MemTotal - MemAvailable, sampled
  every 0.5 s, with the baseline before the launch), the ServerApp process's peak (the
  ``flwr-simulation`` process's ``VmHWM``), the server's fusion time, accuracy. The set
  ``c100_m5_s0_streamed`` is the same run made again once replies streamed as they arrive.
* ``train``: clients that really train, in this process (the App's ClientApp on an
  :class:`~fedfusion.app.inprocess.InProcessGrid`, no Ray) at C = 200 (M = 2) and C = 500
  (M = 1), uploads saved: Ray's per-client overhead is not what this measures.
* ``server``: FedBEns replayed in a fresh process per cell (peak memory = its own
  ``VmHWM``) on the first C clients of an upload set, C = 5 ... 500, in three
  configurations (``SERVER_CONFIGS``): the paper's algorithm (median starts, every run all
  300 steps), the medians with each run stopping once its validation score has not improved
  in 2 evaluations (``server-patience=2``), and the library's defaults (2M clustered starts,
  the same per-run stop); server time, accuracy, the step each run stopped at.
* ``baselines``: at C = 100, FedAvg, the uniform ensemble of all C x M members, and an
  ensemble at FedBEns' inference cost (member 0 of 5 clients: 5 forward passes, as 5 modes).
* ``fleet``: the deployment engine, ``scripts/deploy-local.sh --measure`` with 20 SuperNodes
  on 127.0.0.1 (one FedBEns round, 6,000-sample subset, M = 1, 20 local epochs): wall time,
  the machine's peak memory, every Flower process's peak RSS, the clients that uploaded.
* ``gpu`` (a GPU machine only; not in ``all``): the C = 100, M = 5 run again with the
  clients on the card (``--client-gpus``, each client's share, default 1/16), its time split
  beside the CPU run's (set ``c100_m5_s0_gpu``).
* ``tables``: the table, ``benchmarks/results/scale.json`` and ``scale.png`` (server time
  against C on log-log axes with the fitted slope, accuracy beside it).

    .venv/bin/python benchmarks/scale.py live
    .venv/bin/python benchmarks/scale.py train
    .venv/bin/python benchmarks/scale.py server
    .venv/bin/python benchmarks/scale.py baselines
    .venv/bin/python benchmarks/scale.py fleet
    .venv/bin/python benchmarks/scale.py tables
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import PAPER_ALGORITHM, PAPER_STARTS, REPO, live_run, own_peak_bytes, section_mb

from fedfusion.app.config import Settings  # noqa: E402
from fedfusion.app.inprocess import InProcessGrid  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "scale.json"
OUT = REPO / "outputs" / "bench-scale"
BASE = f"strategy=fedbens hessian-structure=kron alpha=0.3 seed=0 {PAPER_ALGORITHM}"
#: upload set -> (clients, members, how its clients ran)
SETS = {"c100_m5_s0": (100, 5, "flwr run"), "c200_m2_s0": (200, 2, "in-process"),
        "c500_m1_s0": (500, 1, "in-process"),
        # the same run again after replies were streamed to the strategy and to disk
        "c100_m5_s0_streamed": (100, 5, "flwr run"),
        # the C = 100 run on a GPU machine, its clients sharing the card (stage gpu)
        "c100_m5_s0_gpu": (100, 5, "flwr run, GPU clients")}
#: server cells: (upload set, clients replayed)
CELLS = [("c100_m5_s0", c) for c in (5, 10, 20, 40, 100)] + [("c200_m2_s0", 200),
                                                             ("c500_m1_s0", 500)]
#: server configurations: label -> run-config. The paper's algorithm (median starts, every
#: run all 300 steps); the same starts with each run stopping once its validation score has
#: not improved in 2 evaluations; and the library's defaults (clustered starts, 2 x M runs,
#: the same per-run stop)
SERVER_CONFIGS = {"paper": PAPER_ALGORITHM,
                  "median_patience2": f"{PAPER_STARTS} server-patience=2 "
                                      "fedbens-prediction='modes'",
                  "defaults": ""}
SERVER_LABELS = {"paper": "paper's algorithm (300 steps)",
                 "median_patience2": "medians, per-run patience 2",
                 "defaults": "defaults (2M clustered starts, patience "
                             f"{Settings.server_patience})"}


def machine_used_mb() -> float:
    """Memory in use on the whole machine: MemTotal - MemAvailable, MB."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) / 1024


def simulation_peak_mb() -> float:
    """The largest ``VmHWM`` of the running ``flwr-simulation`` processes (the ServerApp's
    process in a simulation; Ray's actors are others), MB; 0 when none runs."""
    peak = 0.0
    for proc in Path("/proc").iterdir():
        try:
            if b"flwr-simulation" not in (proc / "cmdline").read_bytes():
                continue
            status = (proc / "status").read_text()
        except (OSError, ValueError):
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peak = max(peak, int(line.split()[1]) / 1024)
    return peak


class MemorySampler:
    """The peak of :func:`machine_used_mb` while the ``with`` block runs."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.peak, self.baseline = interval, 0.0, machine_used_mb()
        self.serverapp_peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, machine_used_mb())
            self.serverapp_peak = max(self.serverapp_peak, simulation_peak_mb())
            self._stop.wait(self.interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"sets": {}, "cells": []}


def save(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def record_set(results: dict, name: str, run: dict, how: str, wall: float,
               memory: MemorySampler | None) -> None:
    clients, members, _ = SETS[name]
    results["sets"][name] = {
        "clients": clients, "members": members, "clients_ran": how,
        "wall_s": round(wall, 1), "timing": run["timing"],
        "test_accuracy": run["test"]["fedbens"]["accuracy"] if "fedbens" in run["test"]
        else run["test"]["accuracy"],
        "upload_mb_per_client": round(sum(section_mb(str(OUT / name / "uploads")).values())
                                      * members, 3),
        **({"machine_peak_mb": round(memory.peak), "machine_baseline_mb": round(
            memory.baseline)} if memory else {}),
        **({"serverapp_peak_mb": round(memory.serverapp_peak)}
           if memory and memory.serverapp_peak else {}),
    }
    save(results)


def stage_live(results: dict) -> None:
    for name, (clients, members, how) in SETS.items():
        if how != "flwr run":
            continue
        if name in results["sets"] and (OUT / name / "uploads").is_dir():
            print(f"reusing {name}")
            continue
        start = time.perf_counter()
        with MemorySampler() as memory:
            run = live_run(f"{BASE} num-clients={clients} num-members={members}", str(OUT),
                           name)
        record_set(results, name, run, "flwr run", time.perf_counter() - start, memory)


def stage_gpu(results: dict, share: float) -> None:
    """The C = 100 run with every client on the GPU: Flower gives each ClientApp a
    ``share`` of the card (``client-resources-num-gpus``, one CPU each), and
    ``client-device='auto'`` trains there. The time split beside the CPU's."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("stage gpu needs a CUDA device")
    name = "c100_m5_s0_gpu"
    clients, members, how = SETS[name]
    (OUT / name / "results.json").unlink(missing_ok=True)  # a time is measured afresh
    start = time.perf_counter()
    with MemorySampler() as memory:
        run = live_run(f"{BASE} num-clients={clients} num-members={members}", str(OUT), name,
                       federation={"client-resources-num-gpus": share,
                                   "client-resources-num-cpus": 1})
    record_set(results, name, run, how, time.perf_counter() - start, memory)
    devices = sorted({str(c.get("device")) for c in run["clients"]})
    results["sets"][name].update({"gpu": torch.cuda.get_device_name(0),
                                  "client_gpu_share": share, "client_devices": devices})
    save(results)
    print("| phase | 2-core CPU, s | GPU, s |\n|---|---|---|")
    cpu = results["sets"].get("c100_m5_s0", {})
    def seconds(row: dict, key: str | None) -> str:
        value = row.get("wall_s") if key is None else row.get("timing", {}).get(key)
        return "-" if value is None else f"{value:.1f}"

    for label, key in (("whole run", None), ("client phase", "client_round_s"),
                       ("server fusion", "server_fuse_s"), ("evaluation", "server_eval_s")):
        print(f"| {label} | {seconds(cpu, key)} | {seconds(results['sets'][name], key)} |")
    print(f"client devices: {devices}")


def stage_train(results: dict) -> None:
    for name, (clients, members, how) in SETS.items():
        if how != "in-process" or (name in results["sets"]
                                   and (OUT / name / "uploads").is_dir()):
            continue
        print(f"training {clients} clients x {members} member(s) in process ...", flush=True)
        settings = Settings.from_mapping({
            "strategy": "fedbens", "hessian-structure": "kron", "alpha": 0.3, "seed": 0,
            "fedbens-starts": "median", "server-patience": 0,
            "num-clients": clients, "num-members": members, "output-dir": str(OUT),
            "run-name": name})
        start = time.perf_counter()
        run = run_server(settings, InProcessGrid(settings))
        record_set(results, name, run, how, time.perf_counter() - start, None)


#: one replay in a fresh process, printing its own peak memory
REPLAY = """
import json, sys
sys.path.insert(0, {bench!r})
from common import own_peak_bytes
from fedfusion.app.replay import replay
run = replay({uploads!r}, "fedbens", {config!r})
print("RESULT", json.dumps({{"timing": run["timing"], "test": run["test"],
      "report": {{k: v for k, v in run["strategy_report"].items() if k != "trace"}},
      "peak_mb": own_peak_bytes() / 2**20}}))
"""


def stage_server(results: dict) -> None:
    done = {(c["set"], c["clients"], c["config"]) for c in results["cells"]}
    for name, clients in CELLS:
        if not (OUT / name / "uploads").is_dir():
            print(f"skipping {name}: no uploads (run the live / train stage)")
            continue
        for label, server_config in SERVER_CONFIGS.items():
            if (name, clients, label) in done:
                continue
            total = SETS[name][0]
            subset = "" if clients == total else "replay-clients='{}'".format(
                ",".join(map(str, range(clients))))
            config = (f"{server_config} {subset} output-dir='/tmp/fedfusion-scale' "
                      f"run-name={name}-{clients}-{label}")
            code = REPLAY.format(bench=str(REPO / "benchmarks"),
                                 uploads=str(OUT / name / "uploads"), config=config)
            print(f"server: {name}, C = {clients}, {label} ...", flush=True)
            done_run = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                      text=True, cwd=REPO, check=True)
            line = next(x for x in done_run.stdout.splitlines() if x.startswith("RESULT "))
            run = json.loads(line[len("RESULT "):])
            report = run["report"]
            mixture = report["mixture"]
            cell = {"set": name, "clients": clients, "members": SETS[name][1],
                    "config": label, "starts": report["starts"],
                    "runs": len(report["run_stops"]), "patience": report["patience"],
                    "server_s": round(run["timing"]["server_fuse_s"], 2),
                    "test_accuracy": run["test"]["accuracy"],
                    "stopped_at": report.get("stopped_at"), "run_stops": report["run_stops"],
                    "refreshes": mixture.get("refreshes"),
                    "active_set_changes": mixture.get("active_set_changes"),
                    "server_peak_mb": round(run["peak_mb"])}
            print(f"  {cell['server_s']} s, accuracy {cell['test_accuracy']:.4f}, peak "
                  f"{cell['server_peak_mb']} MB, stopped at {cell['stopped_at']}", flush=True)
            results["cells"].append(cell)
            save(results)


#: baselines replayed on the C = 100 uploads: name -> (strategy, run-config, forward passes)
BASELINES = {
    "fedavg": ("fedavg", "", 1),
    "ensemble_all": ("ensemble", "", 500),
    # the inference cost of FedBEns' 5 modes: member 0 of clients 0-4
    "ensemble_5": ("ensemble", "replay-members=1 replay-clients='0,1,2,3,4'", 5),
}


BASELINE_LABELS = {"fedavg": "FedAvg (member 0)",
                   "ensemble_all": "uniform ensemble of all C x M members",
                   "ensemble_5": "uniform ensemble of 5 members (member 0 of clients 0-4)"}


def stage_baselines(results: dict) -> None:
    uploads = OUT / "c100_m5_s0" / "uploads"
    if not uploads.is_dir():
        print("skipping the baselines: no C = 100 uploads")
        return
    from fedfusion.app.replay import replay
    for name, (strategy, config, passes) in BASELINES.items():
        if name in results.setdefault("baselines_c100", {}):
            continue
        run = replay(str(uploads), strategy, f"{config} output-dir='/tmp/fedfusion-scale' "
                     f"run-name=c100-{name}")
        results["baselines_c100"][name] = {"test_accuracy": run["test"]["accuracy"],
                                           "forward_passes": passes,
                                           "server_s": round(run["timing"]["server_fuse_s"], 2)}
        print(f"{name}: {run['test']['accuracy']:.4f}", flush=True)
        save(results)


#: the deployment engine: SuperNodes on loopback, one FedBEns round
FLEET_CLIENTS = 20
FLEET_CONFIG = (f"strategy=fedbens hessian-structure=kron num-clients={FLEET_CLIENTS} "
                "train-subset=6000 alpha=1.0 val-size=200 local-epochs=20 num-members=1 "
                "server-steps=30 server-threads=1")


def stage_fleet(results: dict) -> None:
    """``scripts/deploy-local.sh --measure`` with FLEET_CLIENTS SuperNodes (a SuperLink, the
    SuperNodes and their ClientApp processes on 127.0.0.1): wall time, the machine's peak
    memory, the Flower processes' peaks, the clients that uploaded, the accuracy."""
    from deploy_client import deploy
    if "fleet" in results:
        print("reusing the fleet run")
        return
    start = time.perf_counter()
    with MemorySampler() as memory:
        run, processes, load = deploy(Path("/tmp/fedfusion-fleet"), FLEET_CONFIG, reuse=False)
    peaks: dict[str, list[float]] = {}
    for proc in processes["processes"]:
        peaks.setdefault(proc["program"], []).append(proc["peak_rss_mb"])
    results["fleet"] = {
        "supernodes": FLEET_CLIENTS, "run_config": FLEET_CONFIG,
        "wall_s": round(time.perf_counter() - start, 1),
        "machine_peak_mb": round(memory.peak), "machine_baseline_mb": round(memory.baseline),
        "load_average_before_after": load,
        "clients_uploaded": len(run["clients"]), "excluded": run["excluded"],
        "test_accuracy": run["test"]["accuracy"],
        "client_round_s": run["timing"].get("client_round_s"),
        "server_fuse_s": run["timing"]["server_fuse_s"],
        "peak_rss_mb_by_program": {k: {"count": len(v), "max": round(max(v)),
                                       "sum": round(sum(v))} for k, v in peaks.items()},
    }
    print(json.dumps(results["fleet"], indent=1))
    save(results)


def loglog_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)


def stage_tables(results: dict) -> None:
    print("| upload set | clients ran | C | M | wall | machine peak | server fuse | test "
          "accuracy | upload MB per client |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in results["sets"].items():
        peak = (f"{row['machine_peak_mb'] / 1024:.2f} GiB (baseline "
                f"{row['machine_baseline_mb'] / 1024:.2f})" if "machine_peak_mb" in row else "-")
        print(f"| {name} | {row['clients_ran']} | {row['clients']} | {row['members']} | "
              f"{row['wall_s']:.0f} s | {peak} | {row['timing']['server_fuse_s']:.1f} s | "
              f"{100 * row['test_accuracy']:.2f} | {row['upload_mb_per_client']:.2f} |")
    print()
    print("| C | M | " + " | ".join(f"{SERVER_LABELS[k]}: server s | accuracy"
                                     for k in SERVER_CONFIGS) + " | server peak MB |")
    print("|---|---|" + "---|---|" * len(SERVER_CONFIGS) + "---|")
    cells = {(c["clients"], c["config"]): c for c in results["cells"]}
    for clients in sorted({c for c, _ in cells}):
        row = [cells.get((clients, k)) for k in SERVER_CONFIGS]
        if None in row:
            continue
        print(f"| {clients} | {row[0]['members']} | " + " | ".join(
            f"{c['server_s']:.1f} | {100 * c['test_accuracy']:.2f}" for c in row)
            + f" | {max(c['server_peak_mb'] for c in row)} |")
    fedbens = cells.get((100, "paper"))
    if results.get("baselines_c100") and fedbens:
        print()
        print("| method (C = 100) | forward passes per input | test accuracy |")
        print("|---|---|---|")
        print(f"| FedBEns, the paper's algorithm: 5 modes | 5 | "
              f"{100 * fedbens['test_accuracy']:.2f} |")
        defaults = cells.get((100, "defaults"))
        if defaults:
            print(f"| FedBEns, the defaults: {defaults['runs']} modes | {defaults['runs']} | "
                  f"{100 * defaults['test_accuracy']:.2f} |")
        for name, row in results["baselines_c100"].items():
            print(f"| {BASELINE_LABELS[name]} | {row['forward_passes']} | "
                  f"{100 * row['test_accuracy']:.2f} |")
    slopes = {}
    for label in SERVER_CONFIGS:
        points = [(c["clients"] * c["members"], c["server_s"]) for c in results["cells"]
                  if c["config"] == label]
        if len(points) >= 2:
            slopes[label] = loglog_slope(points)
            print(f"log-log slope of server time against C x M ({SERVER_LABELS[label]}): "
                  f"{slopes[label]:.2f}")
    results["loglog_slope_vs_components"] = slopes
    save(results)
    plot(results)


def plot(results: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in SERVER_LABELS.items():
        cells = sorted((c for c in results["cells"] if c["config"] == key),
                       key=lambda c: c["clients"])
        xs = [c["clients"] for c in cells]
        left.loglog(xs, [c["server_s"] for c in cells], "o-", label=label)
        right.semilogx(xs, [100 * c["test_accuracy"] for c in cells], "o-", label=label)
    left.axhline(60, color="grey", ls=":", label="60 s target")
    left.set(xlabel="clients C (M = 5 up to 100, 2 at 200, 1 at 500)",
             ylabel="FedBEns server fusion, s (2 cores)")
    right.set(xlabel="clients C", ylabel="test accuracy %")
    left.set_ylim(bottom=0.5)  # room for the legend below the curves
    for axis, corner in ((left, "lower right"), (right, "lower left")):
        axis.legend(loc=corner, fontsize="small")
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS.with_suffix(".png"), dpi=120)
    print(f"wrote {RESULTS.with_suffix('.png')}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=("live", "train", "server", "baselines", "fleet",
                                          "tables", "all", "gpu"))
    parser.add_argument("--client-gpus", type=float, default=1 / 16,
                        help="stage gpu: each client's share of the card "
                             "(client-resources-num-gpus)")
    args = parser.parse_args()
    results = load()
    if args.stage == "gpu":  # a lent GPU machine only: not part of "all"
        stage_gpu(results, args.client_gpus)
        return
    stages = {"live": stage_live, "train": stage_train, "server": stage_server,
              "baselines": stage_baselines, "fleet": stage_fleet, "tables": stage_tables}
    for name, stage in stages.items():
        if args.stage in (name, "all"):
            stage(results)
    print(f"peak of this process: {own_peak_bytes() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
