"""Real models: BatchNorm, LayerNorm, residual blocks and buffers in every strategy.

Three groups:

* the wire: every kind of ``state_dict`` entry round-trips exactly, and validation knows
  parameters from buffers;
* curvature on any architecture: the hybrid Kron fit (K-FAC for Linear/Conv2d, a diagonal for
  the rest) against brute-force references, and the mixture objective against a dense one;
* normalisation statistics: the recalibration against the batch statistics it estimates, and
  each strategy's rule.

The strategy x model matrix on real Fashion-MNIST rows is tests/strategies/test_model_matrix.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.user_models import BNNet, CustomNet, LNNet, with_stats
from torch import nn
from torch.nn import functional as F

from fedfusion import ClientUpload, client
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.normalization import recalibrate
from fedfusion.core.state import StateLayout, load_state_arrays, state_arrays
from fedfusion.curvature import StackedGaussians, curvature_from_arrays
from fedfusion.curvature.fit import fit_curvature
from fedfusion.curvature.hybrid import hybrid_kron_fit
from fedfusion.strategies import FedAvg, FedBEns, RegMean, UniformEnsemble
from fedfusion.wire import (
    UploadError,
    decode_models,
    decode_upload,
    encode_models,
    encode_upload,
    validate_upload,
)


class Buffers(nn.Module):
    """Every kind of state entry: a float16 and a bfloat16 parameter, a 0-d int64 counter, a
    bool mask and a uint8 table."""

    def __init__(self) -> None:
        super().__init__()
        self.half_weight = nn.Parameter(torch.randn(3, 2).half())
        self.brain = nn.Parameter(torch.randn(4).bfloat16())
        self.register_buffer("steps", torch.tensor(123456789, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("table", torch.arange(6, dtype=torch.uint8).reshape(2, 3))
        self.fc = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1)[:, :2])


def _upload(model: nn.Module, client_id: int = 0, num_examples: int = 10) -> ClientUpload:
    return ClientUpload(client_id, type(model).__name__, {}, num_examples,
                        [{"weights": state_arrays(model)}])


# ---------------------------------------------------------------------------------- the wire
def test_every_state_entry_round_trips_exactly_through_the_upload_and_the_broadcast():
    torch.manual_seed(0)
    model = Buffers()
    spec = ModelSpec.from_model_fn(Buffers)
    wire = decode_upload(encode_upload(_upload(model)), 0, lambda *_: spec.param_shapes())
    for source, arrays in (("upload", wire.weights(0)),
                           ("broadcast", decode_models(encode_models([state_arrays(model)]))[0])):
        rebuilt = spec.build(arrays)
        for name, tensor in model.state_dict().items():
            got = rebuilt.state_dict()[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, (source, name)
            assert torch.equal(got, tensor), (source, name)
    assert wire.weights(0)["steps"].shape == () and wire.weights(0)["steps"].dtype == np.int64
    # a bfloat16 entry travels as float32 (numpy has no bfloat16) without losing a bit
    assert wire.weights(0)["brain"].dtype == np.float32


def test_the_client_loads_the_broadcast_with_its_own_dtypes():
    model = with_stats(BNNet())
    msg_content = {"arrays": encode_models([state_arrays(model)])}
    from flwr.app import RecordDict

    [loaded] = client.initial_models(RecordDict(msg_content), BNNet)
    template = BNNet()  # a template module, as the strategies take, is copied, not called
    [from_template] = client.initial_models(RecordDict(msg_content), template)
    assert from_template is not template
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
        assert loaded.state_dict()[name].dtype == tensor.dtype
        assert torch.equal(from_template.state_dict()[name], tensor), name


def test_the_layout_knows_parameters_buffers_and_linear_conv_layers():
    layout = ModelSpec.from_model_fn(BNNet).param_shapes()
    assert isinstance(layout, StateLayout)
    assert layout.buffers == tuple(f"bn{i}.{b}" for i in (1, 2) for b in (
        "running_mean", "running_var", "num_batches_tracked"))
    assert "bn1.weight" in layout.parameters and "bn1.running_mean" not in layout.parameters
    assert layout.kron == {"c1.weight", "c1.bias", "c2.weight", "fc.weight", "fc.bias"}
    assert layout["bn1.num_batches_tracked"] == () and dict(layout)["fc.weight"] == (3, 24)
    assert layout.owners["bn2.weight"] == "BatchNorm2d"


def test_validation_tells_parameters_from_buffers():
    spec = ModelSpec.from_model_fn(BNNet)
    upload = _upload(with_stats(BNNet()))
    upload.members[0]["weights"]["bn1.num_batches_tracked"] = np.array(3.0, np.float32)
    with pytest.raises(UploadError, match=r"buffer 'bn1.num_batches_tracked' has dtype float32"):
        validate_upload(upload, lambda *_: spec.param_shapes())
    upload = _upload(with_stats(BNNet()))
    upload.members[0]["weights"]["bn1.running_var"] = np.ones(5, np.float32)
    with pytest.raises(UploadError, match=r"buffer 'bn1.running_var' has shape \(5,\)"):
        validate_upload(upload, lambda *_: spec.param_shapes())
    # an integer counter far above the weights' magnitude cap is an honest value
    upload = _upload(with_stats(BNNet()))
    upload.members[0]["weights"]["bn1.num_batches_tracked"] = np.array(10**12, np.int64)
    validate_upload(upload, lambda *_: spec.param_shapes())


def test_integer_arrays_are_refused_outside_the_weights_section():
    model = with_stats(BNNet())
    x = torch.randn(20, 1, 8, 8)
    upload = client.make_upload([model], x, torch.randint(0, 3, (20,)), ["weights", "gram"])
    upload.members[0]["gram"]["c1.weight"] = upload.members[0]["gram"]["c1.weight"].astype(
        np.int64)
    with pytest.raises(UploadError, match="section 'gram' holds float16, float32 or float64"):
        validate_upload(upload, lambda *_: ModelSpec.from_model_fn(BNNet).param_shapes(),
                        ["weights", "gram"])


# ----------------------------------------------------------------------------- curvature
def _sampled_targets(model: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    """The labels the fit draws for one batch (the same generator, the same call)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        probs = torch.softmax(model(x).float(), -1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


@pytest.mark.parametrize("net", [BNNet, LNNet, CustomNet])
def test_hybrid_fit_matches_brute_force_per_sample_gradients(net):
    """One batch: every diagonal block is sum_n g_n^2 of per-sample gradients at the sampled
    labels; the output layer's factors are B = sum_n (p_n - e_y)(p_n - e_y)^T and
    A = sum_n a_n a_n^T / N; computed here one sample at a time with autograd."""
    torch.manual_seed(1)
    model = with_stats(net()) if net is BNNet else net().eval()
    x = torch.randn(12, 8) if net is LNNet else torch.randn(12, 1, 8, 8)
    factors, diagonals = hybrid_kron_fit(model, x, seed=5, batch_size=64)
    targets = _sampled_targets(model, x, 5)
    params = dict(model.named_parameters())
    assert set(diagonals) == {n for n in params if n.startswith(("bn", "ln", "gn", "scale"))}
    assert set(factors) | set(diagonals) == set(params)
    brute = {n: torch.zeros_like(p) for n, p in params.items()}
    for xi, ti in zip(x, targets, strict=True):
        model.zero_grad()
        F.cross_entropy(model(xi[None]), ti[None], reduction="sum").backward()
        for n, p in params.items():
            brute[n] += p.grad**2
    model.zero_grad()
    for name, h in diagonals.items():
        torch.testing.assert_close(h, brute[name], rtol=1e-4, atol=1e-7)
    last = "fc2" if net is LNNet else "fc"
    with torch.no_grad():
        g = torch.softmax(model(x), -1) - F.one_hot(targets, 3)
        inputs = []
        handle = getattr(model, last).register_forward_hook(lambda m, a, o: inputs.append(a[0]))
        model(x)
        handle.remove()
    b, a = factors[f"{last}.weight"]
    torch.testing.assert_close(b, g.T @ g, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(a, inputs[0].T @ inputs[0] / len(x), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(factors[f"{last}.bias"][1], g.T @ g, rtol=1e-4, atol=1e-6)
    if net is BNNet:  # a convolution's A: im2col patches over samples and positions
        with torch.no_grad():
            h = F.max_pool2d(F.relu(model.bn1(model.c1(x))), 2)
        patches = F.unfold(h, 3, padding=1)  # [N, K, L]
        expected = torch.einsum("nkl,njl->kj", patches, patches) / (len(x) * patches.shape[2])
        torch.testing.assert_close(factors["c2.weight"][1], expected, rtol=1e-4, atol=1e-6)
    # K-FAC exactness check: the Kron block of the bias is its exact Fisher block
    bias_fisher = sum(torch.outer(gi, gi) for gi in g)
    torch.testing.assert_close(factors[f"{last}.bias"][1], bias_fisher, rtol=1e-4, atol=1e-6)


def test_hybrid_fit_leaves_the_model_and_the_global_rng_alone():
    model = with_stats(BNNet()).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(10, 1, 8, 8)
    rng = torch.get_rng_state()
    hybrid_kron_fit(model, x, seed=0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_hybrid_kron_precision_and_mixture_match_dense_references():
    """log det and the quadratic form of a Kron curvature with diagonal blocks against its
    dense precision, and the stacked log-density against torch's MultivariateNormal."""
    torch.manual_seed(2)
    members = [with_stats(BNNet(), seed=s) for s in range(2)]
    x, y = torch.randn(30, 1, 8, 8), torch.randint(0, 3, (30,))
    layout = ModelSpec.from_model_fn(BNNet).param_shapes()
    curvatures = [fit_curvature(m, x, y, "kron", temperature=0.5, prior_var=0.3)
                  for m in members]
    wire = [curvature_from_arrays("kron", c.to_arrays(), layout, 0.5, 0.3) for c in curvatures]
    assert set(wire[0].diagonals) == {"bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias"}
    dense = [c.dense_precision() for c in wire]
    for c, lam in zip(wire, dense, strict=True):
        assert math.isclose(c.precision_logdet(), float(torch.logdet(lam)), rel_tol=1e-6)
    means = [{k: v.double() for k, v in m.state_dict().items()} for m in members]
    stacked = StackedGaussians.from_members(means, wire, "cpu", dtype=torch.float64)
    names = list(layout.parameters)
    points = [{n: p.detach().double() + 0.01 * torch.randn_like(p.double())
               for n, p in members[0].named_parameters()} for _ in range(3)]
    got = stacked.log_density({n: torch.stack([p[n] for p in points]) for n in names})
    for r, point in enumerate(points):
        w = torch.cat([point[n].flatten() for n in names])
        for k in range(2):
            mean = torch.cat([means[k][n].flatten() for n in names])
            ref = torch.distributions.MultivariateNormal(mean, precision_matrix=dense[k])
            assert math.isclose(float(got[r, k]), float(ref.log_prob(w)), rel_tol=1e-7)


def test_a_client_cannot_choose_another_block_for_a_layer():
    model = with_stats(BNNet())
    x, y = torch.randn(20, 1, 8, 8), torch.randint(0, 3, (20,))
    arrays = fit_curvature(model, x, y, "kron").to_arrays()
    layout = ModelSpec.from_model_fn(BNNet).param_shapes()
    forged = {k: v for k, v in arrays.items() if not k.startswith("fc.weight/")}
    forged["fc.weight/ggn_diag"] = np.ones((3, 24), np.float32)
    with pytest.raises(ValueError, match="missing array 'fc.weight/eigvecs_out'"):
        curvature_from_arrays("kron", forged, layout, 1.0, 1.0)
    buffer = dict(arrays, **{"bn1.running_mean/ggn_diag": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="unexpected arrays.*bn1.running_mean"):
        curvature_from_arrays("kron", buffer, layout, 1.0, 1.0)


def test_curvature_errors_name_the_module_and_the_alternative():
    x, y = torch.randn(20, 1, 8, 8), torch.randint(0, 3, (20,))
    with pytest.raises(ValueError, match=r"'curvlinops_ggn' has no Kron factors for the "
                                         r"BatchNorm2d parameter 'bn1.weight'.*'diag'"):
        fit_curvature(with_stats(BNNet()), x, y, "kron", backend="curvlinops_ggn")
    grouped = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(),
                            nn.Linear(4 * 4 * 4, 3))
    with pytest.raises(ValueError, match=r"conv layer '1'.*groups.*hessian_structure='diag'"):
        fit_curvature(grouped, x, y, "kron")


def test_diag_curvature_covers_parameters_never_buffers_and_passes_the_server():
    model = with_stats(BNNet())
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 3, (40,))
    upload = client.make_upload([model], x, y, ["weights", "curvature.diag", "curvature.kron"],
                                model_name="BNNet")
    names = {k.rsplit("/", 1)[0] for k in upload.members[0]["curvature.diag"]}
    assert names == {n for n, _ in model.named_parameters()}
    layout = ModelSpec.from_model_fn(BNNet).param_shapes()
    decode_upload(encode_upload(upload), 0, lambda *_: layout,
                  ["weights", "curvature.diag", "curvature.kron"])


# --------------------------------------------------------------------- normalisation rules
def test_recalibration_estimates_the_batch_statistics_of_the_fused_weights():
    torch.manual_seed(3)
    model = with_stats(BNNet())
    x = torch.randn(50, 1, 8, 8) * 3 + 1
    momentum = model.bn1.momentum
    assert recalibrate(model, x, batch_size=64) == 2
    with torch.no_grad():
        h = model.c1(x)
    torch.testing.assert_close(model.bn1.running_mean, h.mean((0, 2, 3)))
    torch.testing.assert_close(model.bn1.running_var, h.transpose(0, 1).flatten(1).var(1))
    assert model.bn1.momentum == momentum and not model.training
    assert int(model.bn1.num_batches_tracked) == 1


def _bn_uploads(num: int = 3) -> list[ClientUpload]:
    return [_upload(with_stats(BNNet(), seed=c), client_id=c, num_examples=10 * (c + 1))
            for c in range(num)]


def test_fedavg_statistics_rule_average_and_recalibrate():
    uploads = _bn_uploads()
    val = (torch.randn(40, 1, 8, 8) * 2, torch.randint(0, 3, (40,)))
    average = FedAvg(BNNet, norm_stats="average", val=val).fuse_uploads(uploads).members[0]
    weights = np.array([10.0, 20.0, 30.0]) / 60
    expected = sum(w * u.weights(0)["bn1.running_mean"] for w, u in zip(weights, uploads,
                                                                        strict=True))
    np.testing.assert_allclose(average.bn1.running_mean.numpy(), expected, rtol=1e-5)  # float32
    # the counter: the heaviest client's, not an average
    assert int(average.bn1.num_batches_tracked) == int(uploads[2].weights(0)[
        "bn1.num_batches_tracked"])
    strategy = FedAvg(BNNet, val=val)  # "auto" with validation rows: recalibrate
    recalibrated = strategy.fuse_uploads(uploads).members[0]
    assert strategy.norm_stats == "recalibrate" and strategy.recalibrated_layers == 2
    reference = ModelSpec.from_model_fn(BNNet).build(state_arrays(average))
    recalibrate(reference, val[0])
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(recalibrated.state_dict()[name], tensor)
    assert FedAvg(BNNet).norm_stats == "average"  # nothing to recalibrate on


def test_ensembles_keep_each_clients_statistics():
    uploads = _bn_uploads()
    strategy = UniformEnsemble(BNNet, val=(torch.randn(8, 1, 8, 8), torch.zeros(8).long()))
    predictor = strategy.fuse_uploads(uploads)
    assert strategy.norm_stats == "client"
    for member, upload in zip(predictor.members, uploads, strict=True):
        np.testing.assert_array_equal(member.bn2.running_var.numpy(),
                                      upload.weights(0)["bn2.running_var"])


@pytest.mark.parametrize("cls, rule, message", [
    (UniformEnsemble, "average", "'client' or 'auto' for UniformEnsemble"),
    (FedAvg, "client", "'average' or 'recalibrate' for FedAvg"),
    (RegMean, "mean", "norm_stats must be one of"),
])
def test_a_statistics_rule_that_does_not_fit_the_strategy_is_refused(cls, rule, message):
    with pytest.raises(ValueError, match=message):
        cls(BNNet, norm_stats=rule)


def test_fedbens_modes_keep_their_starts_statistics_and_move_only_parameters():
    """FedBEns on BatchNorm uploads: the objective covers the parameters; each mode's buffers
    are its start's (the weighted average for median starts) before the rule applies."""
    torch.manual_seed(4)
    x, y = torch.randn(24, 1, 8, 8), torch.randint(0, 3, (24,))
    uploads = []
    for c in range(2):
        model = with_stats(BNNet(), seed=c)
        upload = client.make_upload([model], x, y, ["weights", "curvature.kron"], client_id=c,
                                    model_name="BNNet")
        uploads.append(upload)
    strategy = FedBEns(BNNet, num_members=1, steps=5, norm_stats="average")
    predictor = strategy.fuse_uploads(uploads)
    mode = predictor.members[0]
    expected = (uploads[0].weights(0)["bn1.running_var"]
                + uploads[1].weights(0)["bn1.running_var"]) / 2
    np.testing.assert_allclose(mode.bn1.running_var.numpy(), expected, rtol=1e-6)
    assert mode.bn1.num_batches_tracked.dtype == torch.int64
    assert torch.isfinite(predictor(x)).all()


def test_load_state_arrays_casts_to_the_models_own_dtypes():
    model = Buffers()
    arrays = {k: v.astype(np.float64) if v.dtype.kind == "f" else v
              for k, v in state_arrays(model).items()}
    load_state_arrays(model, arrays)
    assert model.brain.dtype == torch.bfloat16 and model.half_weight.dtype == torch.float16


@pytest.mark.parametrize("conv", [
    nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Conv2d(3, 4, (3, 2), dilation=2, padding=(1, 0)),
    nn.Conv2d(3, 4, 1, stride=2), nn.Conv2d(3, 4, 5)])
def test_patch_rows_are_the_im2col_patches(conv):
    from fedfusion.im2col import patch_rows

    x = torch.randn(2, 3, 9, 8)
    unfolded = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=conv.padding,
                        stride=conv.stride)  # [B, K, L]
    expected = unfolded.transpose(1, 2).reshape(-1, unfolded.shape[1])
    torch.testing.assert_close(patch_rows(conv, x), expected, rtol=0, atol=0)


def test_initial_models_leave_the_global_rng_alone_and_are_seeded():
    rng = torch.get_rng_state()
    first = FedAvg(BNNet, num_members=2, seed=3).initial_models()
    assert torch.equal(torch.get_rng_state(), rng)
    again = FedAvg(BNNet, num_members=2, seed=3).initial_models()
    for a, b in zip(first, again, strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(first[0]["c1.weight"], first[1]["c1.weight"])


def test_a_custom_layer_model_fuses_through_the_wire_or_is_refused_naming_it():
    """GroupNorm and a user's own layer: Kron + diagonal curvature through the wire into
    FedBEns; OTFusion cannot align GroupNorm's groups and says so."""
    from fedfusion.strategies import OTFusion

    torch.manual_seed(6)
    x, y = torch.randn(30, 1, 8, 8), torch.randint(0, 3, (30,))
    strategy = FedBEns(CustomNet, num_members=1, steps=5, val=(x, y))
    records = []
    for c in range(2):
        model = CustomNet().eval()
        records.append(encode_upload(client.make_upload(
            [model], x, y, ["weights", "curvature.kron"], client_id=c, model_name="CustomNet")))
    uploads = [decode_upload(r, c, strategy.context.param_shapes, strategy.required_sections)
               for c, r in enumerate(records)]
    assert "scale.gain/ggn_diag" in uploads[0].members[0]["curvature.kron"]
    assert torch.isfinite(strategy.fuse_uploads(uploads)(x)).all()
    with pytest.raises(ValueError, match=r"GroupNorm|'gn'"):
        OTFusion(CustomNet).fuse_uploads(uploads)
