"""The convolution K-FAC factors of ASDL (behind laplace-torch's ``Asdl*`` backends), without
a transposed copy of the whole batch.

ASDL's ``Conv2d.cov_kron_A`` / ``cov_kron_B`` receive the batch as ``X`` of shape
``[n, K, L]`` (unfolded inputs: ``K = c_in * kh * kw``; or output gradients: ``K = c_out``;
``L`` output positions) and compute ``M M^T`` with ``M = X.transpose(0, 1).flatten(1)``, a
``[K, n L]`` copy of the batch. The same ``K x K`` matrix is ``sum_n X_n X_n^T``, a batched
product that reads ``X`` in place. That is much faster where the positions outnumber the
channels and slower where they do not (benchmarks/docs/throughput.md), so the batched form
is used only when ``4 K <= L``. ASDL's own code handles every other case.

The values are the same matrix up to float summation order (the tests compare with ASDL's
functions). :func:`patched` swaps the two static methods for the duration of a ``with`` block
(nested and concurrent blocks share one swap; the last to leave restores ASDL's own), so a
process that imports fedfusion keeps ASDL as it found it. It is a no-op when the installed
ASDL does not have them in the expected form.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

#: blocks inside :func:`patched` right now (the swap is undone when the last one leaves)
_USERS = 0
_LOCK = threading.Lock()
#: ASDL's own functions, kept for the fallback and for comparison
ORIGINAL: dict[str, Callable[..., torch.Tensor]] = {}
_SAVED: dict[str, staticmethod] = {}


def batched_gram(x: torch.Tensor) -> torch.Tensor:
    """``sum_n x[n] @ x[n].T`` for ``x`` of shape ``[n, K, L]``: ``[K, K]``."""
    return torch.bmm(x, x.transpose(1, 2)).sum(0)


def prefers_batched(x: torch.Tensor) -> bool:
    """Whether :func:`batched_gram` beats ASDL's transposed copy for ``x = [n, K, L]``."""
    return x.ndim == 3 and 4 * x.shape[1] <= x.shape[2]


def _kron_a(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def cov_kron_A(module: torch.nn.Module, in_data: torch.Tensor) -> torch.Tensor:
        if prefers_batched(in_data):
            return batched_gram(in_data).div(in_data.shape[-1])
        return original(module, in_data)

    return cov_kron_A


def _kron_b(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def cov_kron_B(module: torch.nn.Module, out_grads: torch.Tensor) -> torch.Tensor:
        if prefers_batched(out_grads):
            return batched_gram(out_grads)
        return original(module, out_grads)

    return cov_kron_B


@contextlib.contextmanager
def patched() -> Iterator[bool]:
    """Use the batched factors in ASDL's ``Conv2d`` operation inside the block; yields
    whether they are in use (False when ASDL is missing or has another form)."""
    global _USERS
    try:
        from asdl.operations.conv import Conv2d
    except ImportError:
        yield False
        return
    with _LOCK:
        attrs = Conv2d.__dict__
        usable = _USERS > 0 or all(isinstance(attrs.get(name), staticmethod)
                                   for name in ("cov_kron_A", "cov_kron_B"))
        if usable:
            if _USERS == 0:
                _SAVED.update(cov_kron_A=attrs["cov_kron_A"], cov_kron_B=attrs["cov_kron_B"])
                ORIGINAL.update(cov_kron_A=attrs["cov_kron_A"].__func__,
                                cov_kron_B=attrs["cov_kron_B"].__func__)
                Conv2d.cov_kron_A = staticmethod(_kron_a(ORIGINAL["cov_kron_A"]))
                Conv2d.cov_kron_B = staticmethod(_kron_b(ORIGINAL["cov_kron_B"]))
            _USERS += 1
    if not usable:
        yield False
        return
    try:
        yield True
    finally:
        with _LOCK:
            _USERS -= 1
            if _USERS == 0:
                for name, descriptor in _SAVED.items():  # the very objects found
                    setattr(Conv2d, name, descriptor)
