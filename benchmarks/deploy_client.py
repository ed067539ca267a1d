"""What one deployed ClientApp costs: memory, time and upload bytes per member (issue 15).

Runs ``scripts/deploy-local.sh --measure`` (a real SuperLink and SuperNodes on 127.0.0.1,
Flower's deployment engine) on Fashion-MNIST with LeNet, for a weights-only upload (FedAvg)
and a Kron-curvature upload (FedBEns, ``hessian-structure=kron``), each with M = 1 and M = 3
members per client. Per client it reports:

* peak memory of its ``flwr-clientapp`` process (the SuperNode starts one per run; the
  SuperNode and its SuperExec are separate, long-lived processes, reported as the device's
  baseline): ``VmHWM`` (the kernel's high-water mark of resident pages, shared libraries
  included) and the largest sampled ``RssAnon`` (the process's own heap);
* training time per member (``train-time-s / M``) and samples/s, the time of the extra
  upload section per member (Kron factors), from ``results.json``;
* upload bytes per member: the arrays' bytes (``upload_mb`` / M; Flower's message framing
  adds little on top).

Setup: 2 SuperNodes (clients), IID split of the 59,500-sample training pool (29,750 each),
1 local epoch (time per member scales with epochs: the App's default is 20), one torch
thread per client, server 30 FedBEns steps on one thread (the server is not measured here).
The two ClientApps share the machine's 2 cores, and other jobs may too: the JSON records the
load average around each run; read the times as an upper bound on a quiet core.

    .venv/bin/python benchmarks/deploy_client.py [--out /tmp/deploy-bench]

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


def deploy(work: Path, run_config: str) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
    """One measured deployment: (results.json, memory.json, load averages before/after)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_")}
    env["PYTHON"] = sys.executable
    load = [os.getloadavg()[0]]
    subprocess.run(["bash", str(SCRIPT), "--measure", "--work-dir", str(work),
                    "--run-config", run_config], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    load.append(os.getloadavg()[0])
    results = json.loads((work / "outputs" / "deploy-insecure" / "results.json").read_text())
    memory = json.loads((work / "memory.json").read_text())
    return results, memory, load


def client_rows(upload: str, members: int, results: dict[str, Any], memory: dict[str, Any]
                ) -> list[dict[str, Any]]:
    apps = {}
    for proc in memory["processes"]:
        if proc["program"] == "flwr-clientapp":
            partition = dict(item.split("=") for item in proc["node_config"].split())
            apps[int(partition["partition-id"])] = proc
    rows = []
    for client in results["clients"]:
        app = apps[client["client_id"]]
        extra = sum(t for s, t in client["section_time_s"].items() if s != "weights")
        rows.append({
            "upload": upload, "members": members, "client": client["client_id"],
            "samples": client["num_examples"],
            "clientapp_peak_rss_mb": app["peak_rss_mb"],
            "clientapp_peak_anon_mb": app["peak_anon_mb"],
            "train_s_per_member": client["train_time_s"] / members,
            "samples_per_s": client["num_examples"] * members / client["train_time_s"],
            "extra_section_s_per_member": extra / members,
            "upload_bytes_per_member": round(client["upload_mb"] * 1e6 / members),
        })
    return rows


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
    args = parser.parse_args()
    rows, runs = [], []
    for upload, strategy in UPLOADS.items():
        for members in MEMBERS:
            work = args.out / f"{upload}-m{members}"
            results, memory, load = deploy(work, f"{BASE} {strategy} num-members={members}")
            rows += client_rows(upload, members, results, memory)
            runs.append({"upload": upload, "members": members, "load_average": load,
                         "node_baseline_peak_rss_mb": baseline(memory),
                         "test_accuracy": results["test"]["accuracy"]})
            print(f"{upload} M={members}: load {load[0]:.1f} -> {load[1]:.1f}", flush=True)
    print("\n| upload | M | client | samples | clientapp peak RSS MB | peak anon MB | "
          "train s/member | samples/s | curvature s/member | upload bytes/member |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['upload']} | {r['members']} | {r['client']} | {r['samples']} | "
              f"{r['clientapp_peak_rss_mb']:.0f} | {r['clientapp_peak_anon_mb']:.0f} | "
              f"{r['train_s_per_member']:.2f} | {r['samples_per_s']:.0f} | "
              f"{r['extra_section_s_per_member']:.2f} | {r['upload_bytes_per_member']:,} |")
    for run in runs:
        print(f"{run['upload']} M={run['members']}: SuperNode/SuperExec peak RSS "
              f"{run['node_baseline_peak_rss_mb']}, load {run['load_average']}")
    out = REPO / "benchmarks" / "results" / "deploy_client.json"
    out.write_text(json.dumps({"setup": BASE, "uploads": UPLOADS, "runs": runs, "rows": rows},
                              indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
