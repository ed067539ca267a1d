"""Curvature structures and their batched Gaussian log-densities (float64, tiny bias-free MLP)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributions import MultivariateNormal

from fedfusion.curvature import (
    DiagCurvature,
    DiagFullCurvature,
    KronCurvature,
    StackedGaussians,
    curvature_from_arrays,
    fit_curvature,
    stacked_gaussians,
)
from fedfusion.curvature.fit import fit_laplace, kron_from_laplace, last_layer_block
from fedfusion.models import build_model
from fedfusion.strategies.fedbens.objective import MixtureObjective, mixture_log_posterior

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

INPUT, CLASSES, HIDDEN = (1, 6, 6), 4, 8  # 36*8 + 8*4 = 320 parameters
T, SIGMA2 = 0.1, 0.1
STRUCTURES = ("kron", "diag", "diag_full")
EXACT = "curvlinops_ggn"


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", INPUT, CLASSES, hidden_layers=1, hidden=HIDDEN).double()


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 40) -> nn.Module:
    """A few full-batch Adam steps, so the members sit near (different) MAPs."""
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params.values()])


def dense_ggn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Exact GGN of the summed cross-entropy: sum_n J_n^T (diag p_n - p_n p_n^T) J_n."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)
    js = torch.cat([jac[n].reshape(x.shape[0], CLASSES, -1) for n in params], dim=2)
    prob = model(x).detach().softmax(-1)
    hess = torch.diag_embed(prob) - prob[:, :, None] * prob[:, None, :]
    return torch.einsum("bcp,bck,bkq->pq", js, hess, js)


def points(model: nn.Module, num: int, scale: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: p.detach()[None] + scale * torch.randn(num, *p.shape, generator=gen, dtype=p.dtype)
        for n, p in model.named_parameters()
    }


def mvn_log_prob(mean: torch.Tensor, curv, w_flat: torch.Tensor) -> torch.Tensor:
    return MultivariateNormal(mean, precision_matrix=curv.dense_precision()).log_prob(w_flat)


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, *INPUT, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (200,), generator=gen)
    return x, y


@pytest.fixture(scope="module")
def members(data) -> list[nn.Module]:
    x, y = data
    return [train(make_mlp(seed), x, y) for seed in range(4)]


@pytest.fixture(scope="module")
def curvatures(members, data) -> dict[str, list]:
    """For every structure, the exact-GGN curvature of each of the 4 members."""
    x, y = data
    return {
        s: [
            fit_curvature(m, x, y, s, temperature=T, prior_var=SIGMA2, backend=EXACT)
            for m in members
        ]
        for s in STRUCTURES
    }


# ---------------------------------------------------------------------------------------------
# laplace-torch conventions


def test_kron_factors_order_and_scaling_match_dense_ggn() -> None:
    """For N copies of one input K-FAC is exact: B (x) A == GGN block, summed over N."""
    model = make_mlp(1)
    x = torch.randn(1, *INPUT, dtype=torch.float64).repeat(7, 1, 1, 1)
    y = torch.randint(0, CLASSES, (7,))
    ggn = dense_ggn(model, x)
    sizes = [p.numel() for p in model.parameters()]
    starts = np.cumsum([0, *sizes])
    blocks = torch.block_diag(
        *[ggn[a:b, a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    )
    expected = blocks / T + torch.eye(sum(sizes), dtype=torch.float64) / SIGMA2
    for backend in ("curvlinops_ggn", "asdl_ggn"):
        curv = fit_curvature(model, x, y, "kron", temperature=T, prior_var=SIGMA2, backend=backend)
        torch.testing.assert_close(curv.dense_precision(), expected, rtol=1e-9, atol=1e-9)
        # output factor first: eigvecs_out is [out, out], eigvecs_in is [in, in]
        fac = curv.factors["net.1.weight"]
        assert fac.eigvecs_out.shape == (HIDDEN, HIDDEN)
        assert fac.eigvecs_in.shape == (36, 36)


def test_kron_matches_laplace_torch_precision_and_log_prob(members, data) -> None:
    x, y = data
    model = members[0]
    la = fit_laplace(model, x, y, "kron", temperature=T, prior_var=SIGMA2, backend=EXACT)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    curv = kron_from_laplace(la, shapes, T, SIGMA2)
    dense = la.posterior_precision.to_matrix()
    torch.testing.assert_close(curv.dense_precision(), dense, rtol=1e-9, atol=1e-8)
    assert curv.precision_logdet() == pytest.approx(float(la.log_det_posterior_precision), 1e-10)

    stacked = StackedGaussians.from_members([dict(model.named_parameters())], [curv], "cpu")
    w = points(model, 5, 0.05, seed=1)
    ours = stacked.log_density(w)[:, 0]
    w_flat = torch.cat([v.reshape(5, -1) for v in w.values()], dim=1)
    theirs = torch.stack([la.log_prob(v, normalized=True) for v in w_flat])
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-8)
    # normalized=False is only the quadratic part: the difference is the normaliser
    quad_only = torch.stack([la.log_prob(v, normalized=False) for v in w_flat])
    normaliser = 0.5 * curv.precision_logdet() - 0.5 * w_flat.shape[1] * math.log(2 * math.pi)
    torch.testing.assert_close(ours - quad_only, torch.full_like(ours, normaliser))


def test_diag_and_diag_full_are_the_exact_ggn(members, data, curvatures) -> None:
    x, _ = data
    model = members[0]
    ggn = dense_ggn(model, x)
    delta = torch.eye(ggn.shape[0], dtype=torch.float64) / SIGMA2
    diag = curvatures["diag"][0]
    torch.testing.assert_close(diag.dense_precision(), torch.diag(ggn.diagonal()) / T + delta)
    n_last = CLASSES * HIDDEN
    expected = torch.diag(ggn.diagonal())
    expected[-n_last:, -n_last:] = ggn[-n_last:, -n_last:]
    full = curvatures["diag_full"][0]
    assert full.last_names == ["net.3.weight"]
    torch.testing.assert_close(full.dense_precision(), expected / T + delta)


# ---------------------------------------------------------------------------------------------
# batched log-densities


def _check_against_mvn(members, curvs, num_points: int = 6) -> None:
    means = [dict(m.named_parameters()) for m in members]
    stacked = StackedGaussians.from_members(means, curvs, "cpu")
    w = points(members[0], num_points, 0.05, seed=2)
    w_flat = torch.cat([v.reshape(num_points, -1) for v in w.values()], dim=1)
    ours = stacked.log_density(w)
    ref = torch.stack(
        [mvn_log_prob(flat(mean), c, w_flat) for mean, c in zip(means, curvs, strict=True)], 1
    )
    assert ours.shape == (num_points, len(members))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_log_density_matches_multivariate_normal(structure, members, curvatures) -> None:
    _check_against_mvn(members, curvatures[structure])


def test_log_density_default_backend_and_truncated_kron(members, data) -> None:
    x, y = data
    curvs = [fit_curvature(m, x, y, "kron") for m in members[:2]]  # default (MC) backend
    _check_against_mvn(members[:2], curvs)
    # rank-3 factors: the truncated precision is evaluated exactly as well
    shapes = curvs[0].param_shapes
    low = [KronCurvature.from_arrays(c.to_arrays(rank=3), shapes, T, SIGMA2) for c in curvs]
    assert low[0].factors["net.1.weight"].eigvecs_in.shape == (36, 3)
    _check_against_mvn(members[:2], low)
    _check_against_mvn(members[:2], [curvs[0], low[1]])  # mixed ranks are zero-padded


def test_half_precision_eigenvectors_stay_close(members, curvatures) -> None:
    curv = curvatures["kron"][0]
    arrays = curv.to_arrays(eigvec_dtype=np.float16)
    assert arrays["net.1.weight/eigvecs_in"].dtype == np.float16
    assert arrays["net.1.weight/eigvals_in"].dtype == np.float64
    half = KronCurvature.from_arrays(arrays, curv.param_shapes, T, SIGMA2)
    q = half.factors["net.1.weight"].eigvecs_in
    torch.testing.assert_close(q.T @ q, torch.eye(36, dtype=q.dtype), atol=1e-5, rtol=0)
    means = [dict(members[0].named_parameters())]
    w = points(members[0], 4, 0.05, seed=3)
    exact = StackedGaussians.from_members(means, [curv], "cpu").log_density(w)
    approx = StackedGaussians.from_members(means, [half], "cpu").log_density(w)
    torch.testing.assert_close(approx, exact, rtol=1e-2, atol=0)


def test_chunked_evaluation_equals_unchunked(members, curvatures) -> None:
    means = [dict(m.named_parameters()) for m in members]
    w = points(members[0], 3, 0.05, seed=4)
    for structure in STRUCTURES:
        whole = StackedGaussians.from_members(means, curvatures[structure], "cpu")
        tiny = StackedGaussians.from_members(means, curvatures[structure], "cpu", max_chunk_bytes=1)
        torch.testing.assert_close(tiny.log_density(w), whole.log_density(w), rtol=1e-12, atol=0)


def test_float32_stack_is_close_to_float64(members, curvatures) -> None:
    means = [dict(m.named_parameters()) for m in members]
    w = points(members[0], 3, 0.05, seed=5)
    for structure in STRUCTURES:
        ref = StackedGaussians.from_members(means, curvatures[structure], "cpu").log_density(w)
        st32 = StackedGaussians.from_members(
            means, curvatures[structure], "cpu", dtype=torch.float32
        )
        out = st32.log_density({n: v.float() for n, v in w.items()})
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# serialisation


@pytest.mark.parametrize("structure", STRUCTURES)
def test_arrays_round_trip_bit_exact(structure, curvatures) -> None:
    curv = curvatures[structure][0]
    arrays = curv.to_arrays()
    again = curvature_from_arrays(structure, arrays, curv.param_shapes, T, SIGMA2).to_arrays()
    assert arrays.keys() == again.keys()
    for key, value in arrays.items():
        assert value.dtype == again[key].dtype and value.shape == again[key].shape
        assert np.array_equal(value, again[key]), key
    rebuilt = type(curv).from_arrays(arrays, curv.param_shapes, T, SIGMA2)
    assert rebuilt.precision_logdet() == curv.precision_logdet()
    # arrays that passed the checks once decode to the same curvature without them
    trusted = curvature_from_arrays(structure, arrays, curv.param_shapes, T, SIGMA2,
                                    check_input=False)
    assert trusted.precision_logdet() == curv.precision_logdet()
    for key, value in trusted.to_arrays().items():
        assert np.array_equal(value, arrays[key]), key


@pytest.mark.parametrize(
    ("structure", "key"),
    [
        ("kron", "net.1.weight/eigvals_in"),
        ("kron", "net.3.weight/eigvecs_out"),
        ("diag", "net.3.weight/ggn_diag"),
        ("diag_full", "net.1.weight/ggn_diag"),
        ("diag_full", "net.3.weight/ggn_full"),
    ],
)
def test_from_arrays_rejects_bad_arrays(structure, key, curvatures) -> None:
    curv = curvatures[structure][0]
    cls = type(curv)
    good = curv.to_arrays()

    bad = dict(good)
    bad[key] = good[key].copy()
    bad[key].flat[0] = np.nan
    with pytest.raises(ValueError, match=rf"{key}.*non-finite"):
        cls.from_arrays(bad, curv.param_shapes, T, SIGMA2)

    bad = dict(good)
    bad[key] = good[key][:-1]
    with pytest.raises(ValueError, match=rf"{key}.*shape"):
        cls.from_arrays(bad, curv.param_shapes, T, SIGMA2)

    bad = {k: v for k, v in good.items() if k != key}
    with pytest.raises(ValueError, match=rf"missing array '{key}'"):
        cls.from_arrays(bad, curv.param_shapes, T, SIGMA2)

    bad = dict(good)
    bad["net.9.weight/ggn_diag"] = good[key]
    with pytest.raises(ValueError, match="unexpected arrays"):
        cls.from_arrays(bad, curv.param_shapes, T, SIGMA2)


def test_unchecked_decoding_skips_only_the_costly_checks(curvatures) -> None:
    """``check_input=False`` trusts a basis' orthonormality and a block's definiteness (what
    validate_upload checked once), never keys, shapes or round-off clipping."""
    kron = curvatures["kron"][0]
    arrays = kron.to_arrays()
    key = "net.3.weight/eigvecs_out"
    skewed = {**arrays, key: arrays[key] * 0.5}
    with pytest.raises(ValueError, match=rf"{key}.*not orthonormal"):
        KronCurvature.from_arrays(skewed, kron.param_shapes, T, SIGMA2)
    KronCurvature.from_arrays(skewed, kron.param_shapes, T, SIGMA2, check_input=False)
    with pytest.raises(ValueError, match=rf"{key}.*shape"):
        KronCurvature.from_arrays({**arrays, key: arrays[key][:-1]}, kron.param_shapes, T,
                                  SIGMA2, check_input=False)
    full = curvatures["diag_full"][0]
    arrays = full.to_arrays()
    block = arrays["net.3.weight/ggn_full"]
    indefinite = {**arrays, "net.3.weight/ggn_full": block - 2 * np.abs(block).max()
                  * np.eye(block.shape[0])}
    with pytest.raises(ValueError, match="positive semi-definite"):
        DiagFullCurvature.from_arrays(indefinite, full.param_shapes, T, SIGMA2)
    DiagFullCurvature.from_arrays(indefinite, full.param_shapes, T, SIGMA2, check_input=False)


def test_negative_eigenvalues_clipped_or_rejected(curvatures) -> None:
    curv = curvatures["kron"][0]
    key = "net.1.weight/eigvals_in"
    arrays = curv.to_arrays()
    vals = arrays[key].copy()
    scale = np.abs(vals).max()
    vals[0] = -1e-8 * scale  # eigh round-off: clipped to 0
    tiny = KronCurvature.from_arrays({**arrays, key: vals}, curv.param_shapes, T, SIGMA2)
    assert tiny.factors["net.1.weight"].eigvals_in.min() == 0
    vals[0] = -1e-3 * scale
    with pytest.raises(ValueError, match=rf"{key}.*negative"):
        KronCurvature.from_arrays({**arrays, key: vals}, curv.param_shapes, T, SIGMA2)

    diag = curvatures["diag"][0].to_arrays()
    diag["net.3.weight/ggn_diag"] = -diag["net.3.weight/ggn_diag"] - 1.0
    with pytest.raises(ValueError, match="net.3.weight/ggn_diag.*negative"):
        DiagCurvature.from_arrays(diag, curvatures["diag"][0].param_shapes, T, SIGMA2)

    full = curvatures["diag_full"][0].to_arrays()
    block = full["net.3.weight/ggn_full"]
    full["net.3.weight/ggn_full"] = block - 2 * np.abs(block).max() * np.eye(block.shape[0])
    with pytest.raises(ValueError, match="ggn_full.*positive semi-definite"):
        DiagFullCurvature.from_arrays(full, curvatures["diag_full"][0].param_shapes, T, SIGMA2)


# ---------------------------------------------------------------------------------------------
# mixture objective (Eq. 5)


def brute_force_objective(
    w_flat, means, curvs, clients: list[list[int]], prior_var
) -> torch.Tensor:
    total = torch.zeros(w_flat.shape[0], dtype=torch.float64)
    for members in clients:
        logs = torch.stack(
            [math.log(1 / len(members)) + mvn_log_prob(means[k], curvs[k], w_flat) for k in members]
        )
        total = total + torch.logsumexp(logs, dim=0)
    d = w_flat.shape[1]
    prior = MultivariateNormal(
        torch.zeros(d, dtype=torch.float64), prior_var * torch.eye(d, dtype=torch.float64)
    )
    return total - (len(clients) - 1) * prior.log_prob(w_flat)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_mixture_log_posterior_matches_brute_force(structure, members, curvatures) -> None:
    curvs = curvatures[structure]
    means = [dict(m.named_parameters()) for m in members]
    stacked = StackedGaussians.from_members(means, curvs, "cpu")
    client_of_component = torch.tensor([0, 1, 1, 1])  # M_c = (1, 3)
    w = points(members[1], 4, 0.03, seed=6)
    w_flat = torch.cat([v.reshape(4, -1) for v in w.values()], dim=1)
    ours = mixture_log_posterior(w, stacked, client_of_component, 2, SIGMA2)
    ref = brute_force_objective(w_flat, [flat(m) for m in means], curvs, [[0], [1, 2, 3]], SIGMA2)
    assert ours.shape == (4,)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-7)


def test_mixture_gradient_matches_finite_differences(members, curvatures) -> None:
    means = [dict(m.named_parameters()) for m in members]
    stacked = StackedGaussians.from_members(means, curvatures["kron"], "cpu")
    client_of_component = torch.tensor([0, 1, 1, 1])
    w = {n: v.requires_grad_(True) for n, v in points(members[2], 2, 0.03, seed=7).items()}
    mixture_log_posterior(w, stacked, client_of_component, 2, SIGMA2).sum().backward()
    eps = 1e-6
    for name, index in [("net.1.weight", (0, 3, 5)), ("net.3.weight", (1, 2, 7))]:
        plus = {n: v.detach().clone() for n, v in w.items()}
        minus = {n: v.detach().clone() for n, v in w.items()}
        plus[name][index] += eps
        minus[name][index] -= eps
        f_plus = mixture_log_posterior(plus, stacked, client_of_component, 2, SIGMA2).sum()
        f_minus = mixture_log_posterior(minus, stacked, client_of_component, 2, SIGMA2).sum()
        numeric = (f_plus - f_minus) / (2 * eps)
        assert w[name].grad[index].item() == pytest.approx(numeric.item(), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("structure", STRUCTURES)
def test_pair_log_densities_equal_the_full_grid(structure, members, curvatures) -> None:
    means = [dict(m.named_parameters()) for m in members]
    stacked = StackedGaussians.from_members(means, curvatures[structure], "cpu",
                                            max_chunk_bytes=4096)  # forces several chunks
    w = points(members[0], 3, 0.05, seed=11)
    full = stacked.log_density(w)  # [3, 4]
    runs, comps = torch.tensor([2, 0, 1, 2]), torch.tensor([3, 1, 1, 0])
    torch.testing.assert_close(stacked.log_density_pairs(w, runs, comps), full[runs, comps],
                               rtol=1e-12, atol=1e-9)


def test_pairs_too_many_to_cache_leave_no_stale_entry(members, curvatures, monkeypatch) -> None:
    """Kron factors gathered per pair are cached for the next call with the same pairs while
    they fit; a pair list over the cap drops the older entry, so no later call compares its
    pairs with a stale list (a comparison on the device waits for the queued work, and fails
    inside a CUDA graph's capture). The densities stay exact either way."""
    means = [dict(m.named_parameters()) for m in members]
    stacked = StackedGaussians.from_members(means, curvatures["kron"], "cpu", max_chunk_bytes=1)

    def size(name: str, comps: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size()
                   for _, factors in stacked._gathered(name, comps) for t in factors)

    big = max(stacked.layers, key=lambda name: size(name, torch.tensor([0])))
    monkeypatch.setattr(stacked_gaussians, "MAX_PAIR_CACHE_BYTES",
                        3 * size(big, torch.tensor([0])))
    comparisons = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: comparisons.append(1) or real_equal(a, b))
    w = points(members[0], 3, 0.05, seed=11)
    full = stacked.log_density(w)
    few = (torch.tensor([0, 1]), torch.tensor([3, 1]))
    many = (torch.tensor([2, 0, 1, 2]), torch.tensor([3, 1, 1, 0]))
    for runs, comps in (few, many, few, many):
        torch.testing.assert_close(stacked.log_density_pairs(w, runs, comps), full[runs, comps],
                                   rtol=1e-12, atol=1e-9)
    stacked._gathered(big, few[1])
    assert big in stacked._pair_cache  # 2 pairs fit
    stacked._gathered(big, many[1])
    assert big not in stacked._pair_cache  # 4 pairs do not, and the 2 pairs' entry is gone
    comparisons.clear()
    stacked._gathered(big, many[1].clone())
    assert comparisons == []  # nothing compared with a stale list


