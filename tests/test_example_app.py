"""The example App of examples/digits, a Flower App of its own that depends on fedfusion, runs
through `flwr run` from a pip install of fedfusion (not this checkout): FedBEns (Kron, M = 3),
RegMean and AMS against one-shot FedAvg on its own test split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCH_TIMEOUT_S

from fedfusion.app.launch import launch

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """fedfusion installed from this checkout as a wheel into a folder of its own."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(REPO)], check=True)
    assert (site / "fedfusion" / "strategies" / "fedbens.py").is_file()
    assert not (site / "tests").exists() and not (site / "examples").exists()
    return site


def test_the_digits_app_fuses_with_fedfusion_from_a_pip_install(installed, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(installed))
    monkeypatch.chdir(tmp_path)  # this checkout's fedfusion/ is not importable from here
    probe = subprocess.run([sys.executable, "-c", "import fedfusion; print(fedfusion.__file__)"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.startswith(str(installed))
    results = launch(f"output-dir='{tmp_path}' run-name=digits", app_dir=EXAMPLE,
                     timeout=LAUNCH_TIMEOUT_S)
    accuracy = {name: metrics["accuracy"] for name, metrics in results["test"].items()}
    print(json.dumps(accuracy))
    assert not any(results["excluded"].values()), results["excluded"]
    assert accuracy["fedbens"] > accuracy["fedavg"] and accuracy["regmean"] > accuracy["fedavg"]
    assert accuracy["ams"] >= 0.6 and accuracy["fedavg"] >= 0.3, accuracy  # chance: 10%
