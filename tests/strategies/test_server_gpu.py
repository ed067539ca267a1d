"""The FedBEns server on a CUDA device (skipped without one; CI has none): the steps replayed
as CUDA graphs give the eager steps' result, and both agree with the CPU."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny import TINY, stopping_federation, tiny_upload

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


def test_runs_that_stop_leave_the_graph_and_the_rest_match_eager_and_the_cpu():
    """Per-run patience on the GPU: the runs stop at the CPU's steps, the graph is captured
    again for the smaller batch, and every mode matches the eager steps and the CPU."""
    results = {}
    for device, graphs in (("cuda", True), ("cuda", False), ("cpu", False)):
        uploads, strategy_fn = stopping_federation(device=device, cuda_graphs=graphs)
        strategy = strategy_fn()
        stacked, owner = strategy.build_posterior(uploads)
        modes = strategy.optimise(strategy.starting_points(uploads), stacked, owner, 2)
        results[device, graphs] = modes, strategy.optimiser
    graphed, optimiser = results["cuda", True]
    assert len(set(optimiser.run_stops)) > 1
    assert optimiser.graph_captures >= 2  # captured again once runs left the batch
    for other, other_optimiser in (results["cuda", False], results["cpu", False]):
        assert other_optimiser.run_stops == optimiser.run_stops
        for mode, wanted in zip(graphed, other, strict=True):
            for name in mode:
                torch.testing.assert_close(mode[name], wanted[name], rtol=1e-7, atol=1e-9)
