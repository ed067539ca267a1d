"""The curvature/Gram screen and the validation screen on saved honest uploads (their false
positives) and on the hostile cases they are for (accuracy before and after).

Honest part: every complete upload folder under ``<outputs>/bench-*/**/uploads`` (the
benchmarks' live runs, read only). Per folder, on the run's own validation rows:

* the validation screen (:func:`fedfusion.core.screening.agreement_scores`): every
  member's accuracy a, what its own predicted-class rates score by chance e, the z-score
  (a - e) / sqrt(e (1 - e) / n), and whether it would be excluded;
* the curvature/Gram screen (:func:`~fedfusion.core.screening.screen_curvature`) of
  every curvature or Gram section the folder holds: per client the largest ratio of a
  layer's trace per example (capped counts) to the clients' median, and the exclusions at
  the default factor.

Hostile part (``--hostile``, the alpha 0.1 leaderboard cell, C = 5, M = 5): client 4 of 5
replaced by a free rider (the run's broadcast inits as its members, client 4's sections
and count) with (a) every Kron eigenvalue and GGN diagonal at the cap (MAX_ABS_CURVATURE)
-> FedBEns, FedFisher; (b) every ``curvature.diag`` entry at the cap -> Fisher merging;
(c) its Grams scaled to the cap (MAX_ABS_GRAM) -> RegMean; or by client 4 sending (d) the honest
clients' FedAvg (per member) with its last layer negated -> FedBEns, FedAvg; (e) the same
with the last layer's rows rolled by one class -> FedBEns, FedAvg. Test accuracy of the
strategy on the five honest uploads, on the hostile set with the new screens off (the
weight screen and the count cap on, as before), and with the defaults; who was excluded.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/screening_false_positives.py \\
        [--outputs /work/main/outputs] [--hostile]

Saves ``benchmarks/results/screening_false_positives.json`` (the honest part is recomputed
every run; the hostile part is kept from the last run that had ``--hostile``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import REPO

from fedfusion.app.config import Settings, build_strategy, default_model
from fedfusion.app.federation import federated_split
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.evaluation import evaluate, predict_log_probs
from fedfusion.core.screening import (
    agreement_scores,
    cap_num_examples,
    screen_curvature,
    screened_section,
    section_scales,
)
from fedfusion.core.state import weighted_average
from fedfusion.sections import MAX_ABS_CURVATURE, MAX_ABS_GRAM
from fedfusion.server_app import replay_settings
from fedfusion.wire import WEIGHTS, ClientUpload

RESULTS = REPO / "benchmarks" / "results" / "screening_false_positives.json"
HOSTILE_CELL = "bench-leaderboard/table1-C5_a0.1-s0"
DEFAULTS = Settings()


def load_cell(folder: Path) -> tuple[Settings, list[ClientUpload], Any, ModelSpec]:
    settings, uploads, failures = replay_settings(Settings(replay=str(folder)))
    if failures:
        raise RuntimeError(f"{folder}: clients failed to load: {failures}")
    bundle = federated_split(settings).bundle
    spec = ModelSpec(default_model(settings, bundle.input_shape), bundle.input_shape,
                     bundle.num_classes, settings.parsed_model_kwargs())
    return settings, sorted(uploads, key=lambda u: u.client_id), bundle, spec


def honest(folder: Path) -> dict[str, Any]:
    settings, uploads, bundle, spec = load_cell(folder)
    val = bundle.val
    members = []
    for upload in uploads:
        predictions = [predict_log_probs(spec.build(m[WEIGHTS]), val.x).argmax(dim=1)
                       for m in upload.members]
        for m, score in enumerate(agreement_scores(predictions, val.y, bundle.num_classes)):
            se = math.sqrt(score["expected"] * (1 - score["expected"]) / len(val))
            members.append({"client": upload.client_id, "member": m, **score,
                            "z": (score["accuracy"] - score["expected"]) / se})
    counts = [u.num_examples for u in cap_num_examples(uploads, DEFAULTS.num_examples_cap)[0]]
    sections = {}
    for section in (s for s in uploads[0].sections if screened_section(s)):
        per = [[{k: t / n for k, (t, _) in section_scales(section, m[section]).items()}
                for m in u.members] for u, n in zip(uploads, counts, strict=True)]
        ratios = {}
        for layer in per[0][0]:
            reference = float(np.median([np.median([m[layer] for m in c]) for c in per]))
            for upload, client in zip(uploads, per, strict=True):
                ratios[upload.client_id] = max(ratios.get(upload.client_id, 0.0),
                                               max(m[layer] for m in client) / reference)
        _, excluded, _ = screen_curvature(uploads, DEFAULTS.curvature_screen_factor,
                                          [section], counts)
        sections[section] = {"max_ratio_per_client": ratios,
                             "excluded": [u.client_id for u, _ in excluded]}
    return {"folder": str(folder), "alpha": settings.alpha, "clients": len(uploads),
            "members": len(members), "val_rows": len(val), "counts": counts,
            "val_screen": {"excluded_members": sum(m["below"] for m in members),
                           "min_z": min(m["z"] for m in members),
                           "min_accuracy_minus_expected": min(
                               m["accuracy"] - m["expected"] for m in members),
                           "per_member": members},
            "curvature_screen": sections}


def last_layer(weights: dict[str, np.ndarray]) -> list[str]:
    """The last 2-D weight and, where it has one, its bias."""
    name = [k for k, v in weights.items() if v.ndim == 2][-1]
    bias = name[: -len("weight")] + "bias"
    return [name] + ([bias] if bias in weights else [])


def direction_attack(uploads: list[ClientUpload], victim: ClientUpload, kind: str
                     ) -> ClientUpload:
    """``victim`` (its curvature and counts kept) sending, as member m, the FedAvg of the
    other clients' member m with its last layer negated or its rows rolled by one class."""
    others = [u for u in uploads if u is not victim]
    members = []
    for m, member in enumerate(victim.members):
        average = weighted_average([u.weights(m) for u in others],
                                   [u.num_examples for u in others])
        for name in last_layer(average):
            average[name] = (-average[name] if kind == "negated"
                             else np.roll(average[name], 1, axis=0)).astype(
                average[name].dtype)
        members.append({**member, WEIGHTS: average})
    return dataclasses.replace(victim, members=members)


