"""Why FedBEns' modes fall behind the uniform ensemble of the same uploads.

On the leaderboard's cells (``benchmarks/leaderboard.py``: the live FedBEns run with its
defaults, 2M modes from 2M clustered starts, and its saved uploads), from the test set:

* accuracy and NLL of the modes' ensemble, of the ensemble of the 2M start members (the
  same inference cost, no server optimisation), of an ensemble of 2M members by the
  leaderboard's rule, of all C x M members; the mean accuracy of one mode, one start, one
  member;
* diversity: the mean pairwise disagreement of the arg-max predictions, and the mean
  pairwise L2 distance in parameter space, of the modes, of the starts and of all members;
  how far each mode moved from its start, and its distance to the nearest member;
* the number of modes (the first M of the 2M) and the prediction temperature (the modes'
  logits divided by tau before the softmax average);
* what the validation selection picked: each run's best step (``run_stops``, scores);
* prediction rules at 2M networks (FedBEns' ``prediction`` choices and the alternatives
  measured against them): M modes + M members by the rule, greedy selection with replacement
  on validation NLL, greedy selection without replacement on validation accuracy (FedBEns'
  default, :mod:`fedfusion.core.selection`) from the modes and the members, and from the
  members alone.

    .venv/bin/python benchmarks/fedbens_gap.py [--cells table1-C5_a0.1-s0,...]

Saves ``benchmarks/results/fedbens_gap.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch
from common import REPO
from leaderboard import MEMBERS, OUT

from fedfusion.app.config import Settings, default_model
from fedfusion.app.federation import federated_split
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.selection import greedy_selection
from fedfusion.server_app import replay_settings
from fedfusion.strategies.fedbens.starts import clustered_starts
from fedfusion.strategies.predictors import load_predictor

RESULTS = REPO / "benchmarks" / "results" / "fedbens_gap.json"
TEMPERATURES = (0.5, 2.0)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def mean_pairwise(values: list[torch.Tensor], distance) -> float:  # noqa: ANN001
    pairs = list(itertools.combinations(values, 2))
    return sum(distance(a, b) for a, b in pairs) / max(len(pairs), 1)


def analyse(cell: str) -> dict:
    folder = OUT / cell
    settings, uploads, _ = replay_settings(Settings(replay=str(folder / "uploads")))
    bundle = federated_split(settings).bundle
    x, y = bundle.test.x, bundle.test.y
    spec = ModelSpec(default_model(settings, bundle.input_shape), bundle.input_shape,
                     bundle.num_classes, settings.parsed_model_kwargs())
    members = [spec.build(u.weights(m)) for u in uploads for m in range(u.num_members)]
    # the modes' own predictor: the fedbens-modes replay, else the live run (before 2026-11-28
    # its default prediction was the modes)
    modes_folder = OUT / f"{cell}-fedbens-modes"
    modes = list(load_predictor((modes_folder if modes_folder.is_dir() else folder)
                                / "predictor.pt").members)
    parameters = sorted(spec.param_shapes().parameters)
    starts = [spec.build(s) for s in clustered_starts(uploads, parameters, len(modes))]
    clients = len(uploads)
    # the leaderboard's rule: member 0 of every client first, then member 1, ...
    rule = [spec.build(u.weights(m)) for m in range(MEMBERS) for u in uploads
            if m < u.num_members][: 2 * MEMBERS]

    @torch.no_grad()
    def logits(models: list[torch.nn.Module], inputs: torch.Tensor = x) -> list[torch.Tensor]:
        return [torch.cat([m.eval()(inputs[i:i + 2000]) for i in range(0, len(inputs), 2000)])
                for m in models]

    def ensemble(per_model: list[torch.Tensor], tau: float = 1.0) -> dict[str, float]:
        log_p = torch.logsumexp(torch.stack([torch.log_softmax(z / tau, 1) for z in per_model]),
                                0) - math.log(len(per_model))
        return {"accuracy": float((log_p.argmax(1) == y).float().mean()),
                "nll": float(-log_p[torch.arange(len(y)), y].mean())}

    def single(per_model: list[torch.Tensor]) -> float:
        return sum(float((z.argmax(1) == y).float().mean()) for z in per_model) / len(per_model)

    def disagreement(per_model: list[torch.Tensor]) -> float:
        return mean_pairwise([z.argmax(1) for z in per_model],
                             lambda a, b: float((a != b).float().mean()))

    z_modes, z_starts, z_members, z_rule = logits(modes), logits(starts), logits(members), \
        logits(rule)
    # the selections see validation only
    v_pool = torch.stack([torch.log_softmax(z, 1)
                          for z in logits(modes, bundle.val.x) + logits(members, bundle.val.x)])
    t_pool = z_modes + z_members
    picked = greedy_selection(v_pool, bundle.val.y, len(modes))
    picked_members = greedy_selection(v_pool[len(modes):], bundle.val.y, len(modes))
    with_replacement: list[int] = []  # greedy on validation NLL, a network may repeat
    for _ in range(len(modes)):
        nll = [float(-(torch.logsumexp(v_pool[with_replacement + [i]], 0) - math.log(
            len(with_replacement) + 1))[torch.arange(len(bundle.val.y)), bundle.val.y].mean())
            for i in range(len(v_pool))]
        with_replacement.append(min(range(len(nll)), key=nll.__getitem__))
    v_modes, v_starts, v_members = ([flat(m) for m in ms] for ms in (modes, starts, members))
    dist = lambda a, b: float((a - b).norm())  # noqa: E731
    live = json.loads((folder / "results.json").read_text())
    report = live["strategy_report"]
    return {
        "cell": cell, "clients": clients, "alpha": settings.alpha, "modes": len(modes),
        "modes_ensemble": ensemble(z_modes),
        "modes_first_M": ensemble(z_modes[:MEMBERS]),
        **{f"modes_tau{tau:g}": ensemble(z_modes, tau) for tau in TEMPERATURES},
        "starts_ensemble": ensemble(z_starts), "rule_ensemble_2M": ensemble(z_rule),
        "all_members_ensemble": ensemble(z_members),
        "prediction_rules_2M": {
            "modes": ensemble(z_modes),
            "M_modes_and_M_members_by_rule": ensemble(z_modes[:MEMBERS] + z_rule[:MEMBERS]),
            "greedy_nll_with_replacement": ensemble([t_pool[i] for i in with_replacement]),
            "selected_modes_and_members": ensemble([t_pool[i] for i in picked]),
            "selected_members": ensemble([z_members[i] for i in picked_members]),
            "selected_modes_kept": sum(i < len(modes) for i in picked)},
        "one_mode": single(z_modes), "one_start": single(z_starts),
        "one_member": single(z_members),
        "disagreement": {"modes": disagreement(z_modes), "starts": disagreement(z_starts),
                         "members": disagreement(z_members)},
        "distance": {"modes": mean_pairwise(v_modes, dist),
                     "starts": mean_pairwise(v_starts, dist),
                     "members": mean_pairwise(v_members, dist),
                     "mode_to_its_start": sum(dist(a, b) for a, b in zip(
                         v_modes, v_starts, strict=True)) / len(modes),
                     "mode_to_nearest_member": sum(min(dist(a, b) for b in v_members)
                                                   for a in v_modes) / len(modes)},
        "selection": {"run_stops": report.get("run_stops"),
                      "best_scores": report.get("best_scores"),
                      "steps": report.get("steps")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="")
    args = parser.parse_args(argv)
    cells = [c for c in args.cells.split(",") if c] or sorted(
        p.name for p in OUT.iterdir() if (p / "uploads").is_dir() and (
            p / "predictor.pt").is_file())
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    for cell in cells:
        print(f"analysing {cell} ...", flush=True)
        results[cell] = analyse(cell)
        r = results[cell]
        print(f"  modes {100 * r['modes_ensemble']['accuracy']:.2f} | starts "
              f"{100 * r['starts_ensemble']['accuracy']:.2f} | 2M by rule "
              f"{100 * r['rule_ensemble_2M']['accuracy']:.2f} | all members "
              f"{100 * r['all_members_ensemble']['accuracy']:.2f} | one mode "
              f"{100 * r['one_mode']:.2f}, one member {100 * r['one_member']:.2f} | "
              f"disagreement modes {r['disagreement']['modes']:.3f}, members "
              f"{r['disagreement']['members']:.3f}", flush=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
