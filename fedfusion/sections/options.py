"""How a client computes its upload sections (:class:`SectionOptions`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SectionOptions:
    """How a client computes its upload sections (keyword arguments of
    :func:`fedfusion.client.make_upload`; the App fills them from its run config).

    ``curvature_backend`` "" = the measured default (:data:`fedfusion.curvature.DEFAULT_BACKEND`);
    ``curvature_rank`` 0 = every Kron eigenpair, r = the top r per factor;
    ``curvature_half`` stores Kron eigenvectors in float16; ``seed`` seeds Monte-Carlo
    curvature backends. ``temperature`` and ``prior_var`` shape the Laplace object fitted on
    the client; the uploaded arrays hold the likelihood curvature only, so the server chooses
    its own. ``accelerate`` (None = ``FEDFUSION_ACCEL``, else off): the optional compiled
    Kron fit of :mod:`fedfusion.accel`, the same factors to float tolerance."""

    curvature_backend: str = ""
    curvature_batch_size: int = 256
    curvature_rank: int = 0
    curvature_half: bool = False
    temperature: float = 0.1
    prior_var: float = 0.1
    seed: int = 0
    accelerate: bool | None = None