def test_pruned_mixture_objective_is_exact_up_to_the_dropped_weight(members, curvatures) -> None:
    """Dropping components g nats below their client's best changes client c's logsumexp by
    log(1 + sum_dropped e^-g) <= (M_c - 1) e^-g_min; a margin covering every gap changes
    nothing, values and gradients alike."""
    means = [dict(m.named_parameters()) for m in members]
    stacked = StackedGaussians.from_members(means, curvatures["kron"], "cpu")
    owner = torch.tensor([0, 1, 1, 1])  # M_c = (1, 3)
    w = {n: v.requires_grad_(True) for n, v in points(members[2], 2, 0.02, seed=12).items()}
    full = mixture_log_posterior(w, stacked, owner, 2, SIGMA2)
    (full_grad,) = torch.autograd.grad(full.sum(), [w["net.1.weight"]])

    tight = MixtureObjective(stacked, owner, 2, SIGMA2, margin=1e-6)
    pruned = tight(w)
    assert tight.report()["active_pairs"] == [4]  # one member per client and run
    gap = tight.min_excluded_gap
    assert 0 < gap < math.inf
    assert torch.all(full - pruned >= -1e-9)
    assert torch.all(full - pruned <= 2 * math.exp(-gap) + 1e-9)

    wide = MixtureObjective(stacked, owner, 2, SIGMA2, margin=1e12)
    (wide_grad,) = torch.autograd.grad(wide(w).sum(), [w["net.1.weight"]])
    # the pair path and the all-pairs path group the same float64 products differently
    torch.testing.assert_close(wide(w), full, rtol=1e-12, atol=0)
    torch.testing.assert_close(wide_grad, full_grad, rtol=1e-12, atol=1e-12)
    assert wide.report()["active_pairs"] == [8]


