"""FedBEns' starting points and the ensemble gap.

All from uploads that clients really trained (FMNIST, LeNet, M = 5, Kron, T = 0.1,
sigma^2 = 0.1, 20 local epochs): Table 1's seed-0 cells (C = 5, the authors' splits, MNIST
input normalisation), Table 2's seed-0 cells (C = 10 / 20 / 40, alpha 0.3) from
``authors_splits.py``, and the C = 100 run of ``scale.py``. Stages (each resumable):

* ``cost`` (run it on a quiet machine): FedBEns replayed in a fresh process with one thread
  in three configurations (``COST_CONFIGS``): the paper's algorithm (M runs from the
  per-member medians, every run all its steps), ``clustered`` (2M runs from the members'
  weighted K-medoids, every run all its steps) and the library's defaults (the clustered
  starts, each run stopping once its validation score stalls: ``server-patience``); server
  seconds, accuracy, and the ratios to the paper's cost.
* ``gap``: why the uniform ensemble of the C x M members beats the fused modes, on three
  upload sets (C = 5 alpha 0.4, C = 40, C = 100), for K = M, 2M (and 4M where C x M allows)
  clustered starts: the accuracy of the K modes' ensemble, of the ensemble of the K start
  members themselves (the same inference cost, no server optimisation), of all C x M
  members, the mean accuracy of one mode and of one member, and the diversity (mean
  pairwise disagreement of the arg-max predictions on the test set) of the modes against
  that of the start members.
* ``tables``: print both, with the accuracy of the paper's medians, every member, clustered
  and the defaults on the Table 1 cells of seeds 0-1 that ``authors_splits.py table1 --seeds
  0,1 --norms mnist --only fedbens_paper,fedbens_clustered,fedbens_members,fedbens_default``
  ran; save ``benchmarks/results/starts.json``.

    .venv/bin/python benchmarks/starts.py cost
    .venv/bin/python benchmarks/starts.py gap
    .venv/bin/python benchmarks/starts.py tables
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from common import REPO

from fedfusion.app.replay import replay  # noqa: E402
from fedfusion.core.evaluation import predict_log_probs  # noqa: E402
from fedfusion.server_app import replay_settings  # noqa: E402
from fedfusion.strategies.predictors import load_predictor  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "starts.json"
SPLITS_OUT = REPO / "outputs" / "bench-authors-splits"
SCALE_OUT = REPO / "outputs" / "bench-scale"
OUT = REPO / "outputs" / "bench-starts"
#: upload set -> (clients, its uploads folder)
SETS = {
    **{f"C5_a{a:g}": (5, SPLITS_OUT / f"C5_a{a:g}-s0-mnist" / "uploads")
       for a in (0.05, 0.1, 0.2, 0.4)},
    **{f"C{c}_a0.3": (c, SPLITS_OUT / f"C{c}_a0.3-s0" / "uploads") for c in (10, 20, 40)},
    "C100_a0.3": (100, SCALE_OUT / "c100_m5_s0" / "uploads"),
}
GAP_SETS = ("C5_a0.4", "C40_a0.3", "C100_a0.3")
MEMBERS = 5
REPLAY = """
import json, sys
from fedfusion.app.replay import replay
run = replay({uploads!r}, "fedbens", {config!r})
report = run["strategy_report"]
print("RESULT", json.dumps({{"server_s": run["timing"]["server_fuse_s"],
                            "accuracy": run["test"]["accuracy"], "starts": report["starts"],
                            "runs": len(report["run_stops"]), "steps": report["steps"],
                            "run_stops": report["run_stops"]}}))
