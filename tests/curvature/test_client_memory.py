"""The client's curvature fit is bounded by its pass, not by the data: the hybrid Kron fit
(K-FAC blocks + diagonal blocks) goes through the data in passes of bounded rows, gives the
same factors whatever the pass size, and keeps no autograd graph between passes.

The memory and time targets themselves are measured by benchmarks/client_memory.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.user_models import BNNet, CustomNet, LNNet, with_stats
from torch import nn

from fedfusion import client
from fedfusion.curvature import hybrid
from fedfusion.curvature.hybrid import hybrid_kron_fit, pass_rows, row_bytes


def _model_and_data(net: type[nn.Module], rows: int = 23) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(3)
    model = with_stats(net()) if net is BNNet else net().eval()
    x = torch.randn(rows, 8) if net is LNNet else torch.randn(rows, 1, 8, 8)
    return model, x


def _same_fit(first: tuple, second: tuple) -> bool:
    """Equal factors and diagonal blocks to float rounding: ``max |a - b|`` within 1e-5 of
    ``max |a|`` for every block (float32 sums in another order)."""
    (factors_a, diag_a), (factors_b, diag_b) = first, second
    pairs = [(a, b) for name in factors_a
             for a, b in zip(factors_a[name], factors_b[name], strict=True)]
    pairs += [(diag_a[name], diag_b[name]) for name in diag_a]
    return (factors_a.keys() == factors_b.keys() and diag_a.keys() == diag_b.keys()
            and all(float((a - b).abs().max()) <= 1e-5 * float(a.abs().max()) for a, b in pairs))


@pytest.mark.parametrize("net", [BNNet, LNNet, CustomNet])
def test_the_fit_in_passes_equals_the_fit_in_one_pass_over_the_whole_data(net, monkeypatch):
    """Whole data in one pass (batch = N, no byte budget) against passes of 5 rows (the
    batch size) and of 2 rows (the byte budget, conv patches per sample): the same factors
    and diagonal blocks to float rounding (the labels are drawn row after row from one
    generator)."""
    model, x = _model_and_data(net)
    monkeypatch.setattr(hybrid, "PASS_BYTES", 1 << 40)
    whole = hybrid_kron_fit(model, x, seed=4, batch_size=len(x))
    assert _same_fit(whole, hybrid_kron_fit(model, x, seed=4, batch_size=5))
    monkeypatch.setattr(hybrid, "PASS_BYTES", 2 * row_bytes(model, x) + 1)
    monkeypatch.setattr(hybrid, "PATCH_BYTES", 1)  # and im2col patches one sample at a time
    assert pass_rows(model, x, 256) == 2
    assert _same_fit(whole, hybrid_kron_fit(model, x, seed=4, batch_size=256))
    # other labels (another seed) give another fit: the comparison can fail
    assert not _same_fit(whole, hybrid_kron_fit(model, x, seed=5, batch_size=len(x)))


def test_the_fit_consumes_the_data_in_passes_of_the_budgeted_rows(monkeypatch):
    """Every forward pass of the fit (Kron passes and the per-sample gradients' vmap over
    them) sees at most ``pass_rows`` rows: 23 rows at 5 per pass are passes of 5, 5, 5, 5,
    3, each once for the Kron factors and once for the diagonal blocks."""
    model, x = _model_and_data(BNNet)
    monkeypatch.setattr(hybrid, "PASS_BYTES", 5 * row_bytes(model, x) + 3)
    seen: list[int] = []
    model.c1.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    # inside the vmap the layer sees one row; its batch is the vmapped dimension
    sizes = []
    original = hybrid._squared_sample_grads

    def spy(model: nn.Module, params: dict, batch: torch.Tensor, targets: torch.Tensor) -> dict:
        sizes.append(len(batch))
        return original(model, params, batch, targets)

    monkeypatch.setattr(hybrid, "_squared_sample_grads", spy)
    hybrid_kron_fit(model, x, seed=0, batch_size=256)
    assert seen[0] == 1  # the probe of one row (row_bytes)
    assert [s for s in seen[1:] if s > 1] == [5, 5, 5, 5, 3]
    assert sizes == [5, 5, 5, 5, 3]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        hybrid_kron_fit(model, x, seed=0, batch_size=0)


@pytest.mark.parametrize("net", [BNNet, LNNet, CustomNet])
def test_the_fit_returns_plain_tensors_without_a_graph(net):
    """No returned block carries an autograd graph: a graph behind the diagonal blocks would
    keep every pass's activations alive until the fit returns (memory growing with N)."""
    model, x = _model_and_data(net)
    factors, diagonals = hybrid_kron_fit(model, x, seed=0, batch_size=6)
    tensors = [t for pair in factors.values() for t in pair] + list(diagonals.values())
    assert tensors and all(not t.requires_grad and t.grad_fn is None for t in tensors)


def test_make_upload_kron_does_not_depend_on_the_curvature_batch_size():
    """Through the client API: ``curvature_batch_size`` bounds the pass, and the uploaded
    Kron section (factors re-decomposed) is the same for batches of 4 and of 256."""
    model, x = _model_and_data(BNNet, rows=17)
    y = torch.randint(0, 3, (17,))
    small, large = (client.make_upload([model], x, y, ["curvature.kron"],
                                       curvature_batch_size=b).members[0]["curvature.kron"]
                    for b in (4, 256))
    assert small.keys() == large.keys()
    for key in small:
        if "eigvecs" in key:  # eigenvectors are defined up to sign: compare the factor
            continue
        torch.testing.assert_close(torch.from_numpy(small[key]), torch.from_numpy(large[key]),
                                   rtol=1e-4, atol=1e-6)
    for key in (k for k in small if k.endswith("eigvecs_in")):
        vals = key.replace("eigvecs", "eigvals")
        rebuilt = [torch.from_numpy(u[key]) @ torch.diag(torch.from_numpy(u[vals]))
                   @ torch.from_numpy(u[key]).T for u in (small, large)]
        torch.testing.assert_close(rebuilt[0], rebuilt[1], rtol=1e-4, atol=1e-6)
