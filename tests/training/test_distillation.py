"""``distill``: one network out of any fused predictor (fedfusion.distillation).

The loss and one optimiser step against hand computation, the real-data gain over FedAvg of
the same uploads (and the distance to the ensemble teacher), determinism and the caller's
RNG, bad values, the run config and results.json of a replay."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedfusion.app.config import ConfigError, Settings
from fedfusion.app.replay import replay
from fedfusion.core.evaluation import Labelled
from fedfusion.core.fusion import Fusion
from fedfusion.core.predictors import Ensemble, ModelSpec
from fedfusion.distillation import DistillOptions, augment, distil, kd_loss, mixup
from fedfusion.strategies import FedAvg, UniformEnsemble
from fedfusion.strategies.predictors import load_predictor
from fedfusion.wire import ClientUpload

REPO = Path(__file__).resolve().parents[2]
TINY = ModelSpec("mlp", (1, 4, 4), 3, {"hidden_layers": 1, "hidden": 6})



class LogSoftmaxLinear(nn.Module):
    """A teacher: log-probabilities of a fixed linear map."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.fc = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc(x), 1)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


# ------------------------------------------------------------------ (a) the math
@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_loss_is_t_squared_kl_and_one_step_matches_hand_computation(temperature):
    """L = T^2 mean_i sum_j p_t,ij log(p_t,ij / p_s,ij) with p = softmax(./T) of the teacher's
    LOG-PROBABILITIES and the student's logits; for a linear student s = W x its gradient is
    dL/dW = T/B sum_i (p_s,i - p_t,i) x_i^T, so one SGD step is W - lr T/B (P_s - P_t)^T X."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    w_t = torch.randn(3, 4, generator=g, dtype=torch.float64)
    w_s = torch.randn(3, 4, generator=g, dtype=torch.float64)
    log_t = torch.log_softmax(x @ w_t.T, 1)
    pt = softmax(log_t.numpy() / temperature)
    ps = softmax((x @ w_s.T).numpy() / temperature)
    by_hand = temperature**2 * np.mean(np.sum(pt * np.log(pt / ps), 1))
    student = nn.Linear(4, 3, bias=False).double()
    with torch.no_grad():
        student.weight.copy_(w_s)
    loss = kd_loss(log_t, student(x), temperature)
    np.testing.assert_allclose(loss.item(), by_hand, rtol=1e-12)
    # the teacher as logits or as log-probabilities: the same loss (log_softmax is invariant)
    np.testing.assert_allclose(kd_loss(x @ w_t.T, student(x), temperature).item(), by_hand,
                               rtol=1e-12)
    lr = 0.5
    optimiser = torch.optim.SGD(student.parameters(), lr=lr)
    loss.backward()
    optimiser.step()
    expected = w_s.numpy() - lr * temperature / len(x) * (ps - pt).T @ x.numpy()
    np.testing.assert_allclose(student.weight.detach().numpy(), expected, rtol=1e-10)
    assert float(kd_loss(log_t, log_t, temperature).abs()) < 1e-12


def test_one_distillation_step_is_one_adam_step_on_the_loss():
    """distil(epochs=1) with the batch holding all of val and no augmentation takes one Adam
    step from the start: W - lr * g / (|g| + eps) (bias-corrected first step), g = dL/dW as
    above; the trace's validation scores are those of the start and the hand-stepped student,
    and the student kept is the one they select (here the stepped one)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g)
    y = torch.randint(3, (16,), generator=g)
    teacher = LogSoftmaxLinear(torch.randn(3, 4, generator=g))
    student = nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        student.weight.copy_(torch.randn(3, 4, generator=g))
    w0 = student.weight.detach().double().numpy().copy()
    options = DistillOptions("val", epochs=1, lr=0.01, temperature=2.0, batch_size=16,
                             augment=False)
    result = distil(teacher, student, Labelled(x, y), options)
    with torch.no_grad():
        pt = softmax(teacher(x).double().numpy() / 2.0)
    ps = softmax(x.double().numpy() @ w0.T / 2.0)
    grad = 2.0 / 16 * (ps - pt).T @ x.double().numpy()
    stepped = w0 - 0.01 * grad / (np.abs(grad) + 1e-8)

    def score(w: np.ndarray) -> tuple[float, float]:
        log_probs = torch.log_softmax(x.double() @ torch.from_numpy(w).T, 1)
        return (float((log_probs.argmax(1) == y).double().mean()),
                float(torch.nn.functional.nll_loss(log_probs, y)))

    (acc0, nll0), (acc1, nll1) = score(w0), score(stepped)
    trace = result.report["trace"]
    assert [e["epoch"] for e in trace] == [0, 1]
    assert [e["val_accuracy"] for e in trace] == pytest.approx([acc0, acc1])
    np.testing.assert_allclose([e["val_nll"] for e in trace], [nll0, nll1], rtol=1e-5)
    np.testing.assert_allclose(trace[0]["kd_loss"] if "kd_loss" in trace[0] else 0.0, 0.0)
    # validation keeps the better of the two by (accuracy, -NLL), the start on a tie; by hand
    # the step wins here (measured: accuracy 25% both, NLL 2.2638 against 2.2770), so the
    # student returned must be the stepped one, not the start
    keeps_step = (acc1, -nll1) > (acc0, -nll0)
    assert keeps_step, (acc0, nll0, acc1, nll1)
    kept = result.student.weight.detach().double().numpy()
    np.testing.assert_allclose(kept, stepped, atol=1e-6, rtol=0)
    assert result.report["best"]["epoch"] == 1


