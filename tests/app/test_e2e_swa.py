"""SWA with contrastive clients through `flwr run` on Flower's Ray backend (about 45 s).

Two rounds, 3 SuperNodes, 2 local epochs (lr 0.05) on a 3,000-image real FMNIST subset.
What only a real Flower run can show: the ClientApp's ``context.state`` keeps each node's
previous local model across rounds, so every client trains with the contrastive term in
round 2. Floor 40% (64.5% when written; 10% is chance).
"""

from __future__ import annotations

import pytest
from conftest import FLOWER_PROCESSES, LAUNCH_TIMEOUT_S

from fedfusion.app.launch import launch

pytestmark = FLOWER_PROCESSES  # run apart from the other tests (conftest.py)


def test_swa_with_contrastive_clients_through_flwr_run(tmp_path):
    results = launch("num-clients=3 local-epochs=2 lr=0.05 train-subset=3000 alpha=1.0 "
                     "val-size=300 strategy=swa num-rounds=2 contrastive-weight=1.0 "
                     f"output-dir='{tmp_path}' run-name=swa", timeout=LAUNCH_TIMEOUT_S)
    assert results["status"] == "ok" and results["strategy"] == "swa"
    assert len(results["rounds"]) == 2 and not results["excluded"]
    assert [c["contrastive_members"] for c in results["clients"]] == [1, 1, 1]
    for weights in results["strategy_report"]["weights"].values():
        assert sum(weights) == pytest.approx(1.0)
    assert results["test"]["accuracy"] > 0.4  # 2 rounds x 2 epochs on 1,000 images per client