def near_two_members(members, curvatures, structure: str, refresh_every: int):
    """A pruned objective over members 0-3 (client 0 owns member 0, client 1 the others) and
    two points: run 0 at member 1, run 1 at member 3."""
    means = [dict(m.named_parameters()) for m in members]
    stacked = StackedGaussians.from_members(means, curvatures[structure], "cpu")
    owner = torch.tensor([0, 1, 1, 1])
    objective = MixtureObjective(stacked, owner, 2, SIGMA2, margin=1e-6,
                                 refresh_every=refresh_every)
    near = {name: torch.stack([p.detach(), members[3].get_parameter(name).detach()])
            for name, p in members[1].named_parameters()}
    return objective, stacked, owner, near


def test_pruned_objective_refreshes_its_active_set(members, curvatures) -> None:
    """The active set follows the points: moving a run onto another member of client 1 makes
    that member the active one at the next refresh. Refreshes that change nothing while every
    excluded member is far away come less often (the interval doubles); a change resets it.
    Each run has its own schedule."""
    objective, _, _, near = near_two_members(members, curvatures, "diag", refresh_every=2)
    objective(near)  # call 0: refreshed; the other members are far beyond the margin
    assert objective.active[0].tolist() == [True, True, False, False]
    assert objective.active[1].tolist() == [True, False, False, True]
    assert objective.interval.tolist() == [4, 4] and objective.next_refresh.tolist() == [4, 4]
    swapped = {name: v.flip(0) for name, v in near.items()}
    for _ in range(3):  # calls 1-3: no refresh yet, the stale set is used
        objective(swapped)
        assert objective.active[0].tolist() == [True, True, False, False]
    objective(swapped)  # call 4: refreshed, the set changed: back to every 2 calls
    assert objective.active[0].tolist() == [True, False, False, True]
    assert objective.set_changes == 1 and objective.refreshes == 2
    assert objective.interval.tolist() == [2, 2]
    objective(swapped)  # call 5: not refreshed
    objective(swapped)  # call 6: refreshed, unchanged and far: the interval doubles again
    assert objective.refreshes == 3 and objective.set_changes == 1
    assert objective.interval.tolist() == [4, 4]


