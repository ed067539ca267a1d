"""The App's simulation on a Ray cluster that already runs (``ray start --head``), as on a
cluster of several machines: the simulation attaches to it through ``RAY_ADDRESS`` instead of
starting a Ray instance of its own (docs/configuration/running.md, "A Ray cluster")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FLOWER_PROCESSES, LAUNCH_TIMEOUT_S

from fedfusion.app.launch import free_port, launch
from fedfusion.app.processes import ProcessTracker

pytestmark = FLOWER_PROCESSES  # run apart from the other tests (conftest.py)

RAY = Path(sys.executable).parent / "ray"


@pytest.fixture
def ray_head(tmp_path):
    """A one-machine Ray cluster (2 CPUs), stopped afterwards; yields its address."""
    port = free_port()
    started = subprocess.run(
        [str(RAY), "start", "--head", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats"],
        capture_output=True, text=True, timeout=120, check=False)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(RAY), "stop", "--force"], capture_output=True, timeout=120,
                       check=False)


def test_the_simulation_runs_on_an_existing_ray_cluster(ray_head, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    tracker = ProcessTracker()
    results = launch(f"strategy=ensemble num-clients=2 local-epochs=10 train-subset=2000 alpha=10 "
                     f"output-dir='{tmp_path}' run-name=on-cluster",
                     timeout=LAUNCH_TIMEOUT_S, tracker=tracker)
    assert results["status"] == "ok" and not results["excluded"], results["excluded"]
    assert results["test"]["accuracy"] > 0.5  # 2 clients of 1,000 near-iid rows, 10 epochs
    # the clients ran, and no Ray instance was started by the launch: its processes hold
    # no raylet or GCS server, so the actors ran under the cluster's raylet
    commands = tracker.commands()
    assert any("flwr-simulation" in c or "flower-superlink" in c for c in commands)
    assert not [c for c in commands if "raylet" in c or "gcs_server" in c], commands
    status = subprocess.run([str(RAY), "status", f"--address={ray_head}"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr  # the cluster outlived the run
