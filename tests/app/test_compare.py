"""The README's main job (``python -m fedfusion.app.compare``): one live ``flwr run`` round,
its uploads replayed into other methods, and a table by inference budget."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FLOWER_PROCESSES

from fedfusion.app.compare import compare, method_config, table

pytestmark = FLOWER_PROCESSES  # it starts a SuperLink and a Ray simulation

TINY = "num-clients=2 local-epochs=1 train-subset=600 alpha=1.0 val-size=100"


def test_method_names_map_to_strategies_and_distillation():
    assert method_config("fens") == ("fens", "")
    assert method_config("fedbens-distilled") == ("fedbens", "distill='val'")


def test_one_live_round_replayed_into_every_budget(tmp_path, capsys):
    rows = compare(f"{TINY} strategy=fedbens num-members=2 holdout-fraction=0.1 "
                   f"server-steps=30 output-dir='{tmp_path}' run-name=job",
                   ("fedavg", "ensemble", "fens", "ensemble-distilled", "no-such-strategy"))
    by_method = {r["method"]: r for r in rows}
    assert [r["status"] for r in rows] == ["ok"] * 5 + ["failed"]
    assert "no-such-strategy" in by_method["no-such-strategy"]["error"]
    passes = {m: by_method[m]["forward_passes"] for m in by_method if m != "no-such-strategy"}
    # FedBEns' default runs 2M = 4 clustered starts; 2 clients x 2 members otherwise
    assert passes == {"fedbens": 4, "fedavg": 1, "ensemble": 4, "fens": 4,
                      "ensemble-distilled": 1}
    assert by_method["fens"]["rounds"] > 1 and by_method["fedavg"]["rounds"] == 1
    # FENS' clients receive the 4 models and the aggregator rounds on top of the inits
    assert by_method["fens"]["download_bytes_per_client"] > 2 * by_method["fedavg"][
        "download_bytes_per_client"]
    saved = json.loads((Path(tmp_path) / "job-compare.json").read_text())
    assert [r["method"] for r in saved] == [r["method"] for r in rows]
    printed = capsys.readouterr().out
    assert table(rows) in printed
    lines = table(rows).splitlines()
    assert lines[1].startswith("one network") and "FAILED" in lines[-1]
