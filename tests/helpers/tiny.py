"""A tiny MLP (16 inputs, 6 hidden, 3 classes) trained on seeded data, its uploads with
real laplace-torch curvature, and a FedBEns federation of them whose runs stop apart."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedfusion.core.predictors import ModelSpec
from fedfusion.curvature import fit_curvature
from fedfusion.strategies import FedBEns
from fedfusion.wire import ClientUpload

TINY = ModelSpec("mlp", (1, 4, 4), 3, {"hidden_layers": 1, "hidden": 6})


def tiny_upload(client_id: int, structure: str, seed: int, members: int = 1,
                broadcast_inits: bool = False) -> ClientUpload:
    """A trained tiny MLP client with real laplace-torch curvature; member m starts from an
    init of its own, or (``broadcast_inits``) from init m shared by every client."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(120, 1, 4, 4, generator=g)
    y = (x.flatten(1)[:, :3].argmax(1) + seed) % 3
    out = []
    for m in range(members):
        torch.manual_seed(1000 + m if broadcast_inits else seed * 10 + m)
        net = TINY.build()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(100):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        curvature = fit_curvature(net, x, y, structure, temperature=1.0, prior_var=1.0)
        out.append({"weights": {k: v.detach().numpy() for k, v in net.state_dict().items()},
                    f"curvature.{structure}": curvature.to_arrays()})
    return ClientUpload(client_id, TINY.name, TINY.kwargs, len(y), out)


def stopping_federation(**kwargs: object) -> tuple[list[ClientUpload], Callable[[], FedBEns]]:
    """2 tiny clients x 3 members, and a FedBEns (member starts, validation, patience 2,
    float64; ``kwargs`` more) whose 6 runs stop at different steps (10 to 50)."""
    uploads = [tiny_upload(c, "kron", seed=c, members=3) for c in range(2)]
    g = torch.Generator().manual_seed(5)
    x_val = torch.randn(60, 1, 4, 4, generator=g)
    y_val = x_val.flatten(1)[:, :3].argmax(1) % 3

    def strategy() -> FedBEns:
        return FedBEns(TINY, num_clients=2, val=(x_val, y_val), steps=150, eval_every=5,
                       lr=0.02, patience=2, starts="members", dtype=torch.float64, **kwargs)

    return uploads, strategy
