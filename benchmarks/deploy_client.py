"""What one deployed ClientApp costs: memory, time and upload bytes per member.

Runs ``scripts/deploy-local.sh --measure`` (a real SuperLink and SuperNodes on 127.0.0.1,
Flower's deployment engine) on Fashion-MNIST with LeNet, for a weights-only upload (FedAvg)
and a Kron-curvature upload (FedBEns, ``hessian-structure=kron``), each with M = 1 and M = 3
members per client. Per client it reports:

* peak memory of its ``flwr-clientapp`` process (the SuperNode starts one per run; the
  SuperNode and its SuperExec are separate, long-lived processes, reported as the device's
  baseline): ``VmHWM`` (the kernel's high-water mark of resident pages, shared libraries
  included) and the largest sampled ``RssAnon`` (the process's own heap);
* the ClientApp process's CPU time (user + system, sampled from /proc: what it costs a
  core whatever else the machine runs), and from M = 1 and M = 3 the CPU time per member
  ((cpu(M=3) - cpu(M=1)) / 2) and the fixed part (process start-up, imports, data);
* wall-clock training time per member (``train-time-s / M``) and samples/s, and the time of
  the extra upload section per member (Kron factors), from ``results.json``;
* upload bytes per member: the arrays' bytes (``upload_mb`` / M; Flower's message framing
  adds little on top).

Setup: 2 SuperNodes (clients), IID split of the 59,500-sample training pool (29,750 each),
1 local epoch (time per member scales with epochs: the App's default is 20), one torch
thread per client, server 30 FedBEns steps on one thread (the server is not measured here).
The two ClientApps share the machine's 2 cores, and other jobs may too: the JSON records the
load average around each run; read the wall times as an upper bound on a quiet core, the
CPU times as the cost itself.

    .venv/bin/python benchmarks/deploy_client.py [--out /tmp/deploy-bench] [--reuse]

Prints a markdown table, saves benchmarks/results/deploy_client.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import REPO

SCRIPT = REPO / "scripts" / "deploy-local.sh"
BASE = ("partitioner=iid train-subset=0 local-epochs=1 num-clients=2 server-steps=30 "
        "server-threads=1")
UPLOADS = {"weights": "strategy=fedavg", "kron": "strategy=fedbens hessian-structure=kron"}
MEMBERS = (1, 3)


def deploy(work: Path, run_config: str, reuse: bool
           ) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
    """One measured deployment: (results.json, memory.json, load averages before/after);
    with ``reuse``, those of an earlier run in ``work`` when it has them."""
    files = [work / "outputs" / "deploy-insecure" / "results.json", work / "memory.json",
             work / "load.json"]
    if not (reuse and all(f.is_file() for f in files)):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
        env["PYTHON"] = sys.executable
        load = [os.getloadavg()[0]]
        subprocess.run(["bash", str(SCRIPT), "--measure", "--work-dir", str(work),
                        "--run-config", run_config], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        load.append(os.getloadavg()[0])
        files[2].write_text(json.dumps(load))
    results, memory, load = (json.loads(f.read_text()) for f in files)
    return results, memory, load


def client_rows(upload: str, members: int, results: dict[str, Any], memory: dict[str, Any]
                ) -> list[dict[str, Any]]:
    apps: dict[int, dict[str, Any]] = {}
    for proc in memory["processes"]:
        if proc["program"] == "flwr-clientapp":
            partition = int(dict(item.split("=") for item in proc["node_config"].split())
                            ["partition-id"])
            # the one that worked: a child it forks shows its command line for a moment
            # (seen: 140 MB, 0 CPU s, one sample)
            if partition not in apps or proc["cpu_s"] > apps[partition]["cpu_s"]:
                apps[partition] = proc
    rows = []
    for client in results["clients"]:
        app = apps[client["client_id"]]
        extra = sum(t for s, t in client["section_time_s"].items() if s != "weights")
        rows.append({
            "upload": upload, "members": members, "client": client["client_id"],
            "samples": client["num_examples"],
            "clientapp_peak_rss_mb": app["peak_rss_mb"],
            "clientapp_peak_anon_mb": app["peak_anon_mb"],
            "clientapp_cpu_s": app["cpu_s"],
            "train_s_per_member": client["train_time_s"] / members,
            "samples_per_s": client["num_examples"] * members / client["train_time_s"],
            "extra_section_s_per_member": extra / members,
            "upload_bytes_per_member": round(client["upload_mb"] * 1e6 / members),
        })
    return rows


def cpu_per_member(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per upload kind, from the clients' M = 1 and M = 3 runs (mean over clients): CPU s
    and peak RSS per extra member, and the fixed CPU s of a ClientApp run."""
    lo, hi = MEMBERS
    out = {}
    for upload in UPLOADS:
        def mean(members: int, key: str, upload: str = upload) -> float:
            values = [r[key] for r in rows if r["upload"] == upload and r["members"] == members]
            return sum(values) / len(values)

        per = (mean(hi, "clientapp_cpu_s") - mean(lo, "clientapp_cpu_s")) / (hi - lo)
        out[upload] = {
            "cpu_s_per_member": per,
            "cpu_s_fixed": mean(lo, "clientapp_cpu_s") - lo * per,
            "rss_mb_per_member": (mean(hi, "clientapp_peak_rss_mb")
                                  - mean(lo, "clientapp_peak_rss_mb")) / (hi - lo),
        }
    return out