def at_cap(victim: ClientUpload, section: str, inits: list[dict[str, np.ndarray]]
           ) -> ClientUpload:
    """A free rider in ``victim``'s place: the broadcast inits as its members (normal norms,
    at chance and not below it, so the weight and validation screens pass it), every
    eigenvalue / diagonal of ``section`` at the curvature cap, or (``gram``) every Gram
    scaled so its largest entry is the Gram cap (less 1e-6, so float32 rounding stays
    under it)."""
    members = []
    for init, member in zip(inits, victim.members, strict=True):
        arrays = {}
        for key, array in member[section].items():
            if section == "gram":
                scale = MAX_ABS_GRAM * (1 - 1e-6) / np.abs(array).max()
                arrays[key] = (array.astype(np.float64) * scale).astype(array.dtype)
            elif key.endswith(("/eigvals_out", "/eigvals_in", "/ggn_diag")):
                arrays[key] = np.full_like(array, MAX_ABS_CURVATURE)
            else:
                arrays[key] = array
        members.append({**member, WEIGHTS: init, section: arrays})
    return dataclasses.replace(victim, members=members)


CASES = (  # (case, hostile-upload maker, strategies, run-config of each)
    ("kron_eigenvalues_at_cap", lambda ups, v, i: at_cap(v, "curvature.kron", i),
     [("fedbens", {}), ("fedfisher", {})]),
    ("diag_at_cap", lambda ups, v, i: at_cap(v, "curvature.diag", i),
     [("fisher-merge", {})]),
    ("gram_at_cap", lambda ups, v, i: at_cap(v, "gram", i), [("regmean", {})]),
    ("last_layer_negated", lambda ups, v, i: direction_attack(ups, v, "negated"),
     [("fedbens", {}), ("fedavg", {})]),
    ("last_layer_rolled", lambda ups, v, i: direction_attack(ups, v, "rolled"),
     [("fedbens", {}), ("fedavg", {})]),
)


