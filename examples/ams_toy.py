"""The 2-D toy of the AMS paper's Figure 1: two one-neuron networks, fused by concatenation.

Data (paper Sec. 4.1): points uniform in the band |x2 - |x1|| < 1, x1 in [-2, 2]; label 1
above the boundary x2 = |x1|, else 0. The left client samples x1 in [-2, 0.5], the right
one x1 in [-0.5, 2]; 300 training and 150 test points each (the test set is the union).
Each client trains y = w2 * act(w1 . x + b1) (one hidden neuron, w2 in R^2, no output bias)
with full-batch Adam, lr 0.5, 600 epochs, cross-entropy. A run whose neuron died (training
accuracy on its own half below 85%) is restarted from the next initialisation (up to
``candidates`` per client); instances where a client never trains are skipped.

Fusion by concatenation stacks the two hidden neurons into one 2-neuron layer and puts the
two output columns side by side, so its logits are y^(1) + y^(2) (paper Eq. 2). AMS-top1
predicts with the network of the larger maximum logit (fedfusion's ``max_logit_log_probs``).

What the figure shows (the default Leaky ReLU, slope 0.01; the paper reports the same with
ReLU and Leaky ReLU): the two local models have almost the same accuracy (about 80% on the
union), yet the concatenation is excellent for some seeds (about 95%, the paper's success
case: 98.36%) and worse than both local models for others (about 72%; paper: 73.36%),
because the summed logits are dominated by whichever network has the larger output scale
(neuron disturbing). AMS-top1 follows concatenation on this toy: in the disputed wedge one
network fires with a large logit while the other is (almost) silent, so the firing one has
the larger maximum logit AND dominates the sum; the selection cannot repair it here. With
plain ReLU a silent network outputs exactly (0, 0), the argmax tie goes to class 0, every
trained network fires on its class-1 side, and the concatenation fails in every instance.

    .venv/bin/python examples/ams_toy.py [--instances 30] [--activation leaky_relu|relu]

Saves examples/ams_toy.png and prints one line per instance (about 20 s on one core).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedfusion.strategies.ams.predictor import max_logit_log_probs  # noqa: E402

HALVES = ((-2.0, 0.5), (-0.5, 2.0))  # x1 range of the left and the right client
TRAIN, TEST = 300, 150
OWN_ACCURACY = 0.85  # a trained network must reach this on its own training half


def sample(rng: np.random.Generator, n: int, low: float, high: float
           ) -> tuple[np.ndarray, np.ndarray]:
    """n points uniform over the band |x2 - |x1|| < 1, x1 in [low, high]; y = [x2 > |x1|]."""
    x1 = rng.uniform(low, high, size=n)
    x2 = np.abs(x1) + rng.uniform(-1.0, 1.0, size=n)
    return np.stack([x1, x2], 1).astype(np.float32), (x2 > np.abs(x1)).astype(np.int64)


def activation_fn(name: str):  # noqa: ANN201
    if name == "relu":
        return F.relu
    if name == "leaky_relu":
        return lambda z: F.leaky_relu(z, 0.01)
    raise ValueError(f"activation must be relu or leaky_relu, got {name!r}")


def logits(params: dict[str, torch.Tensor], x: torch.Tensor, activation: str) -> torch.Tensor:
    """Batched networks: params w1 [S, H, 2], b1 [S, H], w2 [S, 2, H]; x [S, n, 2] -> [S, n, 2]."""
    hidden = activation_fn(activation)(torch.einsum("snd,shd->snh", x, params["w1"])
                                       + params["b1"][:, None, :])
    return torch.einsum("snh,sch->snc", hidden, params["w2"])


def init_params(seeds: Sequence[int], hidden: int = 1) -> dict[str, torch.Tensor]:
    """PyTorch's default Linear init, one generator per network."""
    w1, b1, w2 = [], [], []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        bound = 1 / math.sqrt(2)
        w1.append((torch.rand(hidden, 2, generator=g) * 2 - 1) * bound)
        b1.append((torch.rand(hidden, generator=g) * 2 - 1) * bound)
        w2.append((torch.rand(2, hidden, generator=g) * 2 - 1) / math.sqrt(hidden))
    return {"w1": torch.stack(w1), "b1": torch.stack(b1), "w2": torch.stack(w2)}


