"""Client-side objectives: FedProx's proximal term and MOON's model-contrastive term."""

import math

import numpy as np
import pytest
import torch
from conftest import InProcessGrid, initial_models
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedfusion.app.client_round import handle_train, run_client
from fedfusion.app.config import Settings, build_strategy
from fedfusion.app.local_objective import LocalObjective, previous_key
from fedfusion.contrastive import ContrastiveTerm, model_contrastive_loss, representation_layer
from fedfusion.core.fusion import FusionContext
from fedfusion.core.predictors import ModelSpec
from fedfusion.models import build_model
from fedfusion.server_app import run_server
from fedfusion.strategies.predictors import load_predictor
from fedfusion.training import ProximalTerm, TrainConfig, train_local
from fedfusion.wire import decode_upload, encode_models


def _task(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(256, 1, 4, 4, generator=g), torch.randint(0, 3, (256,), generator=g)


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", (1, 4, 4), 3, hidden_layers=1, hidden=8)


def _distance(a: torch.nn.Module, b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((p - b[k]).pow(2).sum()) for k, p in a.state_dict().items()))


# ----------------------------------------------------------------------------- FedProx
def test_proximal_term_value_and_gradient_by_hand():
    model = _mlp()
    reference = {k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items()}
    term = ProximalTerm(model, mu=0.7, reference=reference)
    value = term(torch.zeros(1))
    value.backward()
    expected = 0.35 * sum(float((p.detach() - reference[k]).pow(2).sum())
                          for k, p in model.named_parameters())
    assert float(value.detach()) == pytest.approx(expected, rel=1e-6)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 0.7 * (p.detach() - reference[k]))


def test_large_mu_keeps_the_local_model_at_the_global_one():
    x, y = _task()
    start = _mlp().state_dict()
    drift = []
    for mu in (0.0, 1.0, 10.0, 100.0):  # lr * mu <= 1: inside SGD-momentum's stable range
        model = _mlp()
        terms = [ProximalTerm(model, mu)] if mu else []
        train_local(model, x, y, TrainConfig(epochs=5, batch_size=32), seed=1, loss_terms=terms)
        drift.append(_distance(model, start))
    assert drift == sorted(drift, reverse=True)
    assert drift[-1] < 0.05 * drift[0]


def test_fedprox_mu_zero_is_fedavg_exactly_and_mu_reaches_the_clients(small_settings):
    """Two rounds through the in-process grid: FedProx(mu=0) == FedAvg bit for bit; a
    positive mu (sent in the train config) changes the result."""
    settings = small_settings.replace(num_rounds=2, local_epochs=1)
    predictors = {}
    for name, strategy, mu in (("fedavg", "fedavg", 0.01), ("prox0", "fedprox", 0.0),
                               ("prox1", "fedprox", 1.0)):
        run = settings.replace(strategy=strategy, prox_mu=mu, run_name=name)
        results = run_server(run, InProcessGrid(run))
        assert results["status"] == "ok" and len(results["rounds"]) == 2
        predictors[name] = load_predictor(f"{settings.output_dir}/{name}/predictor.pt")
    fedavg, prox0, prox1 = (predictors[k].members[0].state_dict()
                            for k in ("fedavg", "prox0", "prox1"))
    assert all(torch.equal(fedavg[k], prox0[k]) for k in fedavg)
    assert any(not torch.equal(fedavg[k], prox1[k]) for k in fedavg)


def test_fedprox_sends_mu_in_the_train_config():
    settings = Settings(strategy="fedprox", prox_mu=0.3, contrastive_weight=2.0)
    strategy = build_strategy(settings, ModelSpec("lenet", (1, 28, 28), 10))
    assert strategy.client_config == {"prox-mu": 0.3, "contrastive-weight": 2.0,
                                      "contrastive-temperature": 0.5}
    assert LocalObjective.from_config(strategy.client_config) == LocalObjective(0.3, 2.0, 0.5)
    with pytest.raises(ValueError, match="'prox-mu' must be a finite number >= 0"):
        LocalObjective.from_config({"prox-mu": -1.0})
    with pytest.raises(ValueError, match="'contrastive-weight' must be a number"):
        LocalObjective.from_config({"contrastive-weight": "1"})


# ------------------------------------------------------------------------- contrastive
def test_contrastive_loss_equals_a_brute_force_computation():
    g = torch.Generator().manual_seed(0)
    z, zg, zp = (torch.randn(5, 7, generator=g, dtype=torch.float64) for _ in range(3))
    tau = 0.5

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(a @ b) / (float(a.norm()) * float(b.norm()))

    brute = np.mean([-math.log(math.exp(cos(z[i], zg[i]) / tau)
                               / (math.exp(cos(z[i], zg[i]) / tau)
                                  + math.exp(cos(z[i], zp[i]) / tau))) for i in range(5)])
    assert float(model_contrastive_loss(z, zg, zp, tau)) == pytest.approx(brute, rel=1e-12)
    # z_prev == z_glob: the constant log 2
    assert float(model_contrastive_loss(z, zg, zg, tau)) == pytest.approx(math.log(2))