def baseline(memory: dict[str, Any]) -> dict[str, float]:
    """Largest peak RSS of each long-lived node-side process (SuperNode, its SuperExec)."""
    out: dict[str, float] = {}
    for proc in memory["processes"]:
        if proc["program"] in ("flower-supernode", "flower-superexec") and proc["node_config"]:
            out[proc["program"]] = max(out.get(proc["program"], 0.0), proc["peak_rss_mb"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/deploy-bench"))
    parser.add_argument("--reuse", action="store_true",
                        help="read the runs already under --out instead of running them")
    args = parser.parse_args()
    rows, runs = [], []
    for upload, strategy in UPLOADS.items():
        for members in MEMBERS:
            work = args.out / f"{upload}-m{members}"
            results, memory, load = deploy(work, f"{BASE} {strategy} num-members={members}",
                                           args.reuse)
            rows += client_rows(upload, members, results, memory)
            runs.append({"upload": upload, "members": members, "load_average": load,
                         "node_baseline_peak_rss_mb": baseline(memory),
                         "test_accuracy": results["test"]["accuracy"]})
            print(f"{upload} M={members}: load {load[0]:.1f} -> {load[1]:.1f}", flush=True)
    print("\n| upload | M | client | samples | clientapp peak RSS MB | peak anon MB | "
          "clientapp CPU s | train s/member | samples/s | curvature s/member | "
          "upload bytes/member |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['upload']} | {r['members']} | {r['client']} | {r['samples']} | "
              f"{r['clientapp_peak_rss_mb']:.0f} | {r['clientapp_peak_anon_mb']:.0f} | "
              f"{r['clientapp_cpu_s']:.1f} | {r['train_s_per_member']:.2f} | "
              f"{r['samples_per_s']:.0f} | {r['extra_section_s_per_member']:.2f} | "
              f"{r['upload_bytes_per_member']:,} |")
    per_member = cpu_per_member(rows)
    print("\n| upload | CPU s per member | fixed CPU s per run | memory MB per member |")
    print("|---|---|---|---|")
    for upload, cost in per_member.items():
        print(f"| {upload} | {cost['cpu_s_per_member']:.1f} | {cost['cpu_s_fixed']:.1f} | "
              f"{cost['rss_mb_per_member']:.1f} |")
    for run in runs:
        print(f"{run['upload']} M={run['members']}: SuperNode/SuperExec peak RSS "
              f"{run['node_baseline_peak_rss_mb']}, load {run['load_average']}")
    out = REPO / "benchmarks" / "results" / "deploy_client.json"
    out.write_text(json.dumps({"setup": BASE, "uploads": UPLOADS, "runs": runs, "rows": rows,
                               "per_member": per_member}, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