def train(x: torch.Tensor, y: torch.Tensor, seeds: Sequence[int], activation: str,
          lr: float = 0.5, epochs: int = 600) -> dict[str, torch.Tensor]:
    """Train S independent networks at once (the loss is a sum over networks and Adam is
    element-wise, so this equals S separate full-batch trainings)."""
    params = {k: v.requires_grad_(True) for k, v in init_params(seeds).items()}
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    for _ in range(epochs):
        optimizer.zero_grad()
        out = logits(params, x, activation)
        loss = F.cross_entropy(out.reshape(-1, 2), y.reshape(-1), reduction="sum") / x.shape[1]
        loss.backward()
        optimizer.step()
    return {k: v.detach() for k, v in params.items()}


def concatenate(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """The fused network of the paper: hidden neurons stacked, output columns side by side."""
    return {"w1": torch.cat([left["w1"], right["w1"]], 0)[None],
            "b1": torch.cat([left["b1"], right["b1"]], 0)[None],
            "w2": torch.cat([left["w2"], right["w2"]], 1)[None]}


@dataclass
class ToyResult:
    seed: int
    x: np.ndarray  # test points of both halves [300, 2]
    y: np.ndarray
    logits: dict[str, np.ndarray]  # left, right, concat, ams (log-probs for ams)
    accuracy: dict[str, float]
    params: dict[str, dict[str, torch.Tensor]]  # left, right, concat


def run_toy(seeds: Sequence[int], activation: str = "leaky_relu", candidates: int = 4
            ) -> list[ToyResult]:
    """Train, fuse and evaluate one toy instance per seed (skipping untrainable ones)."""
    torch.set_num_threads(1)
    data, xs, ys, net_seeds = [], [], [], []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        halves = [sample(rng, TRAIN + TEST, low, high) for low, high in HALVES]
        data.append(halves)
        for side, (x, y) in enumerate(halves):
            for c in range(candidates):
                xs.append(x[:TRAIN])
                ys.append(y[:TRAIN])
                net_seeds.append(seed * 1000 + side * 100 + c)
    x_train, y_train = torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))
    params = train(x_train, y_train, net_seeds, activation)
    own = (logits(params, x_train, activation).argmax(-1) == y_train).float().mean(1)
    own = own.reshape(len(seeds), 2, candidates)
    results = []
    for i, seed in enumerate(seeds):
        good = own[i] >= OWN_ACCURACY
        if not good.any(1).all():
            continue
        nets = {}
        for side, name in enumerate(("left", "right")):
            index = (i * 2 + side) * candidates + int(good[side].nonzero()[0])
            nets[name] = {k: v[index] for k, v in params.items()}
        nets["concat"] = {k: v[0] for k, v in concatenate(nets["left"], nets["right"]).items()}
        halves = data[i]
        x_test = np.concatenate([x[TRAIN:] for x, _ in halves])
        y_test = np.concatenate([y[TRAIN:] for _, y in halves])
        xt = torch.from_numpy(x_test)[None]
        out = {name: logits({k: v[None] for k, v in net.items()}, xt, activation)[0]
               for name, net in nets.items()}
        out["ams"] = max_logit_log_probs(torch.stack([out["left"], out["right"]]), top_k=1)
        accuracy = {name: float((o.argmax(-1).numpy() == y_test).mean())
                    for name, o in out.items()}
        results.append(ToyResult(seed, x_test, y_test, {k: v.numpy() for k, v in out.items()},
                                 accuracy, nets))
    return results