def test_contrastive_term_uses_the_representation_before_the_last_linear():
    x, _ = _task()
    batch = x[:6]
    model, global_model, previous = _mlp(0), _mlp(1), _mlp(2)
    assert representation_layer(model) is model.net[-1]
    with ContrastiveTerm(model, global_model.state_dict(), previous.state_dict(), weight=3.0,
                         temperature=0.2) as term:
        model(batch)
        value = term(batch)
    features = [m.net[:-1](batch).detach() for m in (model, global_model, previous)]
    expected = 3.0 * model_contrastive_loss(*features, 0.2)
    torch.testing.assert_close(value.detach(), expected)
    assert not model._forward_hooks and not model.net[-1]._forward_hooks  # hooks removed


def _trained(objective: LocalObjective, previous: list, small_settings) -> dict:
    settings = small_settings.replace(local_epochs=1, train_subset=600)
    inits = initial_models(ModelSpec("lenet", (1, 28, 28), 10), 1, settings.seed)
    config = {key: getattr(objective, name) for key, name in LocalObjective.KEYS.items()}
    state = RecordDict({previous_key(m): ArrayRecord({k: Array(np.ascontiguousarray(v))
                                                      for k, v in model.items()})
                        for m, model in enumerate(previous)})
    return run_client(settings, 0, inits, server_config=config, state=state).weights(0)


def test_contrastive_weight_zero_is_bit_identical_to_plain_training(small_settings):
    previous = [{k: v * 0.5 for k, v in
                 initial_models(ModelSpec("lenet", (1, 28, 28), 10), 1, 99)[0].items()}]
    plain = _trained(LocalObjective(), [], small_settings)
    zero = _trained(LocalObjective(contrastive_weight=0.0), previous, small_settings)
    on = _trained(LocalObjective(contrastive_weight=1.0), previous, small_settings)
    first_round = _trained(LocalObjective(contrastive_weight=1.0), [], small_settings)
    assert all(np.array_equal(plain[k], zero[k]) for k in plain)
    assert all(np.array_equal(plain[k], first_round[k]) for k in plain)  # no previous model
    assert any(not np.array_equal(plain[k], on[k]) for k in plain)
    # the term in the loop with weight 0 (not skipped) is bit-identical too
    x, y = _task()
    models = [_mlp(), _mlp()]
    train_local(models[0], x, y, TrainConfig(epochs=2, batch_size=32), seed=3)
    with ContrastiveTerm(models[1], _mlp(1).state_dict(), _mlp(2).state_dict(), 0.0, 0.5) as t:
        train_local(models[1], x, y, TrainConfig(epochs=2, batch_size=32), seed=3,
                    loss_terms=[t])
    assert all(torch.equal(v, models[1].state_dict()[k]) for k, v in models[0].state_dict().items())


def test_the_previous_local_model_is_kept_in_the_node_state(small_settings):
    settings = small_settings.replace(local_epochs=1, train_subset=600)
    spec = ModelSpec("lenet", (1, 28, 28), 10)
    state = RecordDict()
    content = RecordDict({"arrays": encode_models(initial_models(spec, 1, 0)),
                          "config": ConfigRecord({"server-round": 1, "sections": ["weights"],
                                                  "contrastive-weight": 1.0})})
    msg = Message(content=content, dst_node_id=101, message_type=MessageType.TRAIN)
    context = FusionContext(spec)
    first = decode_upload(handle_train(settings, 1, msg, state).content, 1,
                          context.param_shapes)
    assert first.metrics["contrastive-members"] == 0
    assert isinstance(state[previous_key(0)], ArrayRecord)
    kept = {k: v.numpy() for k, v in state[previous_key(0)].items()}
    assert all(np.array_equal(kept[k], first.weights(0)[k]) for k in kept)
    content["config"]["server-round"] = 2
    second = decode_upload(handle_train(settings, 1, msg, state).content, 1,
                           context.param_shapes)
    assert second.metrics["contrastive-members"] == 1


def test_swa_with_contrastive_clients_over_rounds(small_settings):
    """Through the grid: clients use their previous model from round 2 on."""
    settings = small_settings.replace(strategy="swa", num_rounds=2, local_epochs=1,
                                      contrastive_weight=1.0, run_name="moon")
    spec = ModelSpec("lenet", (1, 28, 28), 10)
    strategy = build_strategy(settings, spec)
    rounds = []
    strategy.start(InProcessGrid(settings), encode_models(initial_models(spec, 1, 0)),
                   num_rounds=2, train_config=ConfigRecord(),
                   evaluate_fn=lambda rnd, arrays: rounds.append(
                       [u.metrics["contrastive-members"] for u in strategy.uploads]))
    assert rounds[1:] == [[0, 0, 0], [1, 1, 1]]  # evaluate_fn runs before round 1 too
