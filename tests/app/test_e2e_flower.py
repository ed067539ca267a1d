"""End to end through `flwr run` on Flower's Ray backend, on real Fashion-MNIST.

One simulation (3 SuperNodes, 2 local epochs, a 9,000-sample real subset, one-shot FedAvg)
then a replay of its uploads into the uniform ensemble, through the same `flwr run` path
and through the replay CLI. Floors: FedAvg one-shot >= 35%, ensemble >= 55% (10% is chance).
One FedBEns simulation (M = 2) whose uploads replay exactly and feed each of the paper's
baselines inside `flwr run` (floors in :data:`BASELINES`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FLOWER_PROCESSES, LAUNCH_TIMEOUT_S

from fedfusion.app.launch import launch
from fedfusion.app.processes import ProcessTracker

pytestmark = FLOWER_PROCESSES  # run apart from the other tests (conftest.py)

REPO = Path(__file__).resolve().parents[2]
COMMON = "num-clients=3 local-epochs=2 train-subset=9000 alpha=1.0 val-size=300"
#: the smallest run that reaches the clients: 2 clients, 1 epoch on 200 rows each
TINY = "num-clients=2 local-epochs=1 train-subset=400 alpha=1.0 val-size=100"


def _assert_nothing_left(tracker: ProcessTracker) -> None:
    """The launch stopped every process it started (only those: other runs on the machine
    do not count), and it did start a SuperLink, so the check is not vacuous."""
    assert any("flower-superlink" in c for c in tracker.commands()), tracker.commands()
    left = {pid: tracker.processes[pid][1] for pid in tracker.alive()}
    assert not left, f"the launcher left processes running: {left}"


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> dict:
    out, tracker = tmp_path_factory.mktemp("flwr"), ProcessTracker()
    results = launch(f"{COMMON} strategy=fedavg output-dir='{out}' run-name=live",
                     timeout=LAUNCH_TIMEOUT_S, tracker=tracker)
    _assert_nothing_left(tracker)
    return results


def test_fedavg_through_flwr_run(live):
    assert live["status"] == "ok" and live["num_clients"] == 3
    assert live["test"]["accuracy"] >= 0.35
    assert len(live["clients"]) == 3 and not live["excluded"]
    assert sum(c["num_examples"] for c in live["clients"]) == 9000
    assert all(c["upload_mb"] > 0.17 for c in live["clients"])  # 44,190 float32 weights
    assert (Path(live["output_dir"]) / "predictor.pt").is_file()


def test_ensemble_replayed_inside_flower_matches_the_cli_replay(live, tmp_path):
    uploads = Path(live["output_dir"]) / "uploads"
    in_flower = launch(f"{COMMON} strategy=ensemble replay='{uploads}' "
                       f"output-dir='{tmp_path}' run-name=flwr-replay", timeout=LAUNCH_TIMEOUT_S)
    assert in_flower["test"]["accuracy"] >= 0.55
    subprocess.run([sys.executable, "-m", "fedfusion.app.replay", str(uploads), "--strategy",
                    "ensemble", "--run-config", f"output-dir='{tmp_path}' run-name=cli"],
                   check=True, cwd=REPO)
    cli = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert cli["test"] == in_flower["test"]


def test_fedavg_replay_equals_the_live_run(live, tmp_path):
    uploads = Path(live["output_dir"]) / "uploads"
    subprocess.run([sys.executable, "-m", "fedfusion.app.replay", str(uploads), "--strategy",
                    "fedavg", "--run-config", f"output-dir='{tmp_path}' run-name=cli"],
                   check=True, cwd=REPO)
    assert json.loads((tmp_path / "cli" / "results.json").read_text())["test"] == live["test"]


def test_a_client_error_under_ray_names_the_original_exception(tmp_path):
    """Flower's Ray backend wraps a ClientApp's exception as
    RayTaskError(ClientAppException); the exclusion still names the ClientApp's own
    ValueError and its message, and keeps the client's traceback. ``curvature-backend`` is
    read only by the clients (after local training), so an unknown one fails each of them."""
    tracker = ProcessTracker()
    with pytest.raises(RuntimeError, match="the run failed") as failed:
        launch(f"{TINY} strategy=fedbens curvature-backend='bogus_ggn' output-dir='{tmp_path}' "
               "run-name=client-error", timeout=LAUNCH_TIMEOUT_S, tracker=tracker)
    _assert_nothing_left(tracker)
    excluded = json.loads((tmp_path / "client-error" / "results.json").read_text())["excluded"]
    assert len(excluded) == 2
    for exclusion in excluded:
        assert exclusion["reason"].startswith("client error: ValueError: unknown backend "
                                              "'bogus_ggn'"), exclusion["reason"]
        assert "RayTaskError" not in exclusion["reason"]
        assert "ClientAppActor" in exclusion["detail"] and "\x1b[" not in exclusion["detail"]
    # the run's own error lists the exclusions by the same root cause
    assert "client error: ValueError: unknown backend 'bogus_ggn'" in str(failed.value)


def test_too_few_supernodes_fail_the_run_naming_the_counts(tmp_path):
    """num-clients=3 on 2 SuperNodes: the round gives up after node-wait-timeout seconds
    instead of waiting forever, and the launcher leaves nothing running."""
    tracker = ProcessTracker()
    with pytest.raises(RuntimeError, match=re.escape(
            "NodeWaitTimeout: [fedavg] round 1: 2 node(s) connected of the 3 required "
            "within 5 s")):
        launch(f"num-clients=3 train-subset=300 val-size=100 node-wait-timeout=5 "
               f"output-dir='{tmp_path}' run-name=few-nodes", num_supernodes=2,
               timeout=LAUNCH_TIMEOUT_S, tracker=tracker)
    _assert_nothing_left(tracker)


def test_a_failed_run_is_reported_as_failed(tmp_path):
    with pytest.raises(RuntimeError, match="failed|no .*results.json"):
        launch(f"{COMMON} strategy=ensemble num-rounds=2 output-dir='{tmp_path}' run-name=bad",
               timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def fedbens_live(tmp_path_factory) -> tuple[dict, Path]:
    """FedBEns live (C=3, M=2, Kron) whose clients also compute the diagonal curvature and
    RegMean's Gram matrices, so its uploads feed every baseline of the paper."""
    out = tmp_path_factory.mktemp("fedbens")
    live = launch(f"{COMMON} strategy=fedbens num-members=2 server-steps=60 "
                  f"extra-sections='curvature.diag,gram' output-dir='{out}' run-name=fedbens",
                  timeout=LAUNCH_TIMEOUT_S)
    return live, out / "fedbens" / "uploads"


