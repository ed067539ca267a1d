"""The compiled kernels of the stacked trainer against PyTorch's own ops."""

import pytest
import torch
from torch.nn import functional as F

from fedfusion.accel import kernels

# only a missing compiler skips: with one, a failed build fails these tests (it would otherwise
# hide behind the PyTorch fallback)
pytestmark = pytest.mark.skipif(kernels.compiler() is None or kernels.disabled(),
                                reason="no C compiler: the compiled kernels are unavailable")


@pytest.mark.parametrize(("c", "o", "h", "w", "kh", "kw"),
                         [(1, 6, 28, 28, 5, 5), (6, 16, 12, 12, 5, 5), (3, 4, 9, 7, 3, 2),
                          (5, 3, 10, 11, 3, 4), (2, 3, 9, 15, 2, 3), (2, 4, 10, 13, 3, 3)])
def test_convolution_kernels_equal_pytorch(c, o, h, w, kh, kw):
    """Forward, weight gradient and (where it fits in registers) input gradient, against
    autograd through F.conv2d; the shapes cover channel blocks of 1, 2 and 3, output rows
    of one vector, a partial one and several, forward blocks of one row and of two."""
    compiled = kernels.conv_kernels(c, o, h, w, kh, kw)
    assert compiled is not None
    g = torch.Generator().manual_seed(0)
    m, b = 2, 5
    x = torch.randn(m, b, c, h, w, generator=g)
    weight = torch.randn(m, o, c, kh, kw, generator=g)
    bias = torch.randn(m, o, generator=g)
    ho, wo = compiled.out_hw
    grad_out = torch.randn(m, b, o, ho, wo, generator=g)
    out = compiled.forward(x, weight, bias, torch.empty(m, b, o, ho, wo))
    grad_w = compiled.weight_grad(x, grad_out, torch.empty_like(weight))
    grad_x = (compiled.input_grad(grad_out, weight, torch.full_like(x, float("nan")))
              if compiled.has_input_grad else None)
    for i in range(m):
        wi = weight[i].clone().requires_grad_()
        xi = x[i].clone().requires_grad_()
        ref = F.conv2d(xi, wi, bias[i])
        ref.backward(grad_out[i])
        torch.testing.assert_close(out[i], ref.detach(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(grad_w[i], wi.grad, rtol=1e-5, atol=1e-4)
        if grad_x is not None:  # every entry written (the buffer started as NaN)
            torch.testing.assert_close(grad_x[i], xi.grad, rtol=1e-5, atol=1e-4)


def test_forward_register_rule():
    assert kernels.forward_block(16, 8, 8) == (8, 2)  # LeNet's second layer: two rows
    assert kernels.forward_block(6, 24, 24) == (6, 1)  # its first: one row, all channels
    assert kernels.forward_block(4, 7, 6)[1] == 1  # odd rows do not pair


def test_input_gradient_register_rule():
    assert kernels.input_grad_block(6, 5, 8) == 2  # LeNet's second layer: 10 accumulators
    assert kernels.input_grad_block(1, 5, 24) == 0  # 15 for one channel: PyTorch's
    assert kernels.input_grad_block(5, 4, 8) == 1 and kernels.input_grad_block(2, 3, 13) == 2
    assert [kernels.conv_kernels(*shape).has_input_grad
            for shape in ((6, 16, 12, 12, 5, 5), (1, 6, 28, 28, 5, 5))] == [True, False]


def test_one_register_block_rule():
    assert kernels.one_block(6, 24) and kernels.one_block(16, 8)  # LeNet's layers
    assert not kernels.one_block(32, 28) and not kernels.one_block(64, 10)  # the CNN's


def test_convolution_kernels_check_their_arguments():
    compiled = kernels.conv_kernels(1, 2, 6, 6, 3, 3)
    assert compiled is not None
    with pytest.raises(ValueError, match=r"input: expected a contiguous float32 CPU tensor of "
                                         r"shape \(1, 2, 1, 6, 6\)"):
        compiled.forward(torch.zeros(1, 2, 1, 6, 5), torch.zeros(1, 2, 1, 3, 3), None,
                         torch.zeros(1, 2, 2, 4, 4))
    with pytest.raises(ValueError, match="convolution kernel size c must be a positive int"):
        kernels.conv_kernels(0, 2, 6, 6, 3, 3)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize(("h", "w"), [(8, 8), (7, 9)])
def test_pool_kernels_equal_max_pool2d_ties_included(relu, h, w):
    pool = kernels.pool_kernels()
    g = torch.Generator().manual_seed(1)
    # values on a coarse grid: many ties, which must go to the first maximum as in PyTorch
    a = torch.randint(-2, 3, (3, 4, h, w), generator=g).float()
    out = torch.empty(3, 4, h // 2, w // 2)
    arg = torch.empty(out.shape, dtype=torch.int32)
    pool.forward(a, out, arg, relu)
    leaf = a.clone().requires_grad_()
    ref = F.max_pool2d(F.relu(leaf) if relu else leaf, 2)
    grad_out = torch.randn(ref.shape, generator=g)
    ref.backward(grad_out)
    assert torch.equal(out, ref.detach())
    grad_in = pool.backward(grad_out, arg, torch.full_like(a, 7.0))
    assert torch.equal(grad_in, leaf.grad)


def test_kernels_can_be_disabled(monkeypatch):
    monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    kernels._library.cache_clear()
    try:
        assert kernels.pool_kernels() is None
        assert kernels.conv_kernels(1, 2, 6, 6, 3, 3) is None
    finally:
        kernels._library.cache_clear()