def fuse(settings: Settings, spec: ModelSpec, bundle: Any, uploads: list[ClientUpload],
         strategy: str, extra: dict[str, Any], screens: bool) -> dict[str, Any]:
    values = {**settings.to_mapping(), **extra, "strategy": strategy, "replay": ""}
    if not screens:
        values.update({"curvature-screen-factor": 0.0, "val-screen": False})
    run = Settings.from_mapping(values)
    fusion = build_strategy(run, spec, bundle.val, "cpu")
    start = time.perf_counter()
    predictor = fusion.fuse_uploads(uploads)
    return {"test_accuracy": evaluate(predictor, bundle.test.x, bundle.test.y)["accuracy"],
            "excluded": [e["reason"] for e in fusion.exclusions],
            "seconds": time.perf_counter() - start}


def hostile(folder: Path, cases: set[str]) -> list[dict[str, Any]]:
    settings, uploads, bundle, spec = load_cell(folder)
    victim = uploads[-1]
    # the run's broadcast: what a free rider uploads untrained
    inits = build_strategy(settings, spec).initial_models()
    rows, honest_cache = [], {}
    for case, make, strategies in CASES:
        if case not in cases:
            continue
        attacked = [*uploads[:-1], make(uploads, victim, inits)]
        for strategy, extra in strategies:
            key = (strategy, tuple(sorted(extra.items())))
            if key not in honest_cache:
                honest_cache[key] = fuse(settings, spec, bundle, uploads, strategy, extra, True)
            row = {"case": case, "strategy": strategy, "run_config": extra,
                   "hostile_client": victim.client_id,
                   "honest": honest_cache[key],
                   "unscreened": fuse(settings, spec, bundle, attacked, strategy, extra, False),
                   "screened": fuse(settings, spec, bundle, attacked, strategy, extra, True)}
            print(f"{case:24s} {strategy:12s} honest {row['honest']['test_accuracy']:.3f} "
                  f"unscreened {row['unscreened']['test_accuracy']:.3f} screened "
                  f"{row['screened']['test_accuracy']:.3f} excluded "
                  f"{row['screened']['excluded']}", flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outputs", default=str(REPO / "outputs"))
    parser.add_argument("--hostile", action="store_true")
    parser.add_argument("--cases", default=",".join(case for case, _, _ in CASES),
                        help="hostile cases to run (their rows replace the saved ones)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    outputs = Path(args.outputs)
    folders = sorted(p for p in outputs.glob("bench-*/**/uploads")
                     if (p / "manifest.json").is_file())
    results: dict[str, Any] = {}
    results["defaults"] = {"curvature_screen_factor": DEFAULTS.curvature_screen_factor,
                           "val_screen": DEFAULTS.val_screen,
                           "num_examples_cap": DEFAULTS.num_examples_cap}
    results["honest"] = []
    for folder in folders:
        cell = honest(folder)
        cell["folder"] = str(folder.relative_to(outputs))
        results["honest"].append(cell)
        worst = {s: round(max(v["max_ratio_per_client"].values()), 2)
                 for s, v in cell["curvature_screen"].items()}
        print(f"{cell['folder']}: alpha {cell['alpha']}, {cell['members']} members, val "
              f"screen excludes {cell['val_screen']['excluded_members']} (min z "
              f"{cell['val_screen']['min_z']:.1f}); curvature screen worst ratio {worst}, "
              f"excludes {[v['excluded'] for v in cell['curvature_screen'].values()]}",
              flush=True)
    rows = hostile(outputs / HOSTILE_CELL / "uploads", set(args.cases.split(","))) \
        if args.hostile else []
    # read at the end: rows of other cases saved since (another run) are kept
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    done = {(row["case"], row["strategy"]) for row in rows}
    results["hostile"] = {"folder": HOSTILE_CELL, "rows": [
        *(row for row in saved.get("hostile", {}).get("rows", [])
          if (row["case"], row["strategy"]) not in done), *rows]}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
