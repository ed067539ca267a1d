"""RegMean and the ``gram`` upload section: Grams against brute force, the merge against
least squares on the pooled inputs, alpha selection, models with BatchNorm, LayerNorm and
embeddings (Gram layers from the module types, the rest averaged), and a real FMNIST
federation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedfusion.core import fusion as fusion_module
from fedfusion.core.evaluation import evaluate
from fedfusion.core.fusion import FusionContext
from fedfusion.core.predictors import ModelSpec
from fedfusion.core.state import weighted_average
from fedfusion.datasets import ImageData
from fedfusion.sections import build_section
from fedfusion.sections.gram import (
    expected_gram_sizes,
    gram_layers,
    layer_grams,
    layer_inputs,
    layout_gram_sizes,
    model_gram_sizes,
    validate_grams,
)
from fedfusion.strategies.regmean import RegMean, parse_alphas
from fedfusion.wire import ClientUpload, UploadError, validate_upload

LINEAR = ModelSpec("mlp", (1, 4, 4), 3, {"hidden_layers": 0})
LINEAR_BIAS = ModelSpec("mlp", (1, 4, 4), 3, {"hidden_layers": 0, "bias": True})
LENET = ModelSpec("lenet", (1, 28, 28), 10)


def client(spec: ModelSpec, client_id: int, n: int, seed: int) -> tuple[ClientUpload,
                                                                          nn.Module, torch.Tensor]:
    """An untrained random client model, its random inputs, and its upload (weights + gram)."""
    torch.manual_seed(seed)
    model = spec.build()
    x = torch.randn(n, *spec.input_shape) + 0.3 * seed  # client inputs differ in distribution
    upload = ClientUpload(client_id, spec.name, spec.kwargs, n, [{
        "weights": {k: v.numpy().copy() for k, v in model.state_dict().items()},
        "gram": layer_grams(model, x, batch_size=16)}])
    return upload, model, x


def brute_force_patches(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Every receptive field of ``conv`` as a row [c*kh*kw], by explicit loops."""
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    padded = F.pad(x, (pw, pw, ph, ph))
    rows = []
    for n in range(len(x)):
        for i in range(0, padded.shape[2] - kh + 1, sh):
            for j in range(0, padded.shape[3] - kw + 1, sw):
                rows.append(padded[n, :, i:i + kh, j:j + kw].reshape(-1))
    return torch.stack(rows).double()