def test_augmentation_shifts_images_and_mixes_a_fraction_of_the_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 28, 28, generator=g)
    shifted = augment(x, DistillOptions("val", mixup=0.0), torch.Generator().manual_seed(0))
    assert shifted.shape == x.shape
    # each image is its replicate-padded self cropped at an offset within 3 pixels (28 // 8)
    padded = torch.nn.functional.pad(x, (3, 3, 3, 3), mode="replicate")
    for i in range(8):
        offsets = [(dy, dx) for dy in range(7) for dx in range(7)
                   if torch.equal(padded[i, :, dy:dy + 28, dx:dx + 28], shifted[i])]
        assert offsets, i
    assert not torch.equal(shifted, x)
    mixed = mixup(x, 0.5, torch.Generator().manual_seed(0))
    unchanged = (mixed == x).flatten(1).all(1)
    assert 16 < int(unchanged.sum()) < 48  # about half the rows are mixed
    assert torch.equal(mixup(x, 0.0, torch.Generator().manual_seed(0)), x)


# ------------------------------------------------------------------ (b) real data
def test_ensemble_distilled_on_val_beats_fedavg_and_nears_its_teacher(fmnist_split, one_thread):
    """The shared 3-client real FMNIST uploads (conftest.fmnist_split) replayed into the
    uniform ensemble with distill='val' (30 epochs over the 300 validation images, shifts +
    mixup): ONE LeNet whose test accuracy beats the FedAvg of the same uploads (the lazy
    one-network answer, and the student's start) by 8 points and is within 3 points of the
    ensemble teacher (the other lazy answer, several networks). Measured: student 63.85%,
    teacher 64.18%, FedAvg 50.85%."""
    results = fmnist_split.replay("ensemble", distill="val")
    fedavg = fmnist_split.replay("fedavg")
    student = load_predictor(f"{results['output_dir']}/predictor.pt")
    assert isinstance(student, Ensemble) and len(student.members) == 1
    assert student.specs[0].name == "lenet"
    accuracy, teacher = results["test"]["accuracy"], results["distill"]["teacher"]["test"]
    print(accuracy, teacher, fedavg["test"])
    assert accuracy >= fedavg["test"]["accuracy"] + 0.08
    assert accuracy >= teacher["accuracy"] - 0.03
    inits = results["distill"]["student_init_val"]
    assert results["distill"]["student_init"] == max(
        inits, key=lambda n: (inits[n]["accuracy"], -inits[n]["nll"]))
    assert results["distill"]["best_epoch"] > 0


