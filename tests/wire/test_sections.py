"""The section table and the upload limits, end to end: a deployment's limits are the ones
its strategy applies to live replies and to fused uploads, and a user's own section goes
through both sides by a table of their own."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import SmallCNN, label_skewed_fmnist, sgd_client_app

from fedfusion import LocalGrid, client
from fedfusion.client import make_upload
from fedfusion.sections import SECTIONS, WEIGHTS, Section
from fedfusion.strategies import FedAvg
from fedfusion.wire import UploadLimits

DATA = label_skewed_fmnist(120, 60, 60)
#: 1100 metrics: above the default cap of 1024
EXTRA = {f"extra-{i}": 1 for i in range(1100)}


def _replies_with_extra_metrics(msg, models, x, y):  # noqa: ANN001, ANN202
    return client.reply(msg, models, x, y, metrics=EXTRA)


def test_a_deployments_limits_apply_to_live_replies():
    app = sgd_client_app(SmallCNN, DATA, reply=_replies_with_extra_metrics)
    refused = FedAvg(SmallCNN, num_clients=3)
    with pytest.raises(RuntimeError, match="0 valid upload"):
        refused.start(LocalGrid(app, num_nodes=3))
    assert len(refused.exclusions) == 3
    for entry in refused.exclusions:
        assert entry["client"].startswith("node ")
        assert entry["reason"] == "metrics must be a mapping of at most 1024 entries"

    raised = FedAvg(SmallCNN, num_clients=3, upload_limits=UploadLimits(metrics=2048))
    raised.start(LocalGrid(app, num_nodes=3))
    assert raised.exclusions == [] and len(raised.uploads) == 3

    upload_bytes = sum(p.numel() * 4 for p in SmallCNN().state_dict().values())
    lowered = FedAvg(SmallCNN, num_clients=3,
                     upload_limits=UploadLimits(metrics=2048, upload_bytes=upload_bytes - 1))
    with pytest.raises(RuntimeError, match="0 valid upload"):
        lowered.start(LocalGrid(app, num_nodes=3))
    assert [e["reason"] for e in lowered.exclusions] == [
        f"the arrays declare more than {upload_bytes - 1} bytes (at least {upload_bytes}), "
        "above the cap on one client's upload (UploadLimits.upload_bytes); refused before "
        "decoding"] * 3


def test_a_deployments_limits_apply_to_fused_uploads():
    x, y = DATA["client0"]
    upload = make_upload([SmallCNN()], x, y, client_id=5, metrics=EXTRA)
    refused = FedAvg(SmallCNN, min_valid_uploads=1)
    with pytest.raises(RuntimeError, match="0 valid upload"):
        refused.fuse_uploads([upload])
    assert refused.exclusions[0]["client"] == "5"
    assert "at most 1024 entries" in refused.exclusions[0]["reason"]
    accepted = FedAvg(SmallCNN, upload_limits=UploadLimits(metrics=2048))
    accepted.fuse_uploads([upload])
    assert accepted.exclusions == []


def test_upload_limits_are_frozen_and_checked():
    limits = UploadLimits()
    assert limits.upload_bytes == 2 * 1024**3 and limits.num_examples == 10**9
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.upload_bytes = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="UploadLimits.metrics must be an int >= 1"):
        UploadLimits(metrics=0)
    with pytest.raises(ValueError, match="upload_limits must be a fedfusion.wire.UploadLimits"):
        FedAvg(SmallCNN, upload_limits={"upload_bytes": 1})  # type: ignore[arg-type]


def _mean_input(model, x, y, options, built):  # noqa: ANN001, ANN202
    """A user's section: the mean client input, one array."""
    return {"mean": x.float().mean(dim=0).numpy()}


def _check_mean(arrays, shapes):  # noqa: ANN001, ANN202
    if set(arrays) != {"mean"}:
        raise ValueError(f"expected one array 'mean', got {sorted(arrays)}")


class NeedsMean(FedAvg):
    required_sections = (WEIGHTS, "mean-input")


def test_a_users_own_section_goes_through_a_table_of_their_own():
    table = {**SECTIONS, "mean-input": Section(_mean_input, _check_mean, value_cap=10.0)}
    x, y = DATA["client0"]
    upload = make_upload([SmallCNN()], x, y, [WEIGHTS, "mean-input"], section_table=table)
    assert upload.members[0]["mean-input"]["mean"].shape == (1, 28, 28)

    with pytest.raises(ValueError, match="cannot compute upload section 'mean-input'"):
        make_upload([SmallCNN()], x, y, [WEIGHTS, "mean-input"])  # the default table lacks it

    fused = NeedsMean(SmallCNN, section_table=table)
    fused.fuse_uploads([upload])
    assert fused.exclusions == [] and len(fused.uploads) == 1

    unknown = NeedsMean(SmallCNN)  # the server's table does not know the section
    with pytest.raises(RuntimeError, match="0 valid upload"):
        unknown.fuse_uploads([upload])
    assert "unknown section 'mean-input'" in unknown.exclusions[0]["reason"]

    upload.members[0]["mean-input"]["mean"] = np.full((1, 28, 28), 11.0, np.float32)
    capped = NeedsMean(SmallCNN, section_table=table)  # the entry's value cap applies
    with pytest.raises(RuntimeError, match="0 valid upload"):
        capped.fuse_uploads([upload])
    assert "above the cap 10 on section 'mean-input'" in capped.exclusions[0]["reason"]
