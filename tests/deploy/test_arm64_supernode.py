"""The ARM64 SuperNode benchmark (benchmarks/arm64_supernode.py): its FLOP count against a
count by hand, its native-time estimate, and the saved result's consistency. Nothing here
needs emulation: the one test that runs code in the arm64 chroot skips when the chroot
(built by benchmarks/arm64_install.sh, as root) is absent, as it is in CI."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import arm64_supernode  # noqa: E402
from throughput import CONFIG, load_rows, step_flops_per_sample  # noqa: E402

SAVED = REPO / "benchmarks" / "results" / "arm64_supernode.json"
ROOT = Path(os.environ.get("FEDFUSION_ARM64_ROOT", "/srv/arm64"))
#: the torch the chroot gets (PyPI's aarch64 wheels after it are CUDA builds)
TORCH = "2.10.0"


def lenet_flops_by_hand(side: int = 28, classes: int = 10) -> int:
    """Forward + backward FLOPs per sample of the bias-free LeNet (conv5 1->6, pool 2,
    conv5 6->16, pool 2, fc 256->120->84->classes), 2 FLOPs a multiply-add. Backward costs
    each layer its forward again for the weight gradient, and again for the input gradient
    except the first layer's (the images need none)."""
    out1 = side - 4
    conv1 = out1 * out1 * 6 * (1 * 25)
    out2 = out1 // 2 - 4
    conv2 = out2 * out2 * 16 * (6 * 25)
    flat = 16 * (out2 // 2) ** 2
    fc = flat * 120 + 120 * 84 + 84 * classes
    forward = 2 * (conv1 + conv2 + fc)
    return forward + forward + (forward - 2 * conv1)


def test_lenet_flop_count_matches_the_hand_count() -> None:
    x, y = load_rows(CONFIG.batch_size)
    counted = step_flops_per_sample("lenet", (1, 28, 28), x, y)
    assert counted == lenet_flops_by_hand()


def test_native_estimate_scales_with_rows_epochs_and_rate() -> None:
    base = arm64_supernode.estimate(1000, 1, 38.4)
    assert base["flops_per_sample"] == lenet_flops_by_hand()
    assert 0 < base["assumed_share_of_peak"] < 1
    assert base["native_train_s"] == pytest.approx(
        base["flops_per_sample"] * 1000 / (38.4e9 * base["assumed_share_of_peak"]))
    assert arm64_supernode.estimate(2000, 1, 38.4)["native_train_s"] == pytest.approx(
        2 * base["native_train_s"])
    assert arm64_supernode.estimate(1000, 3, 38.4)["native_train_s"] == pytest.approx(
        3 * base["native_train_s"])
    assert arm64_supernode.estimate(1000, 1, 19.2)["native_train_s"] == pytest.approx(
        2 * base["native_train_s"])


def test_saved_result_is_consistent() -> None:
    if not SAVED.is_file():
        pytest.skip(f"{SAVED} not saved yet: run benchmarks/arm64_supernode.py as root")
    saved = json.loads(SAVED.read_text())
    assert saved["machine"] == "aarch64" and saved["host_machine"] == "x86_64"
    # torch 2.10.0: the newest CPU-only aarch64 wheel on PyPI (benchmarks/arm64_install.sh)
    assert saved["chroot"]["torch"].startswith(TORCH) and saved["chroot"]["flwr"] == "1.41.0"
    assert saved["upload_fused"] is True and saved["status"] == "ok"
    fused = {c["node_id"]: c for c in saved["fused_clients"]}
    assert saved["arm64_node_id"] in fused and len(fused) == len(saved["fused_clients"]) >= 2
    arm = fused[saved["arm64_node_id"]]
    assert saved["train_s"] == arm["train_time_s"] > 0
    assert arm["client_id"] == max(c["client_id"] for c in saved["fused_clients"])
    assert not saved["excluded"]
    steps = {s["step"]: s for s in saved["install"]}
    assert {"debootstrap-first", "debootstrap-second", "pip-torch", "pip-flwr"} <= steps.keys()
    assert f"torch=={TORCH}" in steps["pip-torch"]["command"]
    assert "flwr==1.41.0" in steps["pip-flwr"]["command"]
    assert all(s["seconds"] > 0 for s in saved["install"])
    est = saved["estimate"]
    assert est["rows"] == arm["num_examples"]
    assert est["native_train_s"] == pytest.approx(
        est["flops_per_sample"] * est["rows"] * est["epochs"] / (est["sustained_gflops"] * 1e9))


def test_chroot_reports_aarch64_and_its_wheels() -> None:
    if not (ROOT / "opt" / "fedfusion-env" / "bin" / "flower-supernode").exists():
        pytest.skip(f"no arm64 chroot at {ROOT} (benchmarks/arm64_install.sh builds it as "
                    "root); tests never need emulation")
    if os.geteuid() != 0 or not Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists():
        pytest.skip("the arm64 chroot needs root and qemu-aarch64 registered with binfmt_misc")
    inside = arm64_supernode.probe(ROOT)
    assert inside["machine"] == "aarch64"
    assert inside["torch"].startswith(TORCH) and inside["flwr"] == "1.41.0"
    assert inside["torch_cuda"] is False
