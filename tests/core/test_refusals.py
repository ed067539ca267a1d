"""Refusals before training, and saying what happened (fedfusion.core.model_check, the chance
check, the normalisation-statistics rule in every report).

* A model a strategy cannot fuse by design is refused before anything trains: by the
  strategy's constructor (the two transformers of the zoo: OTFusion cannot align attention or
  an Embedding, PFNM matches MLPs only, DENSE/Co-Boosting/``distill="synthetic"`` cannot
  generate token ids), and, where the server cannot tell (a user's ``model_fn`` without
  validation data), by the client in ``client.initial_models`` and in the built-in ClientApp
  before its first training step (observed: no step runs). Every refusal names the module
  and the alternative.
* Every cell of the token transformer (scikit-learn's digits as 64 integer tokens) either
  fuses to a finite predictor or is refused by design before training.
* The "at chance" warning comes from one place for every strategy: it fires for fused
  results at chance (members that never trained) and not for good ones.
* The BatchNorm-statistics rule in force, and why, is in every strategy's ``report()``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ConfigRecord
from helpers.digits import TokenNet, split_digits
from helpers.digits import train as adam_train

from fedfusion import client
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.model_check import ModelRefused, check_model
from fedfusion.core.state import state_arrays
from fedfusion.flower.train_config import REQUIREMENTS_KEY, STRATEGY_KEY
from fedfusion.strategies import (
    PFNM,
    STRATEGIES,
    Dense,
    FedAvg,
    FisherMerge,
    OTFusion,
    StatisticalWeightAggregation,
    UniformEnsemble,
)
from fedfusion.wire import encode_models

VIT = ModelSpec("vit", (1, 28, 28), 10, {"dim": 16, "layers": 1})
TOKEN = ModelSpec("token_transformer", (64,), 10, {"dim": 16})
#: (strategy, options, model) -> what the refusal must name: the module, the alternative
BY_DESIGN = {
    ("otfusion", "vit"): ("otfusion", {}, VIT, "on the output of module 'embed' (Conv2d)",
                          "FedAvg (strategy 'fedavg') or the ensemble"),
    ("otfusion", "token"): ("otfusion", {}, TOKEN, "module 'embed' (Embedding)",
                            "FedAvg (strategy 'fedavg') or the ensemble"),
    ("pfnm", "vit"): ("pfnm", {}, VIT, "module 'embed' (Conv2d)", "FedAvg ('fedavg')"),
    ("pfnm", "token"): ("pfnm", {}, TOKEN, "module 'embed' (Embedding)", "FedAvg ('fedavg')"),
    ("dense", "token"): ("dense", {}, TOKEN, "module 'embed' (Embedding)", "distill='val'"),
    ("co-boosting", "token"): ("co-boosting", {}, TOKEN, "module 'embed' (Embedding)",
                               "distill='val'"),
    ("ensemble-synthetic", "token"): ("ensemble", {"distill": "synthetic"}, TOKEN,
                                      "module 'embed' (Embedding)", "use distill='val'"),
}


@pytest.fixture(scope="module")
def digits() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return split_digits()


@pytest.mark.parametrize("cell", list(BY_DESIGN), ids=lambda c: "-".join(c))
@pytest.mark.parametrize("with_val", [True, False], ids=["val", "no-val"])
def test_the_server_refuses_by_design_naming_the_module_and_the_alternative(cell, with_val,
                                                                            digits):
    """At construction (nothing has been broadcast, so nothing has trained), with or without
    validation data (without: zeros of the declared input shape, int64 for the Embedding)."""
    name, options, spec, module, alternative = BY_DESIGN[cell]
    val = None
    if with_val:
        val = digits["val"] if spec is TOKEN else (torch.randn(8, 1, 28, 28),
                                                   torch.arange(8) % 10)
    with pytest.raises(ModelRefused) as refused:
        STRATEGIES[name](spec, val=val, **options)
    message = str(refused.value)
    assert module in message and alternative in message, message


class CountingTokenNet(TokenNet):
    """TokenNet whose training is observable: every forward in train mode is counted."""

    train_forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            type(self).train_forwards += 1
        return super().forward(x)


def test_the_client_refuses_what_the_server_could_not_tell_before_training(digits):
    """A server that could not run the model (here: told another architecture than the
    clients run) cannot tell it reads token ids; the client does, on its own inputs, in
    initial_models: no training step runs. (DENSE given a user's model_fn with neither
    validation data nor an input shape is refused on the server: its generator needs one.)"""
    with pytest.raises(ValueError, match="dense generates its inputs, so it needs the model"):
        Dense(CountingTokenNet, min_train_nodes=1, min_available_nodes=1)
    strategy = Dense(ModelSpec.from_model_fn(FloatNet, input_shape=(64,), num_classes=10),
                     min_train_nodes=1, min_available_nodes=1)

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [7]

    with torch.random.fork_rng(devices=[]):
        token_init = encode_models([state_arrays(CountingTokenNet())])
    [msg] = strategy.configure_train(1, token_init, ConfigRecord(), Grid())  # type: ignore[arg-type]
    config = msg.content["config"]
    assert config[STRATEGY_KEY] == "dense" and list(config[REQUIREMENTS_KEY]) == ["float-inputs"]
    x, y = digits["client0"]
    CountingTokenNet.train_forwards = 0

    def user_train() -> None:  # a user's ClientApp body
        for model in client.initial_models(msg, CountingTokenNet, x):
            adam_train(model, x, y, seed=0, epochs=1)

    # (named as the server declared the architecture)
    with pytest.raises(ModelRefused, match=r"dense cannot fuse model 'FloatNet'.*"
                                           r"torch.int64.*module 'emb' \(Embedding\).*"
                                           r"distill='val'"):
        user_train()
    assert CountingTokenNet.train_forwards == 0
    # the same client with float inputs, which the generator can make, is let through
    [msg] = strategy.configure_train(1, encode_models(strategy.initial_models()),
                                     ConfigRecord(), Grid())  # type: ignore[arg-type]
    [model] = client.initial_models(msg, FloatNet, x.float())
    assert isinstance(model, FloatNet)


class FloatNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class NaNNet(FloatNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float("nan")


def test_the_builtin_client_refuses_before_its_first_training_step(monkeypatch, tmp_path):
    """fedfusion's own ClientApp: PFNM's requirement in the train config, a LeNet: refused
    before train_members is called."""
    from fedfusion.app import client_round
    from fedfusion.app.config import Settings

    calls: list[int] = []
    monkeypatch.setattr(client_round, "train_members", lambda *a, **k: calls.append(1) or [])
    settings = Settings(num_clients=2, train_subset=200, local_epochs=1, val_size=50,
                        output_dir=str(tmp_path))
    with pytest.raises(ModelRefused, match=r"pfnm matches MLPs only.*module 'features.0' "
                                           r"\(Conv2d\).*FedAvg \('fedavg'\)"):
        client_round.run_client(settings, 0, [], server_config={
            STRATEGY_KEY: "pfnm", REQUIREMENTS_KEY: ["mlp"]})
    assert calls == []


def test_the_builtin_client_refuses_a_broadcast_that_does_not_fit_its_network(tmp_path):
    """The train config names the node's own architecture (LeNet) but the arrays are an
    MLP's: the App's client refuses them (fedfusion.client.initial_models) rather than
    training fresh inits; a broadcast that names another architecture than the node's
    (per-client architectures) leaves the node to train its own, seeded."""
    from fedfusion.app import client_round
    from fedfusion.app.config import Settings
    from fedfusion.strategies import FedAvg

    settings = Settings(num_clients=2, train_subset=200, local_epochs=1, val_size=50,
                        output_dir=str(tmp_path))
    mlp = FedAvg(ModelSpec("mlp", (1, 28, 28), 10), num_members=1).initial_models()
    with pytest.raises(ValueError, match="the server's member 0 does not fit"):
        client_round.run_client(settings, 0, mlp, server_config={"model": "lenet",
                                                                  "model-kwargs": "{}"})
    own = client_round.run_client(settings, 0, mlp, server_config={"model": "mlp",
                                                                    "model-kwargs": "{}"})
    again = client_round.run_client(settings, 0, [], server_config={})
    assert own.model == "lenet" and own.weights(0).keys() != mlp[0].keys()
    assert all((own.weights(0)[k] == again.weights(0)[k]).all() for k in own.weights(0))


@pytest.mark.parametrize(("model_fn", "problem"), [
    (lambda: torch.nn.Linear(64, 3), "returns 3 scores per input, fewer than the 10 classes"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(64, 10), torch.nn.Unflatten(1, (2, 5))),
     "returns (4, 2, 5), not class scores [4, K]"),
    (NaNNet, "returns NaN or Inf"),
    (lambda: torch.nn.Linear(32, 10), "fails a dry forward on 4 input(s) of shape (64,) and "
                                      "dtype torch.float32"),
])
def test_the_dry_forward_refuses_a_model_that_does_not_run_on_its_inputs(model_fn, problem):
    spec = ModelSpec.from_model_fn(model_fn, input_shape=(64,), num_classes=10)
    with pytest.raises(ModelRefused, match="fedavg: model ") as refused:
        FedAvg(spec)
    assert problem in str(refused.value)


@pytest.mark.parametrize(("labels", "shown"), [(9, "from 0 to 9"), (-1, "from -1 to 2")])
def test_validation_labels_the_model_has_no_score_for_are_refused(labels, shown):
    """A plain ``model_fn`` with fewer outputs than the validation labels need (or a
    negative label) is refused at construction, before any client trains; with enough
    outputs it is taken (the labels may lack a class)."""
    x = torch.randn(12, 64)
    y = torch.arange(12) % 3
    y[0] = labels
    with pytest.raises(ValueError, match=f"validation labels run {shown}, but model "):
        FedAvg(lambda: torch.nn.Linear(64, 5), val=(x, y))
    FedAvg(lambda: torch.nn.Linear(64, 10), val=(x, y.clamp(min=0)))


@pytest.mark.parametrize(("device", "problem"), [
    ("gpu", "is not a torch device"),
    *([] if torch.cuda.is_available() else [("cuda:1", "sees no CUDA device")]),
    *([] if torch.backends.mps.is_available() else [("mps", "has no MPS device")])])
def test_a_device_this_process_lacks_is_refused_at_construction(device, problem):
    with pytest.raises(ValueError, match=f"fedavg: device '{device}' .*{problem}"):
        FedAvg(lambda: torch.nn.Linear(4, 3), device=device)


def test_the_check_leaves_the_rng_and_the_modes_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 3)).train()
    x = torch.randn(10, 4)
    state = torch.get_rng_state()
    checked = check_model(model, x=x, num_classes=3)
    assert checked == {"rows": 4, "dtype": "torch.float32", "output_shape": [4, 3],
                       "requirements": []}
    assert torch.equal(torch.get_rng_state(), state) and all(m.training for m in model.modules())
    with pytest.raises(ValueError, match="unknown model requirement"):
        check_model(model, ["no-such"])


# ------------------------------------------------------------ the token transformer, every cell
@pytest.fixture(scope="module")
def token_uploads(digits) -> list:
    """3 label-skewed clients x 2 token transformers (Adam, 4 epochs), every section the
    clients can compute (Kron and Gram left out where attention's capture fails)."""
    uploads = []
    for c in range(3):
        x, y = digits[f"client{c}"]
        members = []
        for m in range(2):
            with torch.random.fork_rng():
                torch.manual_seed(m)
                members.append(adam_train(TOKEN.build().train(), x, y, seed=10 * c + m,
                                          epochs=4))
        uploads.append(client.make_upload(
            members, x, y, ["weights"], optional_sections=["curvature.diag", "curvature.kron",
                                                           "gram"],
            client_id=c, model_name=TOKEN.name, model_kwargs=TOKEN.kwargs))
    return uploads


#: small server budgets: this checks that every cell fuses or is refused
OPTIONS = {"fedbens": {"steps": 20, "eval_every": 10}, "fedfisher": {"steps": 20},
           }


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_on_the_token_transformer_fuses_or_is_refused_before_training(
        name, digits, token_uploads):
    refused = {cell[0] for cell in BY_DESIGN if cell[1] == "token"}
    if name in refused:
        with pytest.raises(ModelRefused, match="module 'embed' \\(Embedding\\)"):
            STRATEGIES[name](TOKEN, num_members=2, val=digits["val"])
        return
    fuser = STRATEGIES[name](TOKEN, num_members=2, val=digits["val"], **OPTIONS.get(name, {}))
    missing = [s for s in fuser.required_sections if s not in token_uploads[0].members[0]]
    if missing:  # the clients' Kron/Gram capture on attention, another branch's work
        pytest.skip(f"{name} needs {missing}, which the clients could not compute")
    predictor = fuser.fuse_uploads(token_uploads)
    assert fuser.exclusions == []
    with torch.no_grad():
        assert torch.isfinite(predictor(digits["test"][0])).all()
    assert fuser.report()["norm_stats"]["rule"] in ("average", "recalibrate", "client")


# ------------------------------------------------------------------------- chance and norm rule
@pytest.fixture(scope="module")
def bn_uploads(digits) -> dict[str, list]:
    """TokenNet (BatchNorm) uploads with the diagonal curvature: trained members (good) and
    members that never trained (at chance)."""
    out: dict[str, list] = {"good": [], "untrained": []}
    for c in range(3):
        x, y = digits[f"client{c}"]
        for kind in out:
            with torch.random.fork_rng():
                torch.manual_seed(c)
                model = TokenNet()
            model = adam_train(model, x, y, seed=c) if kind == "good" else model.eval()
            out[kind].append(client.make_upload([model], x, y, ["weights", "curvature.diag"],
                                                client_id=c))
    return out


@pytest.mark.parametrize("cls", [FisherMerge, StatisticalWeightAggregation, UniformEnsemble])
def test_the_chance_warning_fires_for_any_strategy_at_chance_and_not_on_a_good_result(
        cls, digits, bn_uploads, caplog):
    """One place (Fusion's chance check) for every strategy; the threshold is chance (0.1 or
    the majority rate) + 2 standard errors on 300 validation rows. Measured on validation:
    trained members fuse to 0.61 (Fisher merging), 0.40 (SWA), 0.85 (ensemble); untrained
    ones stay at chance (SWA 0.093 against chance 0.130 + margin 0.039)."""
    with caplog.at_level(logging.WARNING, logger="fedfusion"):
        fuser = cls(TokenNet, val=digits["val"])
        fuser.fuse_uploads(bn_uploads["untrained"])
    assert fuser.chance is not None and fuser.chance["at_chance"]
    warned = [r.getMessage() for r in caplog.records if "at chance" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"[{cls.name}] round 1: the fused model")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedfusion"):
        fuser = cls(TokenNet, val=digits["val"])
        fuser.fuse_uploads(bn_uploads["good"])
    assert fuser.chance is not None and not fuser.chance["at_chance"]
    assert fuser.chance["accuracy"] > fuser.chance["chance"] + 0.2
    assert not [r for r in caplog.records if "at chance" in r.getMessage()]


def test_the_norm_rule_in_force_is_in_every_report(digits, bn_uploads, caplog):
    """FedAvg (no report of its own) and SWA (its own report) with a validation set:
    recalibrate, the BatchNorm layer re-estimated; without: average; the ensemble: client,
    whatever the validation set (its default_norm_stats says so)."""
    with caplog.at_level(logging.INFO, logger="fedfusion"):
        for cls in (FedAvg, StatisticalWeightAggregation):
            fuser = cls(TokenNet, val=digits["val"])
            before = fuser.report()["norm_stats"]
            assert before == {"rule": "recalibrate", "requested": "auto",
                              "reason": f"auto: {cls.name}'s default with a validation set to "
                                        "re-estimate them on",
                              "running_stat_layers": 1, "recalibrated_layers": 0}
            fuser.fuse_uploads(bn_uploads["good"])
            assert fuser.report()["norm_stats"]["recalibrated_layers"] == 1
    assert any("[fedavg] BatchNorm statistics of the fused model(s): 'recalibrate'"
               in r.getMessage() for r in caplog.records)
    assert "weights" in fuser.report()  # SWA's own entries are kept
    assert FedAvg(TokenNet).report()["norm_stats"]["reason"] == (
        "auto: no validation set to re-estimate them on")
    assert FedAvg(TokenNet, norm_stats="average", val=digits["val"]).report()["norm_stats"][
        "reason"] == "as requested (norm_stats)"
    assert UniformEnsemble.default_norm_stats == "client"
    for val in (None, digits["val"]):
        report = UniformEnsemble(TokenNet, val=val).report()["norm_stats"]
        assert report["rule"] == "client" and "keeps every client model" in report["reason"]


def test_a_strategy_whose_default_rule_contradicts_its_predictor_is_a_type_error():
    with pytest.raises(TypeError, match="default_norm_stats must be 'client' exactly where"):
        type("Broken", (UniformEnsemble,), {"default_norm_stats": "recalibrate"})
    with pytest.raises(TypeError, match="default_norm_stats must be 'client' exactly where"):
        type("Broken", (FedAvg,), {"default_norm_stats": "client"})


def test_pfnm_and_otfusion_still_fuse_what_they_take():
    """The requirements pass the models the strategies are for (no refusal of an MLP)."""
    mlp = ModelSpec("mlp", (1, 6, 6), 5, {"hidden_layers": 1, "hidden": 8})
    assert PFNM(mlp).model_check["requirements"] == ["mlp"]
    assert OTFusion(mlp).model_check["output_shape"] == [4, 5]


class OffsetNet(torch.nn.Module):
    """Float inputs, and an Embedding of the model's own indices (a learnt offset)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = torch.nn.Embedding(1, 10)
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.offset(torch.zeros(len(x), dtype=torch.long))


def test_an_embedding_that_does_not_read_the_input_is_no_token_model():
    """The dtype comes from what the model runs on (float zeros here), not from the first
    module it calls: DENSE takes it; the token model with the same shape is refused."""
    fuser = Dense(ModelSpec.from_model_fn(OffsetNet, input_shape=(64,), num_classes=10))
    assert fuser.model_check["dtype"] == "torch.float32"
    with pytest.raises(ModelRefused, match=r"its inputs are torch.int64 and its first layer, "
                                           r"module 'emb' \(Embedding\)"):
        Dense(ModelSpec.from_model_fn(TokenNet, input_shape=(64,), num_classes=10))


def test_the_summary_prints_the_norm_rule(capsys, digits, bn_uploads):
    """results.json's norm_stats is the report's; the printed summary says it."""
    from fedfusion.app.summary import print_summary

    fuser = FedAvg(TokenNet, val=digits["val"])
    fuser.fuse_uploads(bn_uploads["good"])
    settings = {"strategy": "fedavg", "num-rounds": 1, "dataset": "digits",
                "partitioner": "dirichlet", "alpha": 0.5, "num-clients": 3, "seed": 0}
    print_summary({"settings": settings, "status": "ok", "output_dir": "out",
                   "norm_stats": fuser.report()["norm_stats"]})
    assert ("  norm     BatchNorm statistics 'recalibrate' (auto: fedavg's default with a "
            "validation set to re-estimate them on): 1 of 1 layer(s) re-estimated"
            in capsys.readouterr().out)
