"""Integer inputs: a token model, scikit-learn's digits as 64 integer
tokens (pixel intensities 0..16) into an ``nn.Embedding``, wherever inputs travel: the
client's data and sections (weights, diag and Kron curvature, Gram) through the wire format,
the server's validation and test data, evaluation, BatchNorm recalibration, the chance check,
``distill="val"`` (no augmentation), a Flower round through ``client.reply``; DENSE,
Co-Boosting and ``distill="synthetic"`` (generators of float images) refused by design
before anything trains. Bool masks pass through as well.

Measured on these uploads (3 label-skewed clients x 2 members, 500 test rows; one thread):
FedAvg 0.684 (BatchNorm recalibrated on the validation tokens; 0.650 with averaged
statistics), the uniform ensemble 0.884, FedBEns diag 0.814, FedBEns Kron 0.866, RegMean
0.824, AMS 0.874, the ensemble distilled on the validation inputs 0.788; client 0's best
member 0.386. The ensemble and FedBEns must beat FedAvg of the same uploads (and client 0's
model) by :data:`MARGIN`, so a stub returning either fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message
from helpers.digits import TokenNet, split_digits, train
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfusion import client
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.evaluation import as_labelled, evaluate
from fedfusion.strategies import (
    AdaptiveModelSelection,
    CoBoosting,
    Dense,
    FedAvg,
    FedBEns,
    RegMean,
    UniformEnsemble,
)
from fedfusion.wire import decode_upload, encode_models, encode_upload

SECTIONS = ["weights", "curvature.diag", "curvature.kron", "gram"]
#: accuracy floor of every cell: chance (0.10) plus what an untrained network does not reach
FLOOR = 0.3
#: how far the ensemble and FedBEns must be above FedAvg of the same uploads (and client 0's
#: best member): about half the smallest gap measured (FedBEns diag, +0.13)
MARGIN = 0.07
@pytest.fixture(scope="module")
def digits() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return split_digits()


@pytest.fixture(scope="module")
def members(digits) -> list[list[nn.Module]]:
    """Per client, 2 members (seeded inits) trained on its rows."""
    out = []
    for c in range(3):
        x, y = digits[f"client{c}"]
        trained = []
        for m in range(2):
            with torch.random.fork_rng():
                torch.manual_seed(m)
                model = TokenNet()
            trained.append(train(model, x, y, seed=10 * c + m))
        out.append(trained)
    return out


@pytest.fixture(scope="module")
def records(digits, members) -> list:
    """Every section of every member, encoded as Flower records; client 0 hands its data as a
    DataLoader of integer batches, the others as tensors."""
    out = []
    for c in range(3):
        x, y = digits[f"client{c}"]
        data = ((DataLoader(TensorDataset(x, y), batch_size=100), None) if c == 0 else (x, y))
        upload = client.make_upload(members[c], *data, SECTIONS, client_id=c)
        out.append(encode_upload(upload))
    return out


def uploads_for(fuser, records) -> list:
    return [decode_upload(record, c, fuser.context.param_shapes, fuser.required_sections)
            for c, record in enumerate(records)]


def accuracy(predictor: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = data
    with torch.no_grad():
        assert torch.isfinite(predictor(x)).all()
    return evaluate(predictor, x, y)["accuracy"]


@pytest.fixture(scope="module")
def baselines(digits, members, records) -> dict[str, float]:
    """FedAvg of the same uploads and client 0's best member, on the test rows."""
    fedavg = FedAvg(TokenNet, num_members=2, val=digits["val"])
    return {"fedavg": accuracy(fedavg.fuse_uploads(uploads_for(fedavg, records)), digits["test"]),
            "client0": max(accuracy(m, digits["test"]) for m in members[0])}


def test_sections_of_the_embedding_model(records):
    """The Embedding's weight gets a diagonal block in the Kron section (the Linear layers
    their Kron factors), a diagonal in the diag section, no Gram (not a Linear layer)."""
    fuser = FedBEns(TokenNet, num_members=2)
    upload = uploads_for(fuser, records)[0]
    member = upload.members[1]
    kron, diag, gram = member["curvature.kron"], member["curvature.diag"], member["gram"]
    assert kron["emb.weight/ggn_diag"].shape == (17, 4)
    assert kron["hidden.weight/eigvecs_in"].shape == (256, 256)
    assert diag["emb.weight/ggn_diag"].shape == (17, 4)
    assert sorted(gram) == ["head.weight", "hidden.weight"]
    for arrays in (kron, diag, gram):
        assert all(np.isfinite(a).all() for a in arrays.values())
    assert (diag["emb.weight/ggn_diag"] > 0).any() and (kron["emb.weight/ggn_diag"] > 0).any()