class Small(nn.Module):
    """conv (with bias, stride 2, padding 1) -> ReLU -> flatten -> linear (no bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.fc = nn.Linear(3 * 3 * 3, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.conv(x)).flatten(1))


def test_grams_match_brute_force_sums():
    torch.manual_seed(0)
    model, x = Small().double(), torch.randn(7, 2, 6, 6, dtype=torch.float64)
    grams = layer_grams(model, x, batch_size=3)
    assert set(grams) == {"conv.weight", "fc.weight"}
    patches = brute_force_patches(x, model.conv)
    patches = torch.cat([patches, torch.ones(len(patches), 1, dtype=patches.dtype)], 1)
    assert grams["conv.weight"].shape == (2 * 9 + 1, 2 * 9 + 1)  # bias: constant-1 input
    np.testing.assert_allclose(grams["conv.weight"], (patches.T @ patches).numpy(), rtol=1e-6)
    hidden = F.relu(model.conv(x)).flatten(1).detach()
    np.testing.assert_allclose(grams["fc.weight"], (hidden.T @ hidden).numpy(), rtol=1e-6,
                               atol=1e-6)
    assert all(g.dtype == np.float32 and np.array_equal(g, g.T) for g in grams.values())
    # and the conv layer's output is exactly its weight applied to these patches
    out = model.conv(x).permute(0, 2, 3, 1).reshape(-1, 3).detach()
    w = torch.cat([model.conv.weight.reshape(3, -1), model.conv.bias[:, None]], 1).detach()
    torch.testing.assert_close(patches @ w.T, out)


def test_gram_section_is_built_by_the_client_registry_and_validated():
    torch.manual_seed(0)
    model, x = LENET.build(), torch.randn(20, 1, 28, 28)
    arrays = build_section("gram", model, x, torch.zeros(20, dtype=torch.long), None)
    shapes = FusionContext(LENET).param_shapes("lenet", {})
    assert {k: v.shape for k, v in arrays.items()} == {
        "features.0.weight": (25, 25), "features.3.weight": (150, 150),
        "classifier.0.weight": (256, 256), "classifier.2.weight": (120, 120),
        "classifier.4.weight": (84, 84)}
    validate_grams(arrays, shapes)
    upload = ClientUpload(0, "lenet", {}, 20, [{"weights": {
        k: v.numpy() for k, v in model.state_dict().items()}, "gram": arrays}])
    validate_upload(upload, FusionContext(LENET).param_shapes, ("weights", "gram"))


def test_validate_grams_names_the_bad_array():
    shapes = FusionContext(LINEAR_BIAS).param_shapes(LINEAR_BIAS.name, LINEAR_BIAS.kwargs)
    sizes = model_gram_sizes(LINEAR_BIAS.build())
    assert sizes == expected_gram_sizes(shapes) == {"net.1.weight": 17}
    rng = np.random.default_rng(0)
    a = rng.standard_normal((50, 17))
    good = {"net.1.weight": (a.T @ a).astype(np.float32)}  # 16 inputs + the bias's 1
    validate_grams(good, shapes)
    validate_grams(good, shapes, sizes)
    plain = {k: tuple(v) for k, v in shapes.items()}
    validate_grams({}, plain)  # shapes alone cannot tell a missing layer (see test below)
    bad_cases = {
        "missing Gram": {},
        "shape": {"net.1.weight": good["net.1.weight"][:16, :16]},
        "not symmetric": {"net.1.weight": good["net.1.weight"] + np.triu(np.ones((17, 17)), 1)},
        "not positive semi-definite": {"net.1.weight": good["net.1.weight"]
                                       - 2 * np.linalg.eigvalsh(a.T @ a)[-1] * np.eye(17)},
        "unexpected": {**good, "net.1.bias": good["net.1.weight"]},
    }
    for problem, arrays in bad_cases.items():
        with pytest.raises(ValueError, match=problem) as info:
            validate_grams({k: np.asarray(v, np.float32) for k, v in arrays.items()}, shapes,
                           sizes)
        assert "net.1" in str(info.value)
        if problem != "missing Gram":
            with pytest.raises(ValueError, match=problem):
                validate_grams({k: np.asarray(v, np.float32) for k, v in arrays.items()},
                               plain)
    upload = ClientUpload(0, LINEAR_BIAS.name, LINEAR_BIAS.kwargs, 5, [{
        "weights": {k: np.zeros(s, np.float32) for k, s in shapes.items()},
        "gram": bad_cases["not symmetric"]}])
    with pytest.raises(UploadError, match="client 0: member 0 section 'gram'"):
        validate_upload(upload, FusionContext(LINEAR_BIAS).param_shapes, ("weights", "gram"))


def test_parse_alphas():
    assert parse_alphas("0.1, 0.5,0.9") == [0.1, 0.5, 0.9]
    for text in ("", "a,b", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="alphas"):
            parse_alphas(text)


@pytest.mark.parametrize("spec", [LINEAR, LINEAR_BIAS], ids=["no-bias", "bias"])
def test_alpha_one_is_least_squares_on_the_pooled_inputs(spec):
    """W* = argmin_W sum_i ||X_i W^T - X_i W_i^T||^2 (with a bias: over [X_i, 1])."""
    clients = [client(spec, c, n, seed=c) for c, n in enumerate((40, 25, 60))]
    fused = RegMean(spec, num_clients=3, alphas=(1.0,)).fuse([u for u, _, _ in clients])
    state = fused.members[0].state_dict()
    inputs, targets = [], []
    for _, model, x in clients:
        layer = model.net[1]
        rows = layer_inputs(layer, x.flatten(1).double())  # [X | 1] with a bias
        w = layer.weight if layer.bias is None else torch.cat([layer.weight,
                                                               layer.bias[:, None]], 1)
        inputs.append(rows.numpy())
        targets.append((rows @ w.detach().double().T).numpy())
    solution = np.linalg.lstsq(np.vstack(inputs), np.vstack(targets), rcond=None)[0].T
    np.testing.assert_allclose(state["net.1.weight"].numpy(), solution[:, :16], atol=2e-5)
    if spec is LINEAR_BIAS:
        np.testing.assert_allclose(state["net.1.bias"].numpy(), solution[:, 16], atol=2e-5)
    # ... and it is not simply the average of the clients
    average = np.mean([m.net[1].weight.detach().numpy() for _, m, _ in clients], 0)
    assert np.abs(state["net.1.weight"].numpy() - average).max() > 0.05


def test_alpha_shrinks_the_off_diagonal():
    """alpha < 1: W*^T = (sum G~_i)^-1 sum G~_i W_i^T with G~ = alpha G + (1-alpha) diag G."""
    clients = [client(LINEAR, c, 30, seed=c) for c in range(3)]
    uploads = [u for u, _, _ in clients]
    alpha = 0.3
    fused = RegMean(LINEAR, num_clients=3, alphas=(alpha,)).fuse(uploads)
    shrunk = [alpha * g + (1 - alpha) * np.diag(np.diag(g)) for g in
              (u.members[0]["gram"]["net.1.weight"].astype(np.float64) for u in uploads)]
    rhs = sum(g @ u.weights()["net.1.weight"].T.astype(np.float64)
              for g, u in zip(shrunk, uploads, strict=True))
    expected = np.linalg.solve(sum(shrunk), rhs).T
    np.testing.assert_allclose(fused.members[0].state_dict()["net.1.weight"].numpy(), expected,
                               rtol=1e-5, atol=1e-6)


def test_conv_layers_are_least_squares_on_unfolded_patches():
    """LeNet's two conv layers, alpha = 1: each is the least-squares fit of the clients'
    conv outputs on the pooled patches of the clients' own layer inputs."""
    clients = [client(LENET, c, n, seed=c) for c, n in enumerate((12, 20, 8))]
    fused = RegMean(LENET, num_clients=3, alphas=(1.0,)).fuse([u for u, _, _ in clients])
    state = fused.members[0].state_dict()
    for index, name in ((0, "features.0.weight"), (3, "features.3.weight")):
        inputs, targets = [], []
        for _, model, x in clients:
            conv = model.features[index]
            layer_input = model.features[:index](x).detach()
            rows = brute_force_patches(layer_input, conv)
            inputs.append(rows.numpy())
            targets.append((rows @ conv.weight.detach().double().reshape(len(conv.weight), -1).T)
                           .numpy())
        solution = np.linalg.lstsq(np.vstack(inputs), np.vstack(targets), rcond=None)[0].T
        np.testing.assert_allclose(state[name].numpy().reshape(len(solution), -1), solution,
                                   atol=2e-5, err_msg=name)
    assert fused.members[0].state_dict().keys() == clients[0][1].state_dict().keys()


