"""The FedBEns server on a CUDA device (skipped without one; CI has none): the steps replayed
as CUDA graphs give the eager steps' result, and both agree with the CPU."""

from __future__ import annotations

import pytest
import torch
from test_fedbens import TINY, tiny_upload

from fedfusion.strategies import FedBEns

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fused_modes(device: str, cuda_graphs: bool, uploads: list) -> tuple[list, FedBEns]:
    val = (torch.randn(60, 1, 4, 4, generator=torch.Generator().manual_seed(5)),
           torch.arange(60) % 3)
    strategy = FedBEns(TINY, num_clients=len(uploads), num_members=2, temperature=1.0,
                       prior_var=1.0, steps=60, eval_every=20, refresh_every=3, val=val,
                       device=device, cuda_graphs=cuda_graphs)
    predictor = strategy.fuse_uploads(uploads)
    return [dict(m.state_dict()) for m in predictor.members], strategy


def test_graph_steps_match_eager_steps_and_the_cpu():
    uploads = [tiny_upload(c, "kron", seed=c, members=2, broadcast_inits=True)
               for c in range(3)]
    graphed, strategy = fused_modes("cuda", True, uploads)
    eager, eager_strategy = fused_modes("cuda", False, uploads)
    cpu, _ = fused_modes("cpu", True, uploads)
    assert strategy.optimiser.graph_captures >= 1  # the graph path ran
    assert eager_strategy.optimiser.graph_captures is None
    for g, e, c in zip(graphed, eager, cpu, strict=True):
        for name in g:
            torch.testing.assert_close(g[name].cpu(), e[name].cpu(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(g[name].cpu(), c[name].cpu(), rtol=1e-3, atol=1e-4)