def test_runs_refresh_on_their_own_schedules(members, curvatures) -> None:
    """A run near a switch is re-checked every ``refresh_every`` calls without making the far
    runs re-evaluate their components; its refresh chooses the pairs a full one would."""
    objective, stacked, owner, near = near_two_members(members, curvatures, "diag",
                                                       refresh_every=2)
    objective.interval = torch.tensor([8, 2])
    objective.next_refresh = torch.tensor([8, 2])
    objective.refresh(near)  # every run, as at call 0
    objective.calls = 2
    swapped = {name: v.flip(0) for name, v in near.items()}
    objective(swapped)  # call 2: run 1 only
    assert objective.runs_refreshed == 2 + 1
    assert objective.active[0].tolist() == [True, True, False, False]  # stale: not due
    full = MixtureObjective(stacked, owner, 2, SIGMA2, margin=1e-6)
    full.refresh(swapped)
    assert objective.active[1].tolist() == full.active[1].tolist()


def test_prepare_says_when_the_evaluated_pairs_change(members, curvatures) -> None:
    """``prepare`` (refresh when due) and ``evaluate`` (no device read-back: what a CUDA graph
    captures) make up a call; ``prepare`` is True exactly when ``evaluate`` will use new pair
    tensors, and an unchanged refresh keeps the very same tensors (a graph still reads them)."""
    objective, stacked, owner, near = near_two_members(members, curvatures, "kron",
                                                       refresh_every=1)
    assert objective.prepare(near)  # the first refresh
    pairs = objective.pairs
    value = objective.evaluate(near)
    torch.testing.assert_close(value, MixtureObjective(stacked, owner, 2, SIGMA2,
                                                       margin=1e-6)(near), rtol=0, atol=0)
    while objective.refreshes < 2:  # not due (False), then refreshed, unchanged (False)
        assert not objective.prepare(near)
    assert objective.pairs is pairs
    swapped = {name: v.flip(0) for name, v in near.items()}
    while objective.refreshes < 3:
        new = objective.prepare(swapped)
    assert new and objective.pairs is not pairs and objective.set_changes == 1