#: cell -> (strategy, options); "beats": must beat FedAvg and client 0 by MARGIN
CELLS = {
    "fedavg": (FedAvg, {}),
    "ensemble": (UniformEnsemble, {}),
    "fedbens-diag": (FedBEns, {"hessian_structure": "diag", "steps": 60, "eval_every": 20}),
    "fedbens-kron": (FedBEns, {"hessian_structure": "kron", "steps": 60, "eval_every": 20}),
    "regmean": (RegMean, {}),
    "ams": (AdaptiveModelSelection, {}),
    "ensemble-distill-val": (UniformEnsemble, {"distill": "val", "distill_epochs": 10}),
}
BEATS = {"ensemble", "fedbens-diag", "fedbens-kron"}


@pytest.mark.parametrize("cell", list(CELLS))
def test_every_cell_fuses_the_token_model(cell, digits, records, baselines):
    cls, options = CELLS[cell]
    fuser = cls(TokenNet, num_members=2, val=digits["val"], **options)
    assert fuser.context.val.x.dtype == torch.int64  # kept, not cast to float
    predictor = fuser.fuse_uploads(uploads_for(fuser, records))
    assert fuser.exclusions == []
    acc = accuracy(predictor, digits["test"])
    assert acc >= FLOOR, f"{cell}: {acc:.3f}"
    # the chance check ran on the integer validation data
    assert fuser.chance is not None and not fuser.chance["at_chance"]
    if not fuser.keeps_client_models:  # BatchNorm re-estimated on the integer inputs
        assert fuser.norm_stats == "recalibrate" and fuser.recalibrated_layers > 0
    if cell in BEATS:
        for stub in ("fedavg", "client0"):
            assert acc >= baselines[stub] + MARGIN, (cell, acc, baselines)
    if cell == "ensemble-distill-val":
        report = fuser.distill_report
        assert report["augmented"] is False and "torch.int64" in report["augment_skipped"]


def test_a_flower_round_with_integer_client_data(digits, members):
    """client.reply on integer data inside a Flower round: the same fusion as make_upload."""
    strategy = FedAvg(TokenNet, num_members=2, val=digits["val"], min_train_nodes=3,
                      min_available_nodes=3)

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [10, 11, 12]

    messages = strategy.configure_train(1, encode_models(strategy.initial_models()),
                                        ConfigRecord(), Grid())  # type: ignore[arg-type]
    replies = []
    for c, msg in enumerate(sorted(messages, key=lambda m: m.metadata.dst_node_id)):
        msg.metadata.__dict__["_message_id"] = f"m{c}"  # as the grid's push does
        replies.append(client.reply(msg, members[c], *digits[f"client{c}"], client_id=c))
    assert all(isinstance(r, Message) for r in replies)
    strategy.aggregate_train(1, replies)
    assert strategy.exclusions == [] and len(strategy.uploads) == 3
    assert accuracy(strategy.predictor, digits["test"]) >= FLOOR


@pytest.mark.parametrize("cls", [Dense, CoBoosting])
def test_data_free_generators_refuse_token_models_before_training(cls, digits):
    """By the validation inputs' dtype, or without them by the model's first layer."""
    with pytest.raises(ValueError, match="token ids") as info:
        cls(TokenNet, val=digits["val"])
    assert "torch.int64" in str(info.value) and "distill='val'" in str(info.value)
    with pytest.raises(ValueError, match="module 'emb' \\(Embedding\\)") as info:
        cls(ModelSpec.from_model_fn(TokenNet, input_shape=(64,)))
    assert "distill='val'" in str(info.value)


def test_synthetic_distillation_is_refused_for_integer_inputs(digits):
    with pytest.raises(ValueError, match="cannot generate .*use distill='val'"):
        UniformEnsemble(TokenNet, val=digits["val"], distill="synthetic")


class MaskNet(nn.Module):
    """A bool mask of 8 features in, logits of 2 classes out."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(mask.float())


def test_bool_masks_pass_through():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(300, 8, generator=g) > 0.5
    y = x[:, 0].long()  # whether feature 0 is set: about half the rows
    assert as_labelled((x, y)).x.dtype == torch.bool
    models = []
    for i in range(3):
        with torch.random.fork_rng():
            torch.manual_seed(i)
            model = MaskNet()
        models.append(train(model, x[i::3], y[i::3], seed=i, epochs=40))
    uploads = [client.make_upload([m], x[i::3], y[i::3], ["weights", "gram"], client_id=i)
               for i, m in enumerate(models)]
    for cls in (FedAvg, RegMean):
        fuser = cls(MaskNet, val=(x, y))
        assert accuracy(fuser.fuse_uploads(uploads), (x, y)) > 0.9
    fuser = UniformEnsemble(MaskNet, val=(x, y), distill="val", distill_epochs=2)
    fuser.fuse_uploads(uploads)
    assert fuser.distill_report["augmented"] is False