"""


def load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"cost": {}, "gap": {}}


def save(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def starts_config(rule: str, k: int = 0) -> str:
    """A start rule with every run taking all its steps (no early stop), one thread."""
    return (f"fedbens-starts='{rule}' fedbens-num-starts={k} server-patience=0 "
            "server-threads=1")


#: the server configurations the cost stage compares: the paper's algorithm, the clustered
#: starts on the same schedule, and the library's defaults (clustered starts, each run
#: stopping on its own once its validation score stalls)
COST_CONFIGS = {"median": starts_config("median"), "clustered": starts_config("clustered"),
                "default": "server-threads=1"}


def stage_cost(results: dict) -> None:
    for name, (_, uploads) in SETS.items():
        if not uploads.is_dir():
            print(f"skipping {name}: no uploads at {uploads}")
            continue
        for rule, rule_config in COST_CONFIGS.items():
            if rule in results["cost"].get(name, {}):
                continue
            config = (f"{rule_config} output-dir='/tmp/fedfusion-starts' "
                      f"run-name={name}-{rule}")
            print(f"cost: {name}, {rule} ...", flush=True)
            done = subprocess.run([sys.executable, "-c", REPLAY.format(
                uploads=str(uploads), config=config)], capture_output=True, text=True,
                cwd=REPO, check=True)
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            results["cost"].setdefault(name, {})[rule] = json.loads(line[len("RESULT "):])
            print(f"  {results['cost'][name][rule]}", flush=True)
            save(results)


def disagreement(predictions: list[torch.Tensor]) -> float:
    """Mean over pairs of the fraction of inputs whose arg-max labels differ."""
    pairs = list(itertools.combinations(predictions, 2))
    return sum(float((a != b).float().mean()) for a, b in pairs) / max(len(pairs), 1)


def stage_gap(results: dict) -> None:
    for name in GAP_SETS:
        if SETS[name][1].is_dir():
            gap_of(name, results)
        else:
            print(f"skipping {name}: no uploads")


def gap_of(name: str, results: dict) -> None:
    """The gap analysis of upload set ``name`` (see the module docstring)."""
    from fedfusion.app.config import Settings, default_model
    from fedfusion.app.federation import federated_split
    from fedfusion.core.architecture import ModelSpec
    from fedfusion.strategies.fedbens.starts import clustered_starts

    clients, uploads_dir = SETS[name]
    settings, uploads, _ = replay_settings(Settings(replay=str(uploads_dir)))
    bundle = federated_split(settings).bundle
    x, y = bundle.test.x, bundle.test.y
    spec = ModelSpec(default_model(settings, bundle.input_shape), bundle.input_shape,
                     bundle.num_classes, settings.parsed_model_kwargs())
    parameters = sorted(spec.param_shapes().parameters)

    def log_probs(models: list[torch.nn.Module]) -> list[torch.Tensor]:
        # a zoo model gives logits, an ensemble member log-probabilities: normalise both
        return [torch.log_softmax(predict_log_probs(model, x), 1) for model in models]

    def accuracy(log_prob: torch.Tensor) -> float:
        return float((log_prob.argmax(1) == y).float().mean())

    def ensemble_accuracy(per_model: list[torch.Tensor]) -> float:
        return accuracy(torch.logsumexp(torch.stack(per_model), 0))

    every = log_probs([spec.build(u.weights(m)) for u in uploads for m in range(u.num_members)])
    row = results["gap"].setdefault(name, {
        "clients": clients, "all_members_ensemble": ensemble_accuracy(every),
        "one_member_mean": sum(map(accuracy, every)) / len(every), "ks": {}})
    for k in (MEMBERS, 2 * MEMBERS, 4 * MEMBERS):
        if str(k) in row["ks"] or (k > 2 * MEMBERS and clients > 40):
            continue
        print(f"gap: {name}, K = {k} ...", flush=True)
        run = replay(str(uploads_dir), "fedbens", f"{starts_config('clustered', k)} "
                     f"output-dir='{OUT}' run-name={name}-k{k}")
        modes = log_probs(load_predictor(OUT / f"{name}-k{k}" / "predictor.pt").members)
        starts = log_probs([spec.build(s) for s in clustered_starts(uploads, parameters, k)])
        row["ks"][str(k)] = {
            "fedbens": run["test"]["accuracy"],
            "modes_ensemble": ensemble_accuracy(modes),
            "starts_ensemble": ensemble_accuracy(starts),
            "one_mode_mean": sum(map(accuracy, modes)) / len(modes),
            "modes_disagreement": disagreement([p.argmax(1) for p in modes]),
            "starts_disagreement": disagreement([p.argmax(1) for p in starts]),
            "server_s": run["timing"]["server_fuse_s"],
        }
        print(f"  {row['ks'][str(k)]}", flush=True)
        save(results)


def read_accuracy(folder: Path) -> float | None:
    done = folder / "results.json"
    if not done.is_file():
        return None
    run = json.loads(done.read_text())
    return run["test"]["accuracy"] if run.get("status") == "ok" else None


def stage_table1(results: dict) -> None:
    """Table 1's cells that ``authors_splits.py table1 --norms mnist`` ran: its replays
    ``paper`` (the paper's algorithm), ``starts_members``, ``starts_clustered`` and
    ``starts_default``."""
    for seed in (0, 1):
        for alpha in (0.05, 0.1, 0.2, 0.4):
            cell = f"C5_a{alpha:g}-s{seed}-mnist"
            accuracy = {rule: read_accuracy(SPLITS_OUT / (cell + suffix)) for rule, suffix in
                        (("median", "-paper"), ("members", "-starts_members"),
                         ("clustered", "-starts_clustered"), ("default", "-starts_default"))}
            if all(v is not None for v in accuracy.values()):
                results.setdefault("table1", {})[cell] = accuracy


def stage_tables(results: dict) -> None:
    stage_table1(results)
    if results.get("table1"):
        print("| Table 1 cell (C = 5) | paper's algorithm (5 runs) | member starts (25 runs) | "
              "clustered (10 runs) | defaults (10 runs, patience) | defaults - members | "
              "defaults - paper |")
        print("|---|---|---|---|---|---|---|")
        for cell, acc in results["table1"].items():
            print(f"| {cell} | {100 * acc['median']:.2f} | {100 * acc['members']:.2f} | "
                  f"{100 * acc['clustered']:.2f} | {100 * acc['default']:.2f} | "
                  f"{100 * (acc['default'] - acc['members']):+.2f} | "
                  f"{100 * (acc['default'] - acc['median']):+.2f} |")
        for rule in ("clustered", "default"):
            for other in ("members", "median"):
                diffs = [100 * (a[rule] - a[other]) for a in results["table1"].values()]
                print(f"{rule} - {other}: mean {statistics.mean(diffs):+.2f}, better in "
                      f"{sum(d > 0 for d in diffs)} of {len(diffs)}, {min(diffs):+.2f} to "
                      f"{max(diffs):+.2f}")
        print()
    print("| upload set | C | paper's algorithm: acc | s | clustered, 300 steps: acc | s | x | "
          "defaults: acc | s | x |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {"clustered": [], "default": []}
    for name, cost in results["cost"].items():
        if any(rule not in cost for rule in COST_CONFIGS):
            continue
        paper = cost["median"]["server_s"]
        cells = []
        for rule in COST_CONFIGS:
            acc, secs = 100 * cost[rule]["accuracy"], cost[rule]["server_s"]
            cells.append(f"{acc:.2f} | {secs:.1f}")
            if rule != "median":
                ratios[rule].append(secs / paper)
                cells[-1] += f" | {secs / paper:.2f}"
        print(f"| {name} | {SETS[name][0]} | " + " | ".join(cells) + " |")
    for rule, values in ratios.items():
        if values:
            print(f"cost ratio {rule} / paper: max {max(values):.2f}")
    print()
    print("| upload set | K | FedBEns (K modes) | ensemble of the K start members | one mode "
          "(mean) | disagreement of the modes | of the start members | all C x M members | "
          "one member (mean) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in results["gap"].items():
        for k, cell in row["ks"].items():
            print(f"| {name} | {k} | {100 * cell['modes_ensemble']:.2f} | "
                  f"{100 * cell['starts_ensemble']:.2f} | {100 * cell['one_mode_mean']:.2f} | "
                  f"{cell['modes_disagreement']:.3f} | {cell['starts_disagreement']:.3f} | "
                  f"{100 * row['all_members_ensemble']:.2f} | "
                  f"{100 * row['one_member_mean']:.2f} |")
    save(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=("cost", "gap", "tables"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = load()
    {"cost": stage_cost, "gap": stage_gap, "tables": stage_tables}[args.stage](results)
    if args.stage != "tables":
        stage_tables(results)


if __name__ == "__main__":
    main()