def test_mixture_rejects_client_without_component(members, curvatures) -> None:
    means = [dict(m.named_parameters()) for m in members]
    stacked = StackedGaussians.from_members(means, curvatures["diag"], "cpu")
    w = points(members[0], 1, 0.01, seed=8)
    with pytest.raises(ValueError, match=r"clients \[2\] have no component"):
        mixture_log_posterior(w, stacked, torch.tensor([0, 1, 1, 1]), 3, SIGMA2)


# ---------------------------------------------------------------------------------------------
# fitting


def test_fit_leaves_model_untouched_and_mc_fit_is_seeded(members, data) -> None:
    x, y = data
    model = members[3]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    first = fit_curvature(model, x, y, "kron", seed=3)
    second = fit_curvature(model, x, y, "kron", seed=3)
    other = fit_curvature(model, x, y, "kron", seed=4)
    for key, value in first.to_arrays().items():
        assert np.array_equal(value, second.to_arrays()[key]), key
    assert first.precision_logdet() != other.precision_logdet()
    assert model.training  # laplace-torch's .eval() acted on a copy
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    assert not hasattr(model, "output_size")


@pytest.mark.parametrize("bias", [False, True])
def test_last_layer_block_equals_laplace_torchs_last_layer_ggn(bias, data) -> None:
    """The closed form sum_n G_n (x) psi psi^T, in laplace-torch's parameter order (vec(W),
    then b), equals laplace-torch's last-layer "full" Laplace with an exact-GGN backend."""
    x, y = data
    torch.manual_seed(5)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, HIDDEN, bias=False), nn.Tanh(),
                          nn.Linear(HIDDEN, CLASSES, bias=bias)).double()
    train(model, x, y, steps=10)
    la = fit_laplace(model, x, y, "full", subset_of_weights="last_layer", last_layer_name="3",
                     temperature=T, prior_var=SIGMA2, backend="asdl_ggn")
    ours = last_layer_block(model, "3", x, y, "ggn", batch_size=64)
    assert ours.shape == (CLASSES * (HIDDEN + bias),) * 2
    torch.testing.assert_close(ours, la.H.double(), rtol=1e-9, atol=1e-9)


