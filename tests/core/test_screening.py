"""Robust aggregation: claimed example counts are capped relative to
the other clients, uploads whose weights are far out of line with the others' are screened
out, and a fused model at chance on the validation data says so.

The federations are REAL Fashion-MNIST rows (``conftest.label_skewed_fmnist``: three
label-skewed clients) trained by a user's plain SGD loop, plus one hostile client; every
accuracy is measured on 2,000 real test rows.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import statistics

import numpy as np
import pytest
import torch
from conftest import InProcessGrid, SmallCNN, label_skewed_fmnist, sgd
from flwr.app import Array, Message, MetricRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from torch import nn

from fedfusion import client, evaluate
from fedfusion.app.config import ConfigError, Settings
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.evaluation import as_labelled
from fedfusion.core.screening import (
    CHANCE_MARGIN_MIN,
    NORM_FLOOR,
    cap_num_examples,
    chance_check,
    chance_level,
    chance_margin,
    scaled_histogram,
    screen_weight_norms,
)
from fedfusion.sections import MAX_ABS_WEIGHT
from fedfusion.server_app import run_server
from fedfusion.strategies import (
    AdaptiveModelSelection,
    FedAvg,
    FedBEns,
    Fusion,
    FusionStrategy,
)
from fedfusion.wire import ClientUpload
from fedfusion.wire.format import METRICS_KEY, member_key

HOSTILE = 3  # the hostile client's id; 0, 1, 2 are honest



def from_init(init: dict[str, np.ndarray]) -> SmallCNN:
    model = SmallCNN()
    model.load_state_dict({k: torch.as_tensor(v) for k, v in init.items()})
    return model


@pytest.fixture(scope="module")
def fmnist() -> dict:
    """Three honest label-skewed clients of 300 real rows, trained 3 epochs from the
    strategy's broadcast init; the broadcast init itself; validation and test rows."""
    data = label_skewed_fmnist(300, 300, 2000)
    init = FedAvg(SmallCNN).initial_models()[0]
    honest = []
    for c in range(3):
        x, y = data[f"client{c}"]
        model = from_init(init)
        sgd(model, x, y, epochs=3, seed=c)
        honest.append(client.make_upload([model], x, y, client_id=c))
    return {**data, "init": init, "honest": honest}


def accuracy(predictor: nn.Module, data: dict) -> float:
    return evaluate(predictor, *data["test"])["accuracy"]


def fused(strategy: FusionStrategy, uploads: list[ClientUpload], data: dict) -> float:
    return accuracy(strategy.fuse_uploads(uploads), data)


def free_rider(data: dict, metrics: dict | None = None) -> ClientUpload:
    """A client that trains nothing (uploads the broadcast init) and claims 1e9 examples."""
    x, y = data["client0"]
    upload = client.make_upload([from_init(data["init"])], x, y, client_id=HOSTILE)
    return dataclasses.replace(upload, num_examples=10**9, metrics=metrics or {})


def at_the_cap(data: dict) -> ClientUpload:
    """A client whose every weight is exactly the validation cap, 1e4 (it passes)."""
    x, y = data["client0"]
    upload = client.make_upload([from_init(data["init"])], x, y, client_id=HOSTILE)
    weights = upload.weights(0)
    for name in weights:
        weights[name] = np.full_like(weights[name], MAX_ABS_WEIGHT)
    return upload


# ------------------------------------------------------------------ (a) the count cap
@pytest.mark.parametrize("histogram", ["none", "forged"])
def test_a_claim_of_1e9_examples_is_capped_and_named(fmnist, histogram):
    """Measured: honest-only FedAvg 0.344; with the free-rider capped at 3 x 300 = 900
    examples 0.377; uncapped (num_examples_cap=0) FedAvg is the free-rider's init: 0.096."""
    metrics = {"class-histogram": [10**9] + [0] * 9} if histogram == "forged" else {}
    hostile = free_rider(fmnist, metrics)
    honest_only = fused(FedAvg(SmallCNN, val=fmnist["val"]), fmnist["honest"], fmnist)
    capped = FedAvg(SmallCNN, val=fmnist["val"])
    capped_accuracy = fused(capped, [*fmnist["honest"], hostile], fmnist)
    uncapped = fused(FedAvg(SmallCNN, val=fmnist["val"], num_examples_cap=0),
                     [*fmnist["honest"], hostile], fmnist)
    assert capped_accuracy >= honest_only - 0.05, (capped_accuracy, honest_only)
    assert capped_accuracy >= uncapped + 0.15, (capped_accuracy, uncapped)
    assert capped.capped_claims == [{
        "round": 1, "client_id": HOSTILE, "node_id": None, "claimed": 10**9, "capped_to": 900,
        "median_of_others": 300.0, "factor": 3.0}]
    assert capped.exclusions == []  # capped, not excluded: its model still counts
    # strategy.uploads keeps the uploads as received (the claim); fuse saw the capped count
    assert [u.num_examples for u in capped.uploads] == [300, 300, 300, 10**9]


