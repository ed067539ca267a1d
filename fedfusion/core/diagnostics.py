"""What a fusion run reports, as plain data: the per-client table and the run's cost.

:meth:`~fedfusion.core.fusion.Fusion.diagnostics` assembles these with the strategy's
exclusions, screening and report into one dict, the keys results.json holds
(docs/results-format.md); a caller writes it, it reads no strategy attribute itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedfusion.device import DEVICE_METRIC, device_label
from fedfusion.wire import ClientUpload


def client_table(uploads: Sequence[ClientUpload],
                 capped_claims: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """One row per upload; ``num_examples`` is the claim, ``num_examples_weighted`` (only
    where the claim was capped) what every strategy weighted it by."""
    weighted = {c["client_id"]: c["capped_to"] for c in capped_claims}
    return [{
        "client_id": u.client_id,
        # who the server knew it as: the Flower node, the id it claimed (a label where the
        # server decided client_id from the node) and how client_id was decided
        "node_id": u.node_id,
        "claimed_client_id": u.claimed_client_id,
        "client_id_source": u.client_id_source,
        "num_examples": u.num_examples,
        "num_members": u.num_members,
        "model": u.model,
        # where it trained and built its upload ("cpu", "cuda:<i>"; None: not reported)
        "device": device_label(u.metrics.get(DEVICE_METRIC)),
        "class_histogram": u.metrics.get("class-histogram"),
        "train_time_s": float(u.metrics.get("train-time-s", 0.0)),
        "stats_time_s": float(u.metrics.get("stats-time-s", 0.0)),
        # the client's data loading, and its whole handling of the train message
        "load_time_s": float(u.metrics.get("load-time-s", 0.0)),
        "client_time_s": float(u.metrics.get("client-time-s", 0.0)),
        "section_time_s": {k.removeprefix("time-s/"): float(v) for k, v in u.metrics.items()
                           if k.startswith("time-s/")},
        "upload_mb": u.nbytes / 1e6,
        # members trained with the contrastive term (absent when it was off)
        **({"contrastive_members": int(u.metrics["contrastive-members"])}
           if "contrastive-members" in u.metrics else {}),
        **({"num_examples_weighted": weighted[u.client_id]} if u.client_id in weighted else {}),
    } for u in uploads]


def client_timing(clients: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Training seconds summed and at most over the clients' rows, and upload-building
    seconds summed."""
    train = [c["train_time_s"] for c in clients]
    return {"client_train_s_sum": float(np.sum(train)),
            "client_train_s_max": float(np.max(train)) if train else 0.0,
            "client_stats_s_sum": float(np.sum([c["stats_time_s"] for c in clients]))}


def run_cost(uploads: Sequence[ClientUpload], sections: Sequence[str], all_members: bool,
             forward_passes: int, model_bytes: int, num_members: int,
             report: Mapping[str, Any], num_rounds: int = 1) -> dict[str, Any]:
    """What the predictor costs per prediction and what the run cost per client: forward
    passes (networks run per input), the rounds, and the bytes a client receives (the
    ``num_members`` models of ``model_bytes`` every round, plus FENS' aggregator rounds) and
    sends (every round, the ``sections`` of the members the strategy uses: all of them
    where ``all_members``, else the first; a replay's uploads may carry more for other
    strategies)."""
    used = [u.members if all_members else u.members[:1] for u in uploads]
    up = [sum(a.nbytes for m in members for section in sections
              for a in m.get(section, {}).values()) for members in used]
    return {
        "forward_passes": forward_passes,
        "rounds": int(report.get("rounds", num_rounds)),
        "download_bytes_per_client": num_rounds * num_members * model_bytes
        + report.get("aggregator_download_bytes_per_client", 0.0),
        "upload_bytes_per_client": num_rounds * (float(np.mean(up)) if up else 0.0)
        + report.get("aggregator_upload_bytes_per_client", 0.0),
    }