def test_last_layer_block_empirical_fisher_is_the_gradient_outer_product(members, data) -> None:
    x, y = data
    model = members[1]
    last = model.net[3].weight
    grads = torch.stack([torch.autograd.grad(
        nn.functional.cross_entropy(model(x[n : n + 1]), y[n : n + 1], reduction="sum"),
        last)[0].reshape(-1) for n in range(len(y))])
    ours = last_layer_block(model, "net.3", x, y, "ef", batch_size=64)
    torch.testing.assert_close(ours, grads.T @ grads, rtol=1e-9, atol=1e-9)


def test_diag_full_reuses_a_given_diagonal(members, data, curvatures) -> None:
    x, y = data
    reused = fit_curvature(members[0], x, y, "diag_full", temperature=T, prior_var=SIGMA2,
                           backend=EXACT, diagonal=curvatures["diag"][0])
    for key, value in curvatures["diag_full"][0].to_arrays().items():
        np.testing.assert_array_equal(reused.to_arrays()[key], value, err_msg=key)


def test_lenet_conv_layout_and_last_layer() -> None:
    """Conv weights are viewed as [out, in*k*k]; diag_full's dense block is LeNet's fc 84->10."""
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10)
    x, y = torch.randn(48, 1, 28, 28), torch.randint(0, 10, (48,))
    kron = fit_curvature(model, x, y, "kron", batch_size=16)
    assert list(kron.factors) == [n for n, _ in model.named_parameters()]
    conv2 = kron.factors["features.3.weight"]
    assert conv2.eigvecs_out.shape == (16, 16) and conv2.eigvecs_in.shape == (150, 150)
    assert math.isfinite(kron.precision_logdet())
    full = fit_curvature(model, x, y, "diag_full", batch_size=16)
    assert full.last_names == ["classifier.4.weight"]
    assert full.to_arrays()["classifier.4.weight/ggn_full"].shape == (840, 840)
    means = [{n: p.detach() for n, p in model.named_parameters()}]
    w = {n: p[None] + 0.01 for n, p in means[0].items()}
    for curv in (kron, full):
        out = StackedGaussians.from_members(means, [curv], "cpu").log_density(w)
        assert out.shape == (1, 1) and out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("shape", [(6, 25, 576), (6, 150, 64), (6, 6, 576), (6, 16, 64)])