def test_every_strategy_fuses_the_one_capped_count(fmnist):
    """The cap is applied once, before ``fuse``: a strategy sees only capped counts, and
    FedAvg with the cap equals FedAvg of the same uploads with the count set by hand."""
    seen = []

    class Spy(FedAvg):
        def fuse(self, uploads):
            seen.extend(u.num_examples for u in uploads)
            return super().fuse(uploads)

    hostile = free_rider(fmnist)
    predictor = Spy(SmallCNN).fuse_uploads([*fmnist["honest"], hostile])
    assert seen == [300, 300, 300, 900]
    by_hand = FedAvg(SmallCNN, num_examples_cap=0).fuse_uploads(
        [*fmnist["honest"], dataclasses.replace(hostile, num_examples=900)])
    for ours, theirs in zip(predictor.members[0].state_dict().values(),
                            by_hand.members[0].state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert hostile.num_examples == 10**9  # the caller's upload is not modified


# ------------------------------------------------------------------ (b) the norm screen
@pytest.mark.parametrize("cls", [FedAvg, AdaptiveModelSelection])
def test_weights_at_the_cap_are_screened_out_naming_the_layer_and_client(fmnist, cls):
    """Measured: FedAvg 0.344 honest-only and screened, 0.076 unscreened (test NLL 1.3e5;
    validation accuracy 0.090, chance 0.127 + margin 0.038); AMS 0.570 and 0.093 (the hostile
    model's equal, huge logits win every selection)."""
    hostile = at_the_cap(fmnist)
    honest_only = cls(SmallCNN, val=fmnist["val"])
    honest_accuracy = fused(honest_only, fmnist["honest"], fmnist)
    screened = cls(SmallCNN, val=fmnist["val"])
    assert fused(screened, [*fmnist["honest"], hostile], fmnist) == honest_accuracy
    ((entry),) = screened.exclusions
    assert entry["client"] == str(HOSTILE)
    assert re.fullmatch(
        r"client 3: weights screened out as an outlier: layer (conv|fc)\.(weight|bias): norm "
        r"\S+ is \S+x the clients' median \S+ \(screen_factor 10\); 3 more entries above it",
        entry["reason"]), entry["reason"]
    assert screened.chance is not None and not screened.chance["at_chance"]
    assert honest_only.chance == screened.chance

    unscreened = cls(SmallCNN, val=fmnist["val"], screen_factor=0)
    assert fused(unscreened, [*fmnist["honest"], hostile], fmnist) < 0.15
    assert unscreened.exclusions == []
    assert unscreened.chance is not None and unscreened.chance["at_chance"]
    assert unscreened.chance["chance"] == pytest.approx(chance_level(fmnist["val"][1], 10))


def test_with_two_clients_nothing_is_screened_and_the_report_says_why(fmnist):
    strategy = FedAvg(SmallCNN, val=fmnist["val"])
    strategy.fuse_uploads([fmnist["honest"][0], at_the_cap(fmnist)])
    assert strategy.exclusions == []
    assert strategy.screen_notes == [{"round": 1, "note": (
        "2 client(s): the weight-norm screen needs at least 3 to tell an outlier from the "
        "rest; nothing screened")}]
    assert strategy.chance is not None and strategy.chance["at_chance"]


@pytest.mark.parametrize(("predicted", "at_chance"), [
    ([0, 1, 2, 0], False),  # every row right: not "at chance", however few the rows
    ([0, 0, 0, 0], True),  # the majority class everywhere: chance itself
])
def test_on_a_handful_of_validation_rows_only_no_better_than_chance_is_at_chance(predicted,
                                                                               at_chance):
    """4 rows (majority rate 0.5): chance + margin reaches 1, so the margin cannot apply;
    a perfect fused model was once reported at chance."""
    logits = torch.nn.functional.one_hot(torch.tensor(predicted), 3).float()

    class Fixed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return logits[x.long().view(-1)]

    val = as_labelled((torch.arange(4.0).view(4, 1), torch.tensor([0, 1, 2, 0])))
    check = chance_check(Fixed(), val, torch.device("cpu"))
    assert check["chance"] + check["margin"] >= 1 and check["at_chance"] is at_chance


# ------------------------------------------------------------------ (c) no false positives
def dirichlet_clients(data: dict, num_clients: int, alpha: float, rows: int,
                      seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A Dirichlet(alpha) label split of ``rows`` real training rows (at least 10 a client)."""
    x, y = torch.cat([data[f"client{c}"][0] for c in range(3)]), torch.cat(
        [data[f"client{c}"][1] for c in range(3)])
    x, y = x[:rows], y[:rows]
    rng = np.random.default_rng(seed)
    while True:
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for label in range(10):
            rows_of = rng.permutation(np.flatnonzero(y.numpy() == label))
            cuts = (np.cumsum(rng.dirichlet([alpha] * num_clients))[:-1] * len(rows_of))
            for c, part in enumerate(np.split(rows_of, cuts.astype(int))):
                parts[c] += part.tolist()
        if min(len(p) for p in parts) >= 10:
            return [(x[p], y[p]) for p in parts]


def test_honest_heterogeneous_clients_are_not_screened_out(fmnist):
    """Six Dirichlet(0.1) clients of very different sizes and labels (real rows, 3 epochs
    from one init) plus the three label-skewed ones, at the default factor: nobody is
    excluded and the largest norm ratio stays below half the factor. Measured: sizes 99 to
    300, largest ratio 1.6 (screen_factor 10; on the benchmarks' saved uploads, BatchNorm
    CNN, ResNet-8 and LayerNorm MLP at alpha 0.1 and 0.4, at most 4.1)."""
    uploads = list(fmnist["honest"])
    for c, (x, y) in enumerate(dirichlet_clients(fmnist, 6, 0.1, 900, seed=1), start=10):
        model = from_init(fmnist["init"])
        sgd(model, x, y, epochs=3, seed=c)
        uploads.append(client.make_upload([model], x, y, client_id=c))
    strategy = FedAvg(SmallCNN, val=fmnist["val"])
    strategy.fuse_uploads(uploads)
    assert strategy.exclusions == [] and len(strategy.uploads) == 9
    ratios = reference_screen(uploads, math.inf)[1]
    assert max(ratios.values()) < strategy.screen_factor / 2, ratios
    # and the counts of an honest Dirichlet split are not capped either
    sizes = [u.num_examples for u in uploads]
    assert strategy.capped_claims == [], sizes


def _digits_clients(spec: ModelSpec, parts: list[slice | torch.Tensor], epochs: int,
                    sections: tuple[str, ...] = ("weights",)
                    ) -> tuple[list[ClientUpload], tuple[torch.Tensor, torch.Tensor]]:
    """Clients of scikit-learn's digits (8x8 images) trained by SGD from one init, each on
    its own rows; the last 200 rows are the validation rows."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
    y = torch.tensor(digits.target)
    uploads = []
    for c, rows in enumerate(parts):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = spec.build()
        sgd(model, x[rows], y[rows], epochs=epochs, seed=c, batch_size=32)
        uploads.append(client.make_upload([model.eval()], x[rows], y[rows], list(sections),
                                          client_id=c, model_name=spec.name,
                                          model_kwargs=spec.kwargs))
    return uploads, (x[-200:], y[-200:])


def test_honest_quantity_skew_with_zero_initialised_entries_is_not_screened_out():
    """BatchNorm shifts start at zero, so their norm grows with the steps: with 100 / 100 /
    1,000 rows the largest client's is over 10x the median, which the ratio alone would
    exclude (the review's case: 11.6x, FedAvg 0.357 instead of 0.835). Its RMS stays far
    below the network's typical one: nobody is excluded, and the fusion is the unscreened
    one."""
    spec = ModelSpec("bn_cnn", (1, 8, 8), 10, {"width": 8})
    rows = torch.randperm(1500, generator=torch.Generator().manual_seed(0))
    uploads, val = _digits_clients(spec, [rows[:100], rows[100:200], rows[200:1200]], 2)
    assert max(reference_screen(uploads, math.inf)[1].values()) > 10  # the ratio alone
    screened, unscreened = FedAvg(spec, val=val), FedAvg(spec, val=val, screen_factor=0)
    fused_screened = screened.fuse_uploads(uploads).members[0].state_dict()
    fused_unscreened = unscreened.fuse_uploads(uploads).members[0].state_dict()
    assert screened.exclusions == []
    assert all(torch.equal(fused_screened[k], fused_unscreened[k]) for k in fused_screened)


def test_a_client_that_saw_every_class_is_no_curvature_outlier_among_one_class_clients():
    """Clients of one class grow confident: their curvature vanishes (~1e-12 per example)
    and carries no scale. The client that saw all ten classes was 4e11x "the median" and
    excluded (FedBEns 0.20, at chance, instead of 0.68); now the layer is not screened."""
    digits_y = torch.tensor(load_digits().target[:-200])
    spec = ModelSpec("mlp", (1, 8, 8), 10, {"hidden_layers": 1, "hidden": 32, "bias": True})
    parts = [torch.nonzero(digits_y == 0).ravel()[:100],
             torch.nonzero(digits_y == 1).ravel()[:100], torch.arange(1000, 1300)]
    uploads, val = _digits_clients(spec, parts, 3, ("weights", "curvature.kron"))
    strategy = FedBEns(spec, val=val, steps=30, eval_every=10)
    strategy.fuse_uploads(uploads)
    assert strategy.exclusions == []
    assert any("held by fewer than 3 clients above the floor" in n["note"]
               for n in strategy.screen_notes)


# ------------------------------------------------------------------ (d) the math
def reference_screen(uploads: list[ClientUpload], factor: float
                     ) -> tuple[set[int], dict[int, float]]:
    """Brute force of the documented norm screen: (outlier client ids, each client's largest
    norm / reference ratio). Plain Python loops, ``statistics.median``."""
    def norm(array: np.ndarray) -> float:
        return math.sqrt(sum(float(v) ** 2 for v in array.astype(np.float64).ravel()))

    # the floor's second part: factor x the network's typical entry RMS
    rms = statistics.median([statistics.median([statistics.median([
        norm(a) / math.sqrt(a.size) for a in member["weights"].values()])
        for member in u.members]) for u in uploads])
    outliers, ratios = set(), {}
    for name, array in uploads[0].weights(0).items():
        shape = array.shape
        holders = [u for u in uploads if name in u.weights(0)
                   and u.weights(0)[name].shape == shape]
        if len(holders) < 3:
            continue
        per_client = [statistics.median([norm(m["weights"][name]) for m in u.members])
                      for u in holders]
        reference = statistics.median(per_client)
        for upload in holders:
            for member in upload.members:
                r = norm(member["weights"][name])
                ratio = r / reference if reference > 0 else math.inf
                ratios[upload.client_id] = max(ratios.get(upload.client_id, 0.0), ratio)
                if r > factor * reference and r > max(NORM_FLOOR, factor * rms) * math.sqrt(
                        array.size):
                    outliers.add(upload.client_id)
    return outliers, ratios


def tiny_upload(client_id: int, scales: list[list[float]], seed: int) -> ClientUpload:
    """Members of a 2-entry model ("a": 3x2, "b": 4), entry e of member m drawn N(0, 1) and
    scaled by scales[m][e]."""
    rng = np.random.default_rng(seed)
    members = [{"weights": {"a": (rng.standard_normal((3, 2)) * s[0]).astype(np.float32),
                            "b": (rng.standard_normal(4) * s[1]).astype(np.float32)}}
               for s in scales]
    return ClientUpload(client_id, "Tiny", {}, 10, members)


def test_the_norm_screen_on_a_tiny_example_by_hand():
    """Entry "a" of client 3 is 50x the others'; client 4's member 1 has entry "b" x 20
    (its member 0 is honest: one reference value per client, every member checked)."""
    uploads = [tiny_upload(c, [[1.0, 1.0]], seed=c) for c in range(3)]
    uploads += [tiny_upload(3, [[50.0, 1.0]], seed=3),
                tiny_upload(4, [[1.0, 1.0], [1.0, 20.0]], seed=4)]
    kept, excluded, notes = screen_weight_norms(uploads, 10.0)
    assert [u.client_id for u in kept] == [0, 1, 2] and notes == []
    assert [u.client_id for u, _ in excluded] == [3, 4]
    assert reference_screen(uploads, 10.0)[0] == {3, 4}
    # entry "a": one value per client, the median over its members (client 4: two)
    norm_a = [float(np.median([np.linalg.norm(m["weights"]["a"].astype(np.float64))
                               for m in u.members])) for u in uploads]
    median_a = sorted(norm_a)[2]
    assert excluded[0][1] == (
        f"client 3: weights screened out as an outlier: layer a: norm {norm_a[3]:.3g} is "
        f"{norm_a[3] / median_a:.3g}x the clients' median {median_a:.3g} (screen_factor 10)")
    assert excluded[1][1].startswith("client 4: weights screened out as an outlier: member 1 "
                                     "layer b: norm ")
    # a layer the others hold at zero: a value there is an outlier once its RMS is above
    # factor x the network's typical RMS (here 0.5: "a" ~1, "b" 0), not before
    zeros = [tiny_upload(c, [[1.0, 0.0]], seed=c) for c in range(3)]
    _, excluded, _ = screen_weight_norms([*zeros, tiny_upload(3, [[1.0, 100.0]], seed=3)], 10)
    assert "layer b: norm" in excluded[0][1] and "inf" in excluded[0][1]
    _, excluded, _ = screen_weight_norms([*zeros, tiny_upload(3, [[1.0, 1e-3]], seed=3)], 10)
    assert excluded == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scales=st.lists(st.lists(st.tuples(st.floats(1e-3, 1e3), st.floats(1e-3, 1e3)),
                                min_size=1, max_size=3), min_size=1, max_size=7),
       factor=st.sampled_from([1.0, 2.0, 10.0, 100.0]), common=st.floats(1e-2, 1e2))
def test_the_norm_screen_equals_the_brute_force_reference(scales, factor, common):
    """Any clients (1..7, 1..3 members, entries scaled over 6 decades): the screen keeps and
    excludes exactly what the reference does, and scaling every upload by one constant
    changes nothing (only ratios count)."""
    uploads = [tiny_upload(c, [list(s) for s in member_scales], seed=c)
               for c, member_scales in enumerate(scales)]
    kept, excluded, notes = screen_weight_norms(uploads, factor)
    if len(uploads) < 3:
        assert excluded == [] and len(notes) == 1
        return
    expected, ratios = reference_screen(uploads, factor)
    if any(abs(r / factor - 1) < 1e-5 for r in ratios.values()):
        return  # at the boundary float64 and the reference may round apart
    assert {u.client_id for u, _ in excluded} == expected
    assert [u.client_id for u in kept] == [u.client_id for u in uploads
                                           if u.client_id not in expected]
    scaled = [dataclasses.replace(u, members=[{"weights": {k: v * np.float32(common)
                                                           for k, v in m["weights"].items()}}
                                              for m in u.members]) for u in uploads]
    assert {u.client_id for u, _ in screen_weight_norms(scaled, factor)[1]} == expected


@given(claims=st.lists(st.integers(1, 10**9), min_size=1, max_size=9),
       factor=st.sampled_from([0.0, 1.0, 1.5, 3.0, 10.0]))
def test_the_count_cap_equals_its_definition(claims, factor):
    """n'_c = min(n_c, max(1, floor(k * median of the others))); k = 0 or one client: no cap."""
    uploads = [ClientUpload(c, "Tiny", {}, n, []) for c, n in enumerate(claims)]
    capped, records = cap_num_examples(uploads, factor)
    expected = [n if not factor or len(claims) < 2 else min(n, max(1, math.floor(
        factor * statistics.median(claims[:c] + claims[c + 1:])))) for c, n in enumerate(claims)]
    assert [u.num_examples for u in capped] == expected
    assert [r["client_id"] for r in records] == [c for c, (n, e) in enumerate(
        zip(claims, expected, strict=True)) if n != e]
    assert [u.num_examples for u in uploads] == claims  # inputs untouched


def test_a_capped_count_scales_its_class_histogram():
    """PFNM weights its output layer by the class histograms: a capped client's histogram is
    scaled to its capped count, so a claim of 2e8 examples per class weighs as the cap says
    (3 x the others' median here: half of each class against 3 honest clients), not 99.9999%."""
    honest = [ClientUpload(c, "Tiny", {}, 500, [], {"class-histogram": [100] * 5})
              for c in range(3)]
    liar = ClientUpload(3, "Tiny", {}, 10**9, [], {"class-histogram": [2 * 10**8] * 5})
    capped, records = cap_num_examples([*honest, liar], 3.0)
    assert [r["client_id"] for r in records] == [3]
    assert capped[3].num_examples == 1500 and capped[3].metrics["class-histogram"] == [300] * 5
    assert capped[:3] == honest and liar.metrics["class-histogram"] == [2 * 10**8] * 5
    assert scaled_histogram([1, 1, 1], 4) == [2, 1, 1]
    assert scaled_histogram([7, 0, 3], 5) == [4, 0, 1]  # 3.5 and 1.5: the tie to class 0
    assert scaled_histogram([0, 0], 3) == [0, 0]


def test_a_count_cap_factor_near_floats_range_caps_nothing():
    uploads = [ClientUpload(c, "Tiny", {}, n, []) for c, n in enumerate([10**9, 5, 7])]
    capped, records = cap_num_examples(uploads, 1e306)  # 1e306 x 1e9 is inf as a float
    assert [u.num_examples for u in capped] == [10**9, 5, 7] and records == []


def test_chance_level_and_margin():
    y = torch.tensor([0] * 60 + [1] * 20 + [2] * 20)
    assert chance_level(y, 3) == 0.6  # the majority class beats 1/3
    assert chance_level(torch.arange(10), 10) == pytest.approx(0.1)
    assert chance_margin(0.1, 300) == pytest.approx(2 * math.sqrt(0.09 / 300))
    assert chance_margin(0.1, 10**6) == CHANCE_MARGIN_MIN


def test_the_knobs_are_checked_and_their_defaults_are_the_run_configs():
    assert (Settings().screen_factor, Settings().num_examples_cap) == (10.0, 3.0)
    for arg, value in (("screen_factor", Settings().screen_factor),
                       ("num_examples_cap", Settings().num_examples_cap)):
        assert inspect.signature(Fusion.__init__).parameters[arg].default == value
        with pytest.raises(ValueError, match=f"{arg} must be 0 .off. or a number >= 1, "
                                             "got 0.5"):
            FedAvg(SmallCNN, **{arg: 0.5})
    with pytest.raises(ConfigError, match="run-config 'screen-factor' must be 0"):
        Settings.from_mapping({"screen-factor": -1.0})


# ------------------------------------------------------------------ the App's results
def test_a_run_names_capped_and_screened_clients_and_flags_chance(small_settings, capsys):
    """A live App run of three clients: client 1 claims 1e9 examples (its histogram removed),
    client 2 uploads weights of exactly 1e4. Client 2 is screened out, client 1's claim is
    capped and named in results.json and the summary; a replay of the same uploads without
    the screen is at chance, and says so."""
    settings = small_settings.replace(run_name="robust")

    def tamper(client_index: int, reply: Message) -> Message:
        if client_index == 1:
            metrics = dict(reply.content[METRICS_KEY])
            metrics["num-examples"] = 10**9
            del metrics["class-histogram"]
            reply.content[METRICS_KEY] = MetricRecord(metrics)
        if client_index == 2:
            record = reply.content[member_key(0, "weights")]
            for name in list(record.keys()):
                array = record[name].numpy()
                if array.dtype.kind == "f":
                    record[name] = Array(np.full_like(array, MAX_ABS_WEIGHT))
        return reply

    live = run_server(settings, InProcessGrid(settings, tamper=tamper))
    assert live["status"] == "ok" and live["at_chance"] is False
    (excluded,) = live["excluded"]
    assert excluded["client"] == "node 102" and excluded["reason"].startswith(
        "client 2 (node 102): weights screened out as an outlier: layer ")
    (capped,) = live["capped_claims"]
    assert (capped["client_id"], capped["claimed"]) == (1, 10**9)
    rows = {row["client_id"]: row for row in live["clients"]}
    assert rows[1]["num_examples"] == 10**9  # the claim, as received
    assert rows[1]["num_examples_weighted"] == capped["capped_to"] == 3 * rows[0][
        "num_examples"]
    assert "num_examples_weighted" not in rows[0]
    summary = capsys.readouterr().out
    assert "  capped   client 1 (node 101) claims 1000000000 examples" in summary
    assert "AT CHANCE" not in summary

    replay = run_server(settings.replace(run_name="unscreened", screen_factor=0.0,
                                         replay=f"{live['output_dir']}/uploads"))
    assert replay["excluded"] == [] and replay["at_chance"] is True
    assert replay["chance"]["accuracy"] <= replay["chance"]["chance"] + replay["chance"]["margin"]
    summary = capsys.readouterr().out
    assert "fedfusion OK (AT CHANCE)" in summary and "WARNING  the fused model is at chance" \
        in summary