# ------------------------------------------------------------------ (c) determinism, RNG
def tiny_upload(seed: int, client_id: int) -> ClientUpload:
    torch.manual_seed(seed)
    state = {k: v.numpy().copy() for k, v in TINY.build().state_dict().items()}
    return ClientUpload(client_id, TINY.name, TINY.kwargs, 40 + client_id,
                        [{"weights": state}])


def tiny_val(n: int = 48) -> Labelled:
    g = torch.Generator().manual_seed(5)
    return Labelled(torch.randn(n, *TINY.input_shape, generator=g),
                    torch.randint(3, (n,), generator=g))


@pytest.mark.parametrize("mode", ["val", "synthetic"])
def test_distillation_is_deterministic_and_leaves_the_callers_rng(mode):
    uploads = [tiny_upload(s, s) for s in range(3)]
    states, traces = [], []
    for seed in (4, 4, 5):
        torch.manual_seed(123)
        before = torch.random.get_rng_state()
        strategy = UniformEnsemble(TINY, val=tiny_val(), seed=seed, device="cpu",
                                   distill=mode, distill_epochs=3)
        predictor = strategy.fuse_uploads(uploads)
        assert torch.equal(torch.random.get_rng_state(), before)
        assert isinstance(predictor, Ensemble) and len(predictor.members) == 1
        teacher = strategy.distill_teacher
        assert isinstance(teacher, Ensemble) and len(teacher.members) == 3
        report = strategy.distill_report
        assert report["options"]["mode"] == mode and len(report["trace"]) == 4
        assert set(report["teacher_val"]) == set(report["student_val"]) == {"accuracy", "nll"}
        states.append(predictor.members[0].state_dict())
        traces.append(report["trace"])
    for name in states[0]:
        torch.testing.assert_close(states[0][name], states[1][name], rtol=0, atol=0)
    assert traces[0] == traces[1]
    # seed 5 trains on other batches (the best iterate may still be the shared start)
    assert [e.get("kd_loss") for e in traces[0]] != [e.get("kd_loss") for e in traces[2]]


def brute_force_score(model: nn.Module, val: Labelled) -> tuple[float, float]:
    with torch.no_grad():
        logits = model.eval()(val.x)
    return (float((logits.argmax(1) == val.y).float().mean()),
            float(torch.nn.functional.cross_entropy(logits, val.y)))


def test_students_start_is_the_best_validated_candidate_and_no_distill_changes_nothing():
    """With 0 epochs the student is its start: of FedAvg and the teacher's two networks, the
    one of highest validation accuracy (ties: lower NLL, then the earlier), scored here by
    hand; without a validation set it is FedAvg."""
    uploads = [tiny_upload(s, s) for s in range(2)]
    fedavg = FedAvg(TINY, device="cpu").fuse_uploads(uploads).members[0]
    members = [TINY.build(u.weights(0)) for u in uploads]
    for val_seed in range(4):  # different validation labels pick different starts
        g = torch.Generator().manual_seed(val_seed)
        val = Labelled(torch.randn(64, *TINY.input_shape, generator=g),
                       torch.randint(3, (64,), generator=g))
        zero = UniformEnsemble(TINY, val=val, device="cpu", distill="val", distill_epochs=0)
        start = zero.fuse_uploads(uploads).members[0]
        named = {"fedavg": fedavg, "teacher network 0": members[0],
                 "teacher network 1": members[1]}
        scores = {name: brute_force_score(model, val) for name, model in named.items()}
        expected = max(named, key=lambda n: (scores[n][0], -scores[n][1], -list(named).index(n)))
        report = zero.distill_report
        assert report["student_init"] == expected
        for name, (accuracy, nll) in scores.items():
            assert report["student_init_val"][name]["accuracy"] == pytest.approx(accuracy)
            assert report["student_init_val"][name]["nll"] == pytest.approx(nll, rel=1e-5)
        for a, b in zip(start.state_dict().values(), named[expected].state_dict().values(),
                        strict=True):
            torch.testing.assert_close(a, b)
    assert all(m.training is False for m in members)
    no_val = UniformEnsemble(TINY, device="cpu", distill="synthetic", distill_epochs=0)
    assert len(no_val.fuse_uploads(uploads).members) == 1
    assert no_val.distill_report["student_init"] == "fedavg"
    plain = UniformEnsemble(TINY, val=tiny_val(), device="cpu")
    assert len(plain.fuse_uploads(uploads).members) == 2 and plain.distill_teacher is None
    assert plain.distill_report == {}


