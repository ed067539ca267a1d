"""Attention layers and parameters read without calling their module, in Kron curvature and
RegMean's Gram (:mod:`fedfusion.capture`).

* the Kron factors of ``nn.MultiheadAttention``'s packed in-projection and its out-projection
  against K-FAC factors built by hand from a hand-written attention (autograd on explicit
  ``q, k, v`` and attention-output tensors), with and without a causal mask; the learned
  position ``nn.Parameter``'s diagonal against per-sample gradients;
* RegMean's Grams of an ``nn.TransformerEncoderLayer`` in eval mode without grad (where
  PyTorch would take its fused fast path, bypassing every submodule) against the inputs
  collected explicitly;
* the rules for the rest: a layer never applied has zero factors and a zero Gram; one read
  without a capturable call is refused naming it and the ``diag`` alternative; a user's
  ``F.linear`` on its own ``nn.Parameter`` is a diagonal block.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedfusion.capture import linear_maps
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.state import StateLayout
from fedfusion.curvature import curvature_from_arrays
from fedfusion.curvature.fit import fit_curvature
from fedfusion.curvature.hybrid import hybrid_kron_fit
from fedfusion.sections.gram import layer_grams, model_gram_sizes

DIM, HEADS, TOKENS, CLASSES = 4, 2, 5, 3


class AttnNet(nn.Module):
    """Linear token embedding, a learned position Parameter, one self-attention
    ``nn.MultiheadAttention`` (optionally causal), mean over tokens, Linear head."""

    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, DIM)
        self.position = nn.Parameter(0.5 * torch.randn(1, TOKENS, DIM))
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.head = nn.Linear(DIM, CLASSES)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position
        mask = (nn.Transformer.generate_square_subsequent_mask(TOKENS, dtype=h.dtype)
                if self.causal else None)
        out, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=self.causal)
        return self.head(torch.tanh(out).mean(1))


def _hand_forward(model: AttnNet, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The logits of ``model`` with the attention written out: ``qkv = h W_in^T + b_in``,
    per head ``softmax(q k^T / sqrt(d_h) + mask) v``, ``out = o W_out^T + b_out``; returns the
    explicit tensors (``qkv``, ``o``, ``out`` retain their gradients)."""
    attn = model.attn
    h = model.embed(x) + model.position
    qkv = h @ attn.in_proj_weight.T + attn.in_proj_bias
    qkv.retain_grad()
    q, k, v = (t.reshape(len(x), TOKENS, HEADS, DIM // HEADS).transpose(1, 2)
               for t in qkv.chunk(3, -1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS)
    if model.causal:
        scores = scores + torch.triu(torch.full((TOKENS, TOKENS), float("-inf"),
                                                dtype=x.dtype), 1)
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(len(x), TOKENS, DIM)
    out = o @ attn.out_proj.weight.T + attn.out_proj.bias
    out.retain_grad()
    logits = model.head(torch.tanh(out).mean(1))
    return logits, {"h": h.detach(), "qkv": qkv, "o": o.detach(), "out": out}


def _sampled_targets(model: nn.Module, x: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        probs = torch.softmax(model(x).float(), -1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_kron_factors_equal_kfac_built_by_hand(causal):
    """In-projection: B = sum_{n,l} g_nl g_nl^T with g = dL/d[q;k;v] at every token,
    A = sum_{n,l} h_nl h_nl^T / N with h the attention's input; out-projection the same with
    the attention output o and g = dL/d out; each bias gets its B. The learned position's
    diagonal is sum_n (dL_n/d position)^2 from per-sample gradients."""
    torch.manual_seed(0)
    model = AttnNet(causal).double().eval()
    x = torch.randn(7, TOKENS, 3, dtype=torch.float64)
    factors, diagonals = hybrid_kron_fit(model, x, seed=3, batch_size=64)
    assert set(diagonals) == {"position"}
    targets = _sampled_targets(model, x, 3)
    logits, t = _hand_forward(model, x)
    F.cross_entropy(logits, targets, reduction="sum").backward()
    g_in, g_out = _rows(t["qkv"].grad), _rows(t["out"].grad)
    h, o = _rows(t["h"]), _rows(t["o"])
    expected = {
        "attn.in_proj_weight": (g_in.T @ g_in, h.T @ h / len(x)),
        "attn.out_proj.weight": (g_out.T @ g_out, o.T @ o / len(x)),
    }
    for name, (b, a) in expected.items():
        torch.testing.assert_close(factors[name][0], b, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(factors[name][1], a, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(factors["attn.in_proj_bias"][1], g_in.T @ g_in)
    torch.testing.assert_close(factors["attn.out_proj.bias"][1], g_out.T @ g_out)
    assert g_in[:, :DIM].abs().max() > 0 and g_in[:, DIM:2 * DIM].abs().max() > 0  # q and k
    # the position Parameter is read without a module: diagonal, per-sample gradients
    brute = torch.zeros_like(model.position)
    for xi, ti in zip(x, targets, strict=True):
        model.zero_grad()
        F.cross_entropy(model(xi[None]), ti[None], reduction="sum").backward()
        brute += model.position.grad**2
    torch.testing.assert_close(diagonals["position"], brute, rtol=1e-9, atol=1e-14)


def test_one_sample_one_token_kron_block_is_the_exact_fisher_block():
    """N = 1, L = 1: K-FAC is exact, B (x) A = vec(G) vec(G)^T with G the gradient of the
    sampled loss with respect to in_proj_weight (row-major vec, laplace-torch's layout)."""
    torch.manual_seed(2)
    model = nn.Sequential()
    attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True).double()

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.head = attn, nn.Linear(DIM, CLASSES).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attn(x, x, x, need_weights=False)[0][:, 0])

    model = One().eval()
    x = torch.randn(1, 1, DIM, dtype=torch.float64)
    factors, _ = hybrid_kron_fit(model, x, seed=1)
    target = _sampled_targets(model, x, 1)
    model.zero_grad()
    F.cross_entropy(model(x), target, reduction="sum").backward()
    for name, param in (("attn.in_proj_weight", attn.in_proj_weight),
                        ("attn.out_proj.weight", attn.out_proj.weight)):
        vec = param.grad.flatten()
        b, a = factors[name]
        torch.testing.assert_close(torch.kron(b, a), torch.outer(vec, vec), rtol=1e-9,
                                   atol=1e-14)


class EncoderNet(nn.Module):
    """A learned position Parameter and one ``nn.TransformerEncoderLayer`` (batch_first, an
    even number of heads, ReLU: the conditions of PyTorch's fused fast path in eval mode)."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.randn(1, TOKENS, DIM))
        self.enc = nn.TransformerEncoderLayer(DIM, HEADS, 8, dropout=0.0, batch_first=True,
                                              norm_first=norm_first)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x + self.position).mean(1))


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
def test_gram_of_an_encoder_layer_equals_the_collected_inputs(norm_first):
    """Every linear map's Gram is [a, 1]^T [a, 1] summed over samples and tokens, with the
    inputs collected here on the unfused path: the attention's input (its query), the
    attention output (recomputed by hand), the feed-forward layers' inputs. In eval mode
    without grad PyTorch's fused fast path bypasses every submodule (this torch skips it
    once a hook is attached; the capture also switches it off); the Gram must not be fooled."""
    torch.manual_seed(4)
    model = EncoderNet(norm_first).eval()
    x = torch.randn(9, TOKENS, DIM)
    enc = model.enc
    grams = layer_grams(model, x, batch_size=4)
    assert torch.backends.mha.get_fastpath_enabled()  # restored
    collected: dict[str, list[torch.Tensor]] = {}

    def keep(name: str):  # noqa: ANN202
        return lambda _m, args, _o: collected.setdefault(name, []).append(args[0].detach())

    handles = [enc.self_attn.register_forward_hook(keep("enc.self_attn.in_proj_weight")),
               enc.linear1.register_forward_hook(keep("enc.linear1.weight")),
               enc.linear2.register_forward_hook(keep("enc.linear2.weight")),
               model.head.register_forward_hook(keep("head.weight"))]
    with torch.enable_grad():  # grad on: the unfused path, every submodule called
        model(x)
    for handle in handles:
        handle.remove()
    query = collected["enc.self_attn.in_proj_weight"][0]
    qkv = F.linear(query, enc.self_attn.in_proj_weight, enc.self_attn.in_proj_bias)
    q, k, v = (t.reshape(len(x), TOKENS, HEADS, -1).transpose(1, 2) for t in qkv.chunk(3, -1))
    weights = (q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS)).softmax(-1)
    collected["enc.self_attn.out_proj.weight"] = [
        (weights @ v).transpose(1, 2).reshape(len(x), TOKENS, DIM).detach()]
    assert set(grams) == set(collected) == set(model_gram_sizes(model))
    for name, inputs in collected.items():
        rows = _rows(inputs[0]).double()
        rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1)
        np.testing.assert_allclose(grams[name], (rows.T @ rows).numpy(), rtol=1e-4,
                                   atol=1e-4)


class Unused(nn.Module):
    """A Linear layer that is never applied and one whose weight is read by a matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare, self.read = nn.Linear(4, 3), nn.Linear(4, 4), nn.Linear(4, 4)
        self.read_by_matmul = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.read_by_matmul:
            x = x @ self.read.weight.T
        return self.used(x)


def test_unused_layers_have_zero_blocks_and_uncaptured_reads_are_refused_by_name():
    """A layer never applied: zero Kron factors and a zero Gram (exact: it sees no input),
    never "remove it"; a Linear weight read by a user's matmul: no capturable call, refused
    naming it and the diagonal structure."""
    torch.manual_seed(5)
    model = Unused()
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    factors, _ = hybrid_kron_fit(model, x)
    for name in ("spare.weight", "read.weight"):
        assert not factors[name][0].any() and not factors[name][1].any()
    assert factors["used.weight"][1].abs().max() > 0
    grams = layer_grams(model, x)
    assert not grams["spare.weight"].any() and grams["used.weight"].any()
    model.read_by_matmul = True
    with pytest.raises(ValueError, match=r"'read.weight'.*hessian_structure='diag'") as info:
        fit_curvature(model, x, y, "kron")
    assert "remove" not in str(info.value)
    assert fit_curvature(model, x, y, "diag").to_arrays()["read.weight/ggn_diag"].any()


class UserLinear(nn.Module):
    """A user's layer: ``F.linear`` on its own ``nn.Parameter`` (no Linear module)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(F.linear(x, self.weight)))


def test_a_users_functional_linear_parameter_is_a_diagonal_block_through_the_server():
    torch.manual_seed(6)
    model = UserLinear()
    x, y = torch.randn(12, 4), torch.randint(0, 2, (12,))
    arrays = fit_curvature(model, x, y, "kron").to_arrays()
    assert arrays["weight/ggn_diag"].shape == (3, 4) and arrays["weight/ggn_diag"].any()
    layout = ModelSpec.from_model_fn(UserLinear).param_shapes()
    curvature = curvature_from_arrays("kron", arrays, layout, 1.0, 1.0)
    assert set(curvature.diagonals) == {"weight"}
    assert "weight" not in model_gram_sizes(model)


@pytest.mark.parametrize("name,shape", [("vit", (1, 28, 28)), ("token_transformer", (64,))])
def test_zoo_transformers_kron_blocks_are_the_layouts_and_pass_the_server(name, shape):
    """Every linear map (the attention in- and out-projections included) has Kron factors,
    every other parameter (LayerNorm, Embedding, the position Parameter) a diagonal block;
    the server's layout, built on the meta device, expects exactly that."""
    spec = ModelSpec(name, shape, 10)
    torch.manual_seed(7)
    model = spec.build()
    x = (torch.randint(0, 17, (6, *shape)) if name == "token_transformer"
         else torch.randn(6, *shape))
    y = torch.randint(0, 10, (6,))
    curvature = fit_curvature(model, x, y, "kron")
    layout = spec.param_shapes()
    assert isinstance(layout, StateLayout)
    assert set(curvature.factors) == set(layout.kron)
    assert any(n.endswith("in_proj_weight") for n in layout.kron)
    assert {n.rsplit(".", 1)[-1] for n in curvature.diagonals} <= {"weight", "bias", "position"}
    rebuilt = curvature_from_arrays("kron", curvature.to_arrays(), layout, 1.0, 1.0)
    assert set(rebuilt.diagonals) == set(curvature.diagonals)
    maps = linear_maps(model)
    assert {m.kind for m in maps.values()} >= {"attention", "linear"}


def test_curvature_blocks_per_structure_and_the_summary_line(capsys):
    """Which parameter gets which block, from the server's layout alone, and the summary's
    ``blocks`` line built from a strategy report."""
    from fedfusion.app.summary import print_summary
    from fedfusion.curvature import curvature_blocks

    layout = ModelSpec("vit", (1, 28, 28), 10, {"dim": 8, "heads": 2, "layers": 1}
                       ).param_shapes()
    kron = curvature_blocks("kron", layout)
    assert "encoder.encoder.layers.0.self_attn.in_proj_weight" in kron["kron"]
    assert "encoder.encoder.layers.0.self_attn.out_proj.weight" in kron["kron"]
    assert {"encoder.position", "encoder.norm.weight"} <= set(kron["diagonal"])
    assert sorted(kron["kron"] + kron["diagonal"]) == sorted(layout.parameters)
    assert curvature_blocks("diag", layout) == {"kron": [], "diagonal": list(layout.parameters)}
    assert curvature_blocks("diag_full", layout)["full"] == ["encoder.head.weight",
                                                             "encoder.head.bias"]
    settings = {"strategy": "fedbens", "num-rounds": 1, "dataset": "fmnist",
                "partitioner": "dirichlet", "alpha": 0.5, "seed": 0, "num-clients": 3}
    print_summary({"settings": settings, "status": "ok", "output_dir": "out",
                   "strategy_report": {"curvature_blocks": kron}})
    line = next(x for x in capsys.readouterr().out.splitlines() if "blocks" in x)
    assert f"kron {len(kron['kron'])} | diagonal {len(kron['diagonal'])} (" in line


class TokenEncoder(nn.Module):
    """Integer tokens through nn.Embedding, one nn.TransformerEncoderLayer (attention,
    LayerNorms, feed-forward), mean over tokens, Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


def test_diag_of_an_encoder_layer_is_the_exact_ggn_diagonal_without_warnings():
    """The default ``diag`` fit of a token transformer (Embedding, packed attention
    in-projection, LayerNorm, feed-forward) against the exact GGN diagonal sum_n
    diag(J_n^T (diag p_n - p_n p_n^T) J_n) from per-sample Jacobians: the MC-Fisher estimate
    (one sampled label per row, 600 rows) is within 5% in every parameter's total and
    correlates > 0.95 entry by entry. The fit leaves no FutureWarning from laplace-torch's
    dependencies (ASDL's non-full backward hooks warned 8 times per upload)."""
    torch.manual_seed(0)
    model = TokenEncoder().eval()
    x = torch.randint(0, 11, (600, TOKENS))
    y = torch.randint(0, CLASSES, (600,))
    params = {name: p.detach() for name, p in model.named_parameters()}
    jac = torch.func.vmap(torch.func.jacrev(
        lambda p, row: torch.func.functional_call(model, p, (row[None],))[0]),
        in_dims=(None, 0))(params, x)
    with torch.no_grad():
        prob = model(x).softmax(-1).double()
    ggn = torch.diag_embed(prob) - prob[:, :, None] * prob[:, None, :]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays = fit_curvature(model, x, y, "diag").to_arrays()
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]
    for name, j in jac.items():
        j = j.flatten(2).double()
        exact = torch.einsum("nkp,nkl,nlp->p", j, ggn, j)
        fitted = torch.as_tensor(arrays[f"{name}/ggn_diag"]).double().flatten()
        assert float(fitted.sum()) == pytest.approx(float(exact.sum()), rel=0.05), name
        assert torch.corrcoef(torch.stack([fitted, exact]))[0, 1] > 0.95, name


def test_quiet_laplace_silences_only_the_backward_hook_warning_asdl_is_immune_to():
    """ASDL reads a hook's grad_output: torch's "multiple autograd Nodes" variant (which
    loses grad_input) is silenced inside a fit; the variants that lose grad_output would mean
    a wrong fit and still warn."""
    from fedfusion.curvature.fit import quiet_laplace

    class TwoOutputs(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x.exp()  # outputs from different autograd Nodes

    def warned(module: nn.Module, x: torch.Tensor) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_laplace():
                handle = module.register_backward_hook(lambda *args: None)
                out = module(x)
                sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
                handle.remove()
        return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]

    x = torch.randn(3, 4, requires_grad=True)
    assert warned(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), x) == []
    loud = warned(TwoOutputs(), x)
    assert loud and all("different autograd Nodes" in text for text in loud)