def test_fedbens_through_flwr_run_and_its_uploads_replay_exactly(fedbens_live, tmp_path):
    """Floor 60%; the CLI replay of its uploads equals the live run; the same uploads replay
    into FedAvg and the ensemble."""
    live, uploads = fedbens_live
    assert live["test"]["accuracy"] >= 0.60
    assert all(c["num_members"] == 2 for c in live["clients"])
    for strategy, floor in (("fedbens", None), ("ensemble", 0.55), ("fedavg", 0.2)):
        subprocess.run([sys.executable, "-m", "fedfusion.app.replay", str(uploads), "--strategy",
                        strategy, "--run-config",
                        f"server-steps=60 output-dir='{tmp_path}' run-name=r-{strategy}"],
                       check=True, cwd=REPO)
        replayed = json.loads((tmp_path / f"r-{strategy}" / "results.json").read_text())
        if floor is None:
            assert replayed["test"] == live["test"]
        else:
            assert replayed["test"]["accuracy"] >= floor


#: the FedBEns paper's baselines replayed inside `flwr run` from member 0 of the
#: FedBEns uploads, with their run-config changes; each must reach BASELINE_FLOOR (measured:
#: FedFisher 65.3%, RegMean 65.6%, Fisher merging 59.4%, OTFusion and DENSE 59.3%, the
#: member-0 FedAvg they start from 59.3%, the ensemble 66.7%)
BASELINES = {
    "fedfisher": "hessian-structure=kron fedfisher-steps=300",
    "regmean": "",
    "fisher-merge": "",
    "otfusion": "",
    "dense": "dense-epochs=10",
}
BASELINE_FLOOR = 0.50


@pytest.mark.parametrize("strategy", list(BASELINES))
def test_baseline_replayed_through_flwr_run(strategy, fedbens_live, tmp_path):
    live, uploads = fedbens_live
    results = launch(f"{COMMON} strategy={strategy} replay='{uploads}' replay-members=1 "
                     f"{BASELINES[strategy]} output-dir='{tmp_path}' run-name={strategy}",
                     timeout=LAUNCH_TIMEOUT_S)
    assert results["strategy"] == strategy
    assert results["num_members"] == [1, 1, 1]
    assert results["test"]["accuracy"] >= BASELINE_FLOOR


def test_fens_aggregator_rounds_through_flwr_run(tmp_path):
    """FENS live under Ray: the upload round, then aggregator rounds whose clients keep their
    held-out rows' features in Flower's context.state between rounds."""
    results = launch(f"{TINY} strategy=fens num-members=2 fens-rounds=4 fens-patience=0 "
                     f"output-dir='{tmp_path}' run-name=fens", timeout=LAUNCH_TIMEOUT_S)
    assert results["status"] == "ok" and not results["excluded"]
    report = results["strategy_report"]
    assert report["aggregator_rounds"] == 4 and results["cost"]["rounds"] == 5
    assert [t["clients"] for t in report["trace"][1:]] == [2, 2, 2, 2]
    assert results["settings"]["holdout-fraction"] == 0.1
    # the clients held out floor(10%) of their rows (400 in all) and trained on them
    rows = {t["rows"] for t in report["trace"][1:]}
    assert len(rows) == 1 and 38 <= rows.pop() <= 40
    assert results["cost"]["forward_passes"] == 4