def test_asdl_conv_kron_factors_equal_the_brute_force_gram(shape) -> None:
    """The installed conv K-FAC factors equal sum over samples and positions of x x^T."""
    from asdl.operations.conv import Conv2d

    from fedfusion.accel import asdl_speedup

    x = torch.randn(*shape, dtype=torch.float64)
    brute = torch.einsum("nkl,njl->kj", x, x)
    assert asdl_speedup.prefers_batched(x) == (4 * shape[1] <= shape[2])
    with asdl_speedup.patched() as used:
        assert used
        torch.testing.assert_close(Conv2d.cov_kron_B(None, x), brute, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(Conv2d.cov_kron_A(None, x), brute / shape[2], rtol=1e-12,
                                   atol=1e-12)


def test_asdl_speedup_fit_equals_asdls_own_factors(monkeypatch) -> None:
    """A LeNet MC K-FAC fit gives the same factors with ASDL's original conv functions."""
    from fedfusion.accel import fast_kron

    monkeypatch.setattr(fast_kron, "kron_mc_factors", lambda *args: None)  # laplace-torch's fit
    torch.manual_seed(0)
    net = build_model("lenet", (1, 28, 28), 10)
    x, y = torch.randn(96, 1, 28, 28), torch.randint(0, 10, (96,))
    fast = fit_curvature(net, x, y, "kron", batch_size=32, accelerate=True)  # patched ASDL
    slow = fit_curvature(net, x, y, "kron", batch_size=32, accelerate=False)  # ASDL's own
    for name, factor in slow.factors.items():
        for attr in ("eigvals_in", "eigvals_out"):
            torch.testing.assert_close(getattr(fast.factors[name], attr),
                                       getattr(factor, attr), rtol=1e-5, atol=1e-6)


def test_server_never_imports_laplace_and_clients_import_it_once() -> None:
    """The server side (strategies, ServerApp) stays free of laplace-torch (~0.3 GB per
    process); ``import_laplace`` loads it once and reports the time it took."""
    script = (
        "import sys\n"
        "import fedfusion.server_app, fedfusion.strategies, fedfusion.curvature\n"
        "assert 'laplace' not in sys.modules, 'the server side imported laplace-torch'\n"
        "from fedfusion.curvature import import_laplace\n"
        "first, second = import_laplace(), import_laplace()\n"
        "assert 'laplace' in sys.modules\n"
        "assert first > 0 and second == 0, (first, second)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("structure", STRUCTURES)
def test_pair_gradients_are_bit_identical_on_several_threads(structure, members, curvatures
                                                              ) -> None:
    """Many pairs share a run, so the gradient sums over them; a parallel atomic scatter
    (the backward of ``w[runs]``) sums in a racy order and made FedBEns' server differ from
    one replay of the same uploads to the next on 2 threads (float32, the server's dtype)."""
    means = [dict(m.named_parameters()) for m in members]
    stacked = StackedGaussians.from_members(means, curvatures[structure], "cpu",
                                            dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    runs, comps = torch.randint(0, 3, (2000,), generator=gen), torch.randint(0, 4, (2000,),
                                                                             generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(6):
            w = {n: v.float().requires_grad_(True)
                 for n, v in points(members[1], 3, 0.05, 5).items()}
            stacked.pair_quadratic_form(w, runs, comps).sum().backward()
            grads.append(torch.cat([v.grad.reshape(-1) for v in w.values()]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(g, grads[0]) for g in grads[1:])
