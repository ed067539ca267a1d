"""Optional acceleration for clients (on the CPU, and a GPU's training): opt-in, never on a
library call's default path.

What it holds:

* :mod:`~fedfusion.accel.stacked`: a trainer that runs a client's M members of a plain
  conv/linear chain as one computation (:func:`fedfusion.training.train_members`);
* :mod:`~fedfusion.accel.kernels`: small C kernels for that trainer, generated from the layer
  sizes and compiled at run time with the system C compiler (``-O3 -march=native``), cached
  per user and verified by content hash before they are loaded;
* :mod:`~fedfusion.accel.fast_kron`: the MC K-FAC factors of laplace-torch's ``asdl_mc``
  backend computed on the stacked trainer's layers (the same factors, to float tolerance);
* :mod:`~fedfusion.accel.asdl_speedup`: batched conv K-FAC factors for ASDL, patched in for
  the duration of one fit only;
* :mod:`~fedfusion.accel.vmapped`: members on a GPU trained as one ``torch.func.vmap``
  computation.

A library call uses none of it unless asked: ``accelerate=True`` on
:func:`fedfusion.client.make_upload` / :func:`fedfusion.curvature.fit_curvature` /
:func:`fedfusion.training.train_members`, or ``FEDFUSION_ACCEL=1`` in the environment for
calls that leave ``accelerate`` unset. Without it the client path is PyTorch and laplace-torch
only, runs wherever they run and never invokes a compiler. The App's own simulation turns it
on (run-config ``accelerate``, default true) where it was measured faster; see
``docs/library/acceleration.md`` for what it buys and on which platforms.
``FEDFUSION_NO_KERNELS=1`` keeps the stacked trainer but without compiled kernels.
"""

from __future__ import annotations

import os

#: environment variable that turns acceleration on for calls that leave ``accelerate`` unset
ENV = "FEDFUSION_ACCEL"

__all__ = ["ENV", "requested"]


def requested(accelerate: bool | None = None) -> bool:
    """Whether a call uses the optional acceleration: ``accelerate`` when given, else
    ``FEDFUSION_ACCEL`` (``1``/``true``/``yes``/``on``); off by default."""
    if accelerate is not None:
        return bool(accelerate)
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")