# ------------------------------------------------------------------ (d) bad values
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"distill": "yes"}, "distill must be one of"),
    ({"distill": "val", "distill_epochs": -1}, "distill_epochs must be an int >= 0"),
    ({"distill": "val", "distill_epochs": 2.5}, "distill_epochs must be an int"),
    ({"distill": "val", "distill_lr": 0.0}, "distill_lr must be a finite number > 0"),
    ({"distill": "val", "distill_temperature": math.nan}, "distill_temperature must be"),
    ({"distill": "val", "val": None}, "distill must be 'none' or 'synthetic' without a "
                                      "validation set"),
])
def test_bad_values_are_rejected_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UniformEnsemble(TINY, **{"val": tiny_val(), **kwargs})


@pytest.mark.parametrize(("values", "message"), [
    ({"distill": "yes"}, "'distill' is 'yes'; choose one of none, val, synthetic"),
    ({"distill-epochs": -1}, "'distill-epochs' must be an int >= 0"),
    ({"distill-lr": 0.0}, "'distill-lr' must be a finite number > 0"),
    ({"distill-temperature": -1.0}, "'distill-temperature' must be"),
    ({"distill": "val", "server-validation": False}, "needs server-validation=true"),
])
def test_bad_run_config_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        Settings.from_mapping(values)


def test_constructor_defaults_equal_the_run_config_and_docs_list_every_key():
    settings = Settings().to_mapping()
    parameters = inspect.signature(Fusion.__init__).parameters
    for arg in ("distill", "distill_epochs", "distill_lr", "distill_temperature",
                "distill_augment"):
        assert parameters[arg].default == settings[arg.replace("_", "-")], arg
        doc = (REPO / "docs" / "configuration.md").read_text()
        assert f"| `{arg.replace('_', '-')}` |" in doc, arg


# ------------------------------------------------------------------ (e) results.json
def test_replay_results_carry_the_teachers_and_the_students_numbers(fmnist_split, tmp_path,
                                                                    one_thread, capsys):
    """fedfusion.app.replay.replay(folder, 'ensemble', "distill='val' ..."): results.json's
    ``distill`` holds the teacher's (the uniform ensemble's) and the student's test accuracy
    and NLL, the student's being the run's own ``test``; the summary prints both."""
    results = replay(fmnist_split.uploads, "ensemble",
                     f"distill='val' distill-epochs=3 output-dir='{tmp_path}' run-name=d")
    saved = json.loads((tmp_path / "d" / "results.json").read_text())
    distill = saved["distill"]
    assert distill["mode"] == "val" and distill["options"]["epochs"] == 3
    for who in ("teacher", "student"):
        assert set(distill[who]["test"]) >= {"accuracy", "nll"}
        assert 0 <= distill[who]["val"]["accuracy"] <= 1
    assert distill["student"]["test"] == saved["test"]
    ensemble = fmnist_split.replay("ensemble")  # the teacher, as its own run
    assert distill["teacher"]["test"]["accuracy"] == pytest.approx(ensemble["test"]["accuracy"])
    assert distill["teacher"]["test"]["nll"] == pytest.approx(ensemble["test"]["nll"])
    assert results["status"] == "ok" and len(distill["trace"]) == 4
    out = capsys.readouterr().out
    assert "teacher  test accuracy" in out and "student  test accuracy" in out
