"""Every strategy on the zoo's two transformers through the library API: which cells fuse,
which are refused by design before training (fedfusion.core.model_check), which fail.

    PYTHONPATH=.:benchmarks:tests OMP_NUM_THREADS=1 .venv/bin/python benchmarks/transformer_cells.py

``vit`` (dim 32, 1 layer) on 3 label-skewed Fashion-MNIST clients of 300 rows, 200
validation and 1,000 test rows; ``token_transformer`` on scikit-learn's digits as 64 integer
tokens (3 label-skewed clients, 300 validation and 500 test rows). 2 members per client, 5
epochs of Adam (lr 3e-3); every section the clients can compute (weights always; the
curvature and Gram sections optional, left out with the client's reason where they fail).
The data helpers are the tests' (tests/conftest.py, tests/helpers/digits.py). One line
per cell: FUSED with the test accuracy, the chance verdict and the norm rule; REFUSED with
the message; NO SECTION where the clients could not compute what the strategy needs.
"""

from __future__ import annotations

import sys

import torch
from conftest import label_skewed_fmnist
from helpers.digits import split_digits, train

from fedfusion import client
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.evaluation import evaluate
from fedfusion.core.model_check import ModelRefused
from fedfusion.strategies import STRATEGIES

SECTIONS = ["curvature.kron", "curvature.diag", "gram"]
#: small server budgets, as tests/strategies/test_model_matrix.py
OPTIONS = {"fedbens": {"steps": 30, "eval_every": 10}, "fedfisher": {"steps": 30},
           "dense": {"epochs": 2, "batch_size": 64},
           "co-boosting": {"epochs": 2, "batch_size": 64}}
#: cells beyond one per strategy: (strategy, options)
EXTRA = {"fedbens-diag": ("fedbens", {"hessian_structure": "diag"}),
         "fedfisher-diag": ("fedfisher", {"hessian_structure": "diag"}),
         "ensemble-distill-synthetic": ("ensemble", {"distill": "synthetic",
                                                     "distill_epochs": 2})}


def run(family: str) -> None:
    if family == "vit":
        data = label_skewed_fmnist(300, 200, 1000)
        spec = ModelSpec("vit", (1, 28, 28), 10, {"dim": 32, "layers": 1})
    else:
        data = split_digits()
        spec = ModelSpec("token_transformer", (64,), 10, {})
    uploads = []
    for c in range(3):
        x, y = data[f"client{c}"]
        members = []
        for m in range(2):
            with torch.random.fork_rng():
                torch.manual_seed(100 * m)
                members.append(train(spec.build().train(), x, y, seed=10 * c + m, epochs=5))
        print(f"{family} client {c}: member 0 test accuracy "
              f"{evaluate(members[0], *data['test'])['accuracy']:.3f}", flush=True)
        uploads.append(client.make_upload(members, x, y, ["weights"], optional_sections=SECTIONS,
                                          client_id=c, model_name=spec.name,
                                          model_kwargs=spec.kwargs))
    cells = {name: (name, {}) for name in sorted(STRATEGIES)} | EXTRA
    for cell, (name, options) in cells.items():
        try:
            fuser = STRATEGIES[name](spec, num_clients=3, num_members=2, val=data["val"],
                                     **{**OPTIONS.get(name, {}), **options})
        except ModelRefused as exc:
            print(f"{family} {cell}: REFUSED before training: {exc}", flush=True)
            continue
        missing = [s for s in fuser.required_sections if s not in uploads[0].members[0]]
        if missing:
            print(f"{family} {cell}: NO SECTION {missing} (the clients could not compute it)",
                  flush=True)
            continue
        try:
            predictor = fuser.fuse_uploads(uploads)
        except Exception as exc:  # noqa: BLE001 (a cell that fails is what this lists)
            print(f"{family} {cell}: FAILED at fuse: {type(exc).__name__}: {exc}", flush=True)
            continue
        chance = fuser.chance or {}
        print(f"{family} {cell}: FUSED test accuracy "
              f"{evaluate(predictor, *data['test'])['accuracy']:.3f}, validation "
              f"{chance.get('accuracy', float('nan')):.3f} (at chance: {chance.get('at_chance')}),"
              f" norm_stats {fuser.norm_stats!r}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for family in sys.argv[1:] or ["vit", "token"]:
        run(family)