def plot(results: Sequence[ToyResult], path: Path, activation: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    success = max(results, key=lambda r: r.accuracy["concat"] - max(r.accuracy["left"],
                                                                     r.accuracy["right"]))
    failure = min(results, key=lambda r: r.accuracy["concat"] - min(r.accuracy["left"],
                                                                     r.accuracy["right"]))
    fig, axes = plt.subplots(2, 5, figsize=(19, 7.5), sharex=True, sharey=True)
    grid1, grid2 = np.meshgrid(np.linspace(-2.2, 2.2, 221), np.linspace(-1.4, 3.2, 231))
    grid = torch.from_numpy(np.stack([grid1.ravel(), grid2.ravel()], 1).astype(np.float32))
    boundary = np.linspace(-2, 2, 50)
    for row, (label, result) in enumerate((("success case", success), ("fail case", failure))):
        ax = axes[row, 0]
        for (low, high), color in zip(HALVES, ("tab:green", "tab:cyan"), strict=True):
            mask = (result.x[:, 0] >= low) & (result.x[:, 0] <= high)
            ax.scatter(*result.x[mask].T, s=6, c=color, alpha=0.5)
        ax.axvline(-0.5, ls=":", c="gray")
        ax.axvline(0.5, ls=":", c="gray")
        ax.set_title(f"({'af'[row]}) {label}: data (seed {result.seed})")
        panels = {"left": "left model", "right": "right model", "concat": "concatenation",
                  "ams": "AMS-top1"}
        for col, (name, title) in enumerate(panels.items(), start=1):
            ax = axes[row, col]
            if name == "ams":
                left = logits({k: v[None] for k, v in result.params["left"].items()},
                              grid[None], activation)[0]
                right = logits({k: v[None] for k, v in result.params["right"].items()},
                               grid[None], activation)[0]
                field = max_logit_log_probs(torch.stack([left, right]), 1).exp()[:, 1]
            else:
                field = logits({k: v[None] for k, v in result.params[name].items()},
                               grid[None], activation)[0].softmax(-1)[:, 1]
            ax.contourf(grid1, grid2, field.reshape(grid1.shape).numpy(), levels=[0, 0.5, 1],
                        colors=["#f4d9c6", "#cfe0f0"], alpha=0.9)
            correct = result.logits[name].argmax(-1) == result.y
            ax.scatter(*result.x[correct].T, s=5, c=np.where(result.y[correct], "tab:blue",
                                                             "tab:orange"))
            ax.scatter(*result.x[~correct].T, s=14, c="red", marker="x")
            ax.plot(boundary, np.abs(boundary), "k--", lw=0.8)
            ax.set_title(f"({'abcdefghij'[row * 5 + col]}) {title}: "
                         f"{100 * result.accuracy[name]:.1f}%")
    fails = sum(r.accuracy["concat"] < min(r.accuracy["left"], r.accuracy["right"])
                for r in results)
    fig.suptitle(f"AMS paper Fig. 1 toy ({activation}, Adam lr 0.5, 600 epochs): background = "
                 "predicted class (blue 1, orange 0), red x = misclassified test point; over "
                 f"{len(results)} seeds the concatenation is below both local models in {fails}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instances", type=int, default=30)
    parser.add_argument("--activation", default="leaky_relu", choices=("leaky_relu", "relu"))
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".png")))
    args = parser.parse_args()
    results = run_toy(range(args.instances), args.activation)
    print("| seed | left | right | concatenation | AMS-top1 |\n|---|---|---|---|---|")
    for r in results:
        a = r.accuracy
        print(f"| {r.seed} | {100 * a['left']:.1f}% | {100 * a['right']:.1f}% "
              f"| {100 * a['concat']:.1f}% | {100 * a['ams']:.1f}% |")
    mean = {k: np.mean([r.accuracy[k] for r in results]) for k in results[0].accuracy}
    print(f"| mean of {len(results)} | " + " | ".join(f"{100 * mean[k]:.1f}%" for k in
                                                      ("left", "right", "concat", "ams")) + " |")
    print(f"saved {plot(results, Path(args.out), args.activation)}")


if __name__ == "__main__":
    main()