def test_identical_clients_fuse_to_that_client():
    upload, model, _ = client(LENET, 0, 30, seed=4)
    twin = ClientUpload(1, upload.model, upload.model_kwargs, 50, upload.members)
    strategy = RegMean(LENET, num_clients=2, alphas=(0.1, 1.0))
    fused = strategy.fuse([upload, twin]).members[0].state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(fused[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    # fc1 has 256 inputs and 30 samples: its alpha = 1 Gram is singular, hence the ridge
    assert strategy.report()["chosen_alpha"] == 1.0  # no validation set: the last alpha
    assert strategy.report()["alphas"][0]["ridged_layers"].keys() >= {"m0/classifier.0.weight"}
    # beside a distinct client the twins are least squares on the pooled inputs, the twin's
    # rows counted twice: neither client 0's weights nor their sample-weighted average
    (first, model, x), (other, other_model, x2) = client(LINEAR, 0, 30, 4), client(LINEAR, 2,
                                                                                   30, 5)
    twin = ClientUpload(1, first.model, first.model_kwargs, 30, first.members)
    fused = RegMean(LINEAR, num_clients=3, alphas=(1.0,)).fuse([first, twin, other])
    rows = [x.flatten(1).double(), x.flatten(1).double(), x2.flatten(1).double()]
    weights = [m.net[1].weight.detach().double() for m in (model, model, other_model)]
    solution = np.linalg.lstsq(torch.cat(rows).numpy(),
                               torch.cat([r @ w.T for r, w in zip(rows, weights, strict=True)])
                               .numpy(), rcond=None)[0].T
    result = fused.members[0].state_dict()["net.1.weight"].numpy()
    np.testing.assert_allclose(result, solution, atol=2e-5)
    average = (2 * weights[0] + weights[2]).numpy() / 3
    assert np.abs(result - average).max() > 0.05
    assert np.abs(result - weights[0].numpy()).max() > 0.05


def test_alpha_is_chosen_on_validation():
    clients = [client(LENET, c, 30, seed=c) for c in range(2)]
    uploads = [u for u, _, _ in clients]
    torch.manual_seed(9)
    x = torch.randn(64, 1, 28, 28)
    y = clients[1][1](x).argmax(1).detach()  # labels of client 1's model: some alpha fits them best
    alphas = (0.0, 0.5, 1.0)
    strategy = RegMean(LENET, val=ImageData(x, y), num_clients=2, alphas=alphas)
    chosen = strategy.fuse(uploads)
    report = strategy.report()
    accuracies = [entry["val_accuracy"] for entry in report["alphas"]]
    assert [entry["alpha"] for entry in report["alphas"]] == list(alphas)
    assert report["chosen_alpha"] == alphas[int(np.argmax(accuracies))]
    alone = RegMean(LENET, num_clients=2, alphas=(report["chosen_alpha"],)).fuse(uploads)
    for name, value in alone.members[0].state_dict().items():
        assert torch.equal(chosen.members[0].state_dict()[name], value)


def test_real_fmnist_federation(fmnist_split):
    """RegMean (alpha chosen on the 300 validation images) against FedAvg of the same uploads
    (the shared 3-client Dirichlet 0.5 split, conftest.fmnist_split): RegMean must beat it by
    5 points, which a FedAvg stub (+0) cannot, and client 0's model of the same uploads by 2,
    which a client-0 stub (+0) cannot. Measured: RegMean 60.6% (alpha 0.5), FedAvg 50.9%,
    client 0 55.4%, the uniform ensemble 64.2% (a single model need not reach the
    ensemble)."""
    results = fmnist_split.replay("regmean")
    fedavg = fmnist_split.replay("fedavg")
    client0 = fmnist_split.replay("ensemble", replay_clients="0")
    print(results["test"], fedavg["test"], client0["test"])
    assert results["status"] == "ok" and not results["excluded"]
    assert results["test"]["accuracy"] >= fedavg["test"]["accuracy"] + 0.05  # measured +9.7
    assert results["test"]["accuracy"] >= client0["test"]["accuracy"] + 0.02  # measured +5.2
    report = results["strategy_report"]
    assert [entry["alpha"] for entry in report["alphas"]] == [0.1, 0.5, 0.9]
    assert report["chosen_alpha"] in (0.1, 0.5, 0.9)


class BNCNN(nn.Module):
    """conv (no bias) -> BN -> ReLU -> conv (bias, stride 2) -> BN -> ReLU -> linear (bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return self.fc(F.relu(self.bn2(self.conv2(h))).flatten(1))


class LNMLP(nn.Module):
    """linear (bias) -> LayerNorm -> ReLU -> linear (bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(36, 8)
        self.ln = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.ln(self.fc1(x.flatten(1)))))


class EmbedMLP(nn.Module):
    """Two Linear layers and an nn.Embedding used as a learnt offset: a 2-D ``*.weight``
    that is not a Linear weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(36, 8)
        self.embed = nn.Embedding(2, 8)
        self.fc2 = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = self.embed(torch.zeros(len(x), dtype=torch.long, device=x.device))
        return self.fc2(F.relu(self.fc1(x.flatten(1)) + offset))


def norm_client(spec: ModelSpec, client_id: int, n: int) -> tuple[ClientUpload, nn.Module,
                                                                     torch.Tensor]:
    """A random client model whose normalisation layers hold random affine parameters and
    running statistics (as after training), its inputs, and its in-memory upload: the whole
    state dict in native dtypes, and the Grams."""
    torch.manual_seed(client_id)
    model = spec.build()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d | nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(0.5, 1.0)  # most units alive after the ReLU
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 2.0)
                module.num_batches_tracked.fill_(10 * (client_id + 1))
    x = torch.randn(n, *spec.input_shape) + 0.3 * client_id
    upload = ClientUpload(client_id, spec.name, {}, n, [{
        "weights": {k: v.numpy().copy() for k, v in model.state_dict().items()},
        "gram": layer_grams(model, x, batch_size=16)}])
    return upload, model.eval(), x


def brute_force_regmean(clients: list[tuple[ClientUpload, nn.Module, torch.Tensor]],
                        layer: str, alpha: float) -> np.ndarray:
    """[W | b] of one Linear/Conv2d layer by RegMean from scratch: each client's layer inputs
    captured by a hook (conv: patches by explicit loops), G_i = X_i^T X_i in float64,
    G~_i = alpha G_i + (1 - alpha) diag(G_i), W^T = (sum G~_i)^-1 sum G~_i W_i^T."""
    lhs, rhs = 0.0, 0.0
    for _, model, x in clients:
        module = model.get_submodule(layer)
        seen: list[torch.Tensor] = []
        handle = module.register_forward_hook(
            lambda m, args, out, seen=seen: seen.append(args[0]))
        with torch.no_grad():
            model(x)
        handle.remove()
        inputs = seen[0].detach().double()
        rows = (brute_force_patches(inputs, module) if isinstance(module, nn.Conv2d)
                else inputs.reshape(len(inputs), -1))
        w = module.weight.detach().double().reshape(len(module.weight), -1)
        if module.bias is not None:
            rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1)
            w = torch.cat([w, module.bias.detach().double()[:, None]], 1)
        gram = (rows.T @ rows).numpy()
        shrunk = alpha * gram + (1 - alpha) * np.diag(np.diag(gram))
        lhs, rhs = lhs + shrunk, rhs + shrunk @ w.numpy().T
    return np.linalg.solve(lhs, rhs).T


@pytest.mark.parametrize(("model_fn", "layers", "averaged"), [
    (BNCNN, ["conv1", "conv2", "fc"],
     ["bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var", "bn2.weight",
      "bn2.bias", "bn2.running_mean", "bn2.running_var"]),
    (LNMLP, ["fc1", "fc2"], ["ln.weight", "ln.bias"]),
], ids=["batchnorm-cnn", "layernorm-mlp"])
def test_normalised_models_merge_linear_layers_by_regmean_and_the_rest_by_average(
        model_fn, layers, averaged):
    """Linear/Conv2d layers (weight and bias) equal the brute-force RegMean solve; every
    BatchNorm/LayerNorm entry equals the sample-weighted average; the integer counter
    follows weighted_average's rule."""
    spec = ModelSpec(model_fn.__name__, (1, 6, 6), 3, model_fn=model_fn)
    clients = [norm_client(spec, c, n) for c, n in enumerate((20, 35, 50))]
    uploads = [u for u, _, _ in clients]
    strategy = RegMean(spec, num_clients=3, alphas=(0.5,))
    assert sorted(strategy.linear_layers()) == sorted(f"{name}.weight" for name in layers)
    for upload in uploads:
        strategy.check_grams(upload)
    fused = {k: v.numpy() for k, v in strategy.fuse(uploads).members[0].state_dict().items()}
    for name in layers:
        expected = brute_force_regmean(clients, name, alpha=0.5)
        weight = fused[f"{name}.weight"]
        merged = weight.reshape(len(weight), -1)
        if f"{name}.bias" in fused:
            merged = np.concatenate([merged, fused[f"{name}.bias"][:, None]], 1)
        np.testing.assert_allclose(merged, expected, rtol=1e-4, atol=1e-4, err_msg=name)
        average = sum(u.num_examples * u.weights()[f"{name}.weight"] for u in uploads) / 105
        assert np.abs(weight - average).max() > 1e-2, name  # not simply the average
    for name in averaged:
        expected = sum(u.num_examples * u.weights()[name].astype(np.float64)
                       for u in uploads) / 105
        np.testing.assert_allclose(fused[name], expected, rtol=1e-6, atol=1e-7, err_msg=name)
    rule = weighted_average([u.weights() for u in uploads], [20, 35, 50])
    for name in fused:
        if name.endswith("num_batches_tracked"):
            assert fused[name] == rule[name], name
    assert sorted(fused) == sorted(uploads[0].weights())


def test_gram_layers_come_from_the_module_types_not_the_shapes():
    """nn.Embedding's weight is 2-D: the shape rule takes it for a Linear weight, the model's
    modules do not. An honest upload (no Gram for it) passes validation and fuses, the
    embedding averaged; a Gram for it, or none for a Linear layer, is refused by name."""
    spec = ModelSpec("EmbedMLP", (1, 6, 6), 3, model_fn=EmbedMLP)
    shapes = {k: tuple(v) for k, v in spec.param_shapes().items()}  # shapes only
    assert expected_gram_sizes(shapes) == {"fc1.weight": 37, "embed.weight": 8,
                                           "fc2.weight": 8}
    sizes = model_gram_sizes(spec.build())
    assert sizes == {"fc1.weight": 37, "fc2.weight": 8}
    # a layout that names the Linear/Conv2d parameters (as fedfusion.core.state.StateLayout's kron)
    layout = type("Layout", (dict,), {"kron": frozenset(
        {"fc1.weight", "fc1.bias", "fc2.weight"})})(shapes)
    assert layout_gram_sizes(layout) == sizes and layout_gram_sizes(shapes) is None
    clients = [norm_client(spec, c, n) for c, n in enumerate((20, 35))]
    good = [u for u, _, _ in clients]
    extra = norm_client(spec, 2, 30)[0]
    extra.members[0]["gram"]["embed.weight"] = np.eye(8, dtype=np.float32)
    missing = norm_client(spec, 3, 30)[0]
    del missing.members[0]["gram"]["fc2.weight"]
    validate_upload(extra, lambda name, kwargs: shapes, ("weights", "gram"))  # shape rule: ok
    with pytest.raises(ValueError, match=r"unexpected array\(s\) \['embed.weight'\]"):
        validate_grams(extra.members[0]["gram"], layout)
    with pytest.raises(ValueError, match=r"missing Gram\(s\) for layer\(s\) \['fc2.weight'\]"):
        validate_grams(missing.members[0]["gram"], layout)
    validate_grams(good[0].members[0]["gram"], layout)
    strategy = RegMean(spec, num_clients=4, alphas=(1.0,))
    fused = strategy.fuse_uploads([*good, extra, missing])
    reasons = {e["client"]: e["reason"] for e in strategy.exclusions}
    assert reasons == {
        "2": "member 0 section 'gram': unexpected array(s) ['embed.weight'] (no Linear/Conv2d "
             "weight of that name)",
        "3": "member 0 section 'gram': missing Gram(s) for layer(s) ['fc2.weight']"}
    state = fused.members[0].state_dict()
    np.testing.assert_allclose(state["embed.weight"].numpy(),
                               (20 * good[0].weights()["embed.weight"]
                                + 35 * good[1].weights()["embed.weight"]) / 55, rtol=1e-6)
    expected = brute_force_regmean(clients, "fc2", alpha=1.0)
    np.testing.assert_allclose(state["fc2.weight"].numpy(), expected, rtol=1e-4, atol=1e-4)


def test_gram_layers_cover_every_weight_of_the_zoo():
    for name, shape in (("lenet", (1, 28, 28)), ("cnn", (3, 32, 32)), ("convnet", (3, 32, 32)),
                        ("mlp", (1, 28, 28))):
        spec = ModelSpec(name, shape, 10)
        model = spec.build()
        weights = {k for k in model.state_dict() if k.endswith("weight")}
        assert set(gram_layers(model)) == weights


def test_alpha_is_chosen_with_the_batchnorm_statistics_the_fused_model_keeps(monkeypatch):
    """With norm_stats="recalibrate" each candidate alpha is scored after its BatchNorm
    statistics are re-estimated on the validation inputs, as the chosen model keeps them:
    the chosen alpha's reported validation accuracy is the final predictor's, and the
    statistics are estimated once per candidate (not again for the chosen one)."""
    calls = []
    original = fusion_module.recalibrate
    monkeypatch.setattr(fusion_module, "recalibrate",
                        lambda model, x: calls.append(model) or original(model, x))
    spec = ModelSpec("BNCNN", (1, 6, 6), 3, model_fn=BNCNN)
    clients = [norm_client(spec, c, 40) for c in range(2)]
    torch.manual_seed(11)
    x = torch.randn(90, 1, 6, 6) + 0.15
    with torch.no_grad():
        y = clients[1][1](x).argmax(1)
    strategy = RegMean(spec, val=ImageData(x, y), num_clients=2, alphas=(0.0, 0.5, 1.0),
                       norm_stats="recalibrate")
    predictor = strategy.fuse_uploads([u for u, _, _ in clients])
    report = strategy.report()
    chosen = next(e for e in report["alphas"] if e["alpha"] == report["chosen_alpha"])
    final = evaluate(predictor, x, y)
    assert strategy.recalibrated_layers == 2
    assert len(calls) == 3  # one member per candidate alpha, each estimated once
    assert chosen["val_accuracy"] == pytest.approx(final["accuracy"], abs=1e-12)
    assert chosen["val_nll"] == pytest.approx(final["nll"], rel=1e-6)

