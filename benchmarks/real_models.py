"""Every strategy on real users' models: BatchNorm CNN, ResNet with and without BatchNorm,
LayerNorm MLP, a vision transformer and a transformer over integer tokens.

FMNIST (the token transformer: scikit-learn's digits as 64 integer tokens), C = 5 clients,
Dirichlet alpha in {0.1, 0.4}, seeds {0, 1}. Per (model, alpha, seed)
"cell": ONE live `flwr run` of FedBEns (M = 3 members per client, Kron curvature: K-FAC
blocks for Linear/Conv2d, diagonal blocks for the rest, T = 0.1, sigma^2 = 0.1, 300 server
steps with the validation set) whose clients also upload the diagonal curvature and
RegMean's Gram matrices (``extra-sections='curvature.diag,gram'``); every other row
REPLAYS the same uploads (``fedfusion.server_app.run_server`` with ``replay=``), so every
method sees identical partitions and local models:

* FedAvg, FedFisher (Kron), RegMean, Fisher merging, OTFusion (weights), DENSE, SWA (HOS),
  PFNM: member 0 of every client (one model per client, as their papers);
* AMS-top1: member 0 of every client (the AMS paper's one model per client);
* the uniform ensemble: all C x M members (the reference for FedBEns, which fuses them all),
  and the ensemble of as many members as FedBEns kept modes (member 0 of every client
  first), the same inference cost;
* FedBEns and FedAvg again with ``norm-stats=average`` (the sample-weighted average of the
  clients' BatchNorm running statistics), beside the default rule ``auto`` (= recalibrate
  the fused models' statistics on the 500 server validation rows; ``client`` for the
  ensemble and AMS, which keep the client models). Only for the models with BatchNorm:
  elsewhere the rule changes nothing.

PFNM matches the neurons of the zoo's plain ``mlp`` only and refuses these models by design,
DENSE synthesises float inputs only and refuses the token model: the refusal message is
recorded in the JSON and the table says "refused: ...".

Per-model settings (``MODELS`` below; ``--print-settings`` prints them, ``--set`` overrides
them). The training rows are a seeded ``train-subset`` of the 59,500 rows left after the 500
server validation rows; SGD lr 0.01, momentum 0.9; test metrics on all 10,000 test images:

==============  ==================================  =========  ==========  ======  =====  =====
key             model (model-kwargs)                parameters train rows  epochs  batch  DENSE
==============  ==================================  =========  ==========  ======  =====  =====
``bn_cnn``      bn_cnn ``{"width": 8}``             103,042    6,000       5       64     40
``resnet_bn``   resnet20 ``{"norm": "batch",        77,754     2,000       10      32     12
                "blocks": 1}`` (ResNet-8)
``resnet_nobn`` resnet20 ``{"norm": "none",         77,418     2,000       10      32     12
                "blocks": 1}`` (ResNet-8)
``ln_mlp``      ln_mlp (2 x 128, LayerNorm)         118,794    20,000      10      64     200
``vit``         vit (7x7 patches, 2 layers, dim 64) 71,946     3,000       5       64     20
``token_        token_transformer on digits         11,530     1,200       30      32     -
transformer``   (1 layer, dim 32)                              (all)
==============  ==================================  =========  ==========  ======  =====  =====

The token transformer's data set (``dataset=digits``) keeps 200 rows for the server's
validation (``val-size=200``) and tests on its fixed 397 rows.

Why these and not bigger (measured on the 2 shared cores, one thread, while other tests ran):

* the Kron section, not training, is the client's cost on conv nets. ResNet-20 (blocks 3):
  ~60 ms per sample for curvature.kron (im2col patch outer products of every conv), ~34 ms
  for gram, ~12 ms for curvature.diag, against ~4 ms per sample-epoch of training; ResNet-8
  (blocks 1): 16 / 7 / 5 ms against ~3 ms;
* bn_cnn at its default width 32 has a 3136 -> 128 first Linear layer: its 3136 x 3136 Kron
  factor costs ~14 s of eigendecomposition per member on the client, makes every upload
  ~83 MB per member (Kron + Gram) and ~2.2 s per FedBEns server step (11 min for 300 steps;
  FedFisher's 2000 steps ~19 min). Width 8 (784 -> 128) is 16x cheaper there;
* every replay evaluates on the full test set: the uniform ensemble of C x M = 15 members is
  15 forward passes over 10,000 images (ResNet-20: ~5 min per cell here, ResNet-8 ~1-2.5);
* with 2,000 rows, 3 epochs of batch 64 left the ResNet-8 members near chance on their own
  classes (BN 37%, no normalisation 25% on a 4-class client); 10 epochs of batch 32 reach
  87% / 76%.

DENSE's iterations are capped per model so that it costs about one minute of one core per
cell (its default is 200 iterations; measured 1.5 s per iteration on bn_cnn, 4.9 s on
ResNet-8, 0.3 s on ln_mlp); on the ResNets that leaves 12, which the table says.

Columns of the table: test accuracy (%) and NLL per alpha (mean +- sd over seeds); upload MB
per member (weights, BatchNorm buffers included, + the sections the method needs); client fit
seconds per client (the members the method uses x (local training + the sections it needs),
from the uploads' metrics, mean over clients and cells); server seconds (fusion, including
the BatchNorm recalibration, without the test evaluation; mean over cells).

Resume: a finished live run (``<out>/<cell>/results.json`` with status ok) and every finished
replay (``<out>/<cell>-<method>/results.json``, same run-config changes) are reused, so the
script can be stopped and started again; a finished live run made under other settings is
refused (use another ``--out``). By default (``--stage pipeline``) the live runs go through a
child process (``--stage live``, its log in ``<out>/live-stage.log``) while this process
replays each cell as soon as its live run is done (``--stage replay``); ``--stage all`` does
one cell after the other in one process.

    .venv/bin/python benchmarks/real_models.py          # 24 cells, hours here (see the page)
    .venv/bin/python benchmarks/real_models.py --models ln_mlp --alphas 0.1 --seeds 0 --quick
    .venv/bin/python benchmarks/real_models.py --tables-only   # tables of the saved JSON
    .venv/bin/python benchmarks/real_models.py --server fedfisher-steps=500 --out outputs/x

Saves benchmarks/results/real_models.json (one row per cell) and real_models.png, and
rewrites the generated part of benchmarks/docs/real-models.md
(``--quick`` writes under ``outputs/bench-real-models-quick`` only and leaves the page
alone; so does ``--no-readme``).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import REPO, live_run, live_run_in_process, section_mb, wait_for_live

from fedfusion.app.config import DATA_KEYS, STRATEGY_KEYS, Settings  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "real_models.json"
PAGE = REPO / "benchmarks" / "docs" / "real-models.md"
TABLE_START = "<!-- real_models.py: generated table, start -->"
TABLE_END = "<!-- real_models.py: generated table, end -->"

#: model key -> zoo model, its kwargs, label, training rows (0 = all), local epochs, batch
#: size, DENSE iterations (capped at about one minute of one core per cell), BatchNorm
MODELS: dict[str, dict] = {
    "bn_cnn": {"model": "bn_cnn", "kwargs": {"width": 8}, "label": "BN CNN (bn_cnn, width 8)",
               "subset": 6_000, "epochs": 5, "batch": 64, "dense_epochs": 40, "bn": True},
    "resnet_bn": {"model": "resnet20", "kwargs": {"norm": "batch", "blocks": 1},
                  "label": "ResNet-8 with BatchNorm (resnet20, blocks 1)", "subset": 2_000,
                  "epochs": 10, "batch": 32, "dense_epochs": 12, "bn": True},
    "resnet_nobn": {"model": "resnet20", "kwargs": {"norm": "none", "blocks": 1},
                    "label": "ResNet-8 without normalisation (resnet20, blocks 1)",
                    "subset": 2_000, "epochs": 10, "batch": 32, "dense_epochs": 12, "bn": False},
    "ln_mlp": {"model": "ln_mlp", "kwargs": {}, "label": "LayerNorm MLP (ln_mlp, 2 x 128)",
               "subset": 20_000, "epochs": 10, "batch": 64, "dense_epochs": 200, "bn": False},
    "vit": {"model": "vit", "kwargs": {}, "label": "vision transformer (vit: 7x7 patches, "
            "2 encoder layers, dim 64)", "subset": 3_000, "epochs": 5, "batch": 64,
            "dense_epochs": 20, "bn": False},
    # integer tokens: DENSE cannot synthesise them and refuses the model by design
    "token_transformer": {"model": "token_transformer", "kwargs": {}, "dataset": "digits",
                          "val_size": 200, "label": "token transformer (token_transformer "
                          "on digits' 64 integer tokens, 1 encoder layer, dim 32)",
                          "subset": 0, "epochs": 30, "batch": 32, "dense_epochs": 1,
                          "bn": False},
}
#: --quick: a tiny setting to check the plumbing (not a result)
QUICK = {"subset": {"bn_cnn": 1_500, "resnet_bn": 600, "resnet_nobn": 600, "ln_mlp": 5_000,
                    "vit": 1_500, "token_transformer": 0},
         "epochs": 1, "dense_epochs": 2, "server_steps": 60, "fedfisher_steps": 200}

#: method -> (run-config changes of the replay, upload sections it needs, members per client
#: it uses (0 = all M), True where only the models with BatchNorm run it)
METHODS: dict[str, tuple[dict[str, object], tuple[str, ...], int, bool]] = {
    # live: FedBEns, norm-stats auto, the paper's median starts (the default without BatchNorm)
    "fedbens": ({}, ("curvature.kron",), 0, False),
    "fedbens_avgstats": ({"strategy": "fedbens", "norm_stats": "average"},
                         ("curvature.kron",), 0, True),
    "fedbens_mean": ({"strategy": "fedbens", "fedbens_starts": "mean"},
                     ("curvature.kron",), 0, True),
    "ensemble": ({"strategy": "ensemble"}, (), 0, False),
    # as many members as FedBEns keeps modes (member 0 of every client first): run_cell
    "ensemble_modes": ({"strategy": "ensemble"}, (), 0, False),
    "ams": ({"strategy": "ams", "ams_top_k": 1}, (), 1, False),
    "fedavg": ({"strategy": "fedavg"}, (), 1, False),
    "fedavg_avgstats": ({"strategy": "fedavg", "norm_stats": "average"}, (), 1, True),
    "fedfisher_kron": ({"strategy": "fedfisher", "hessian_structure": "kron"},
                       ("curvature.kron",), 1, False),
    "regmean": ({"strategy": "regmean"}, ("gram",), 1, False),
    "fisher_merge": ({"strategy": "fisher-merge"}, ("curvature.diag",), 1, False),
    "otfusion": ({"strategy": "otfusion"}, (), 1, False),
    "dense": ({"strategy": "dense"}, (), 1, False),
    "swa": ({"strategy": "swa"}, (), 1, False),
    "pfnm": ({"strategy": "pfnm"}, (), 1, False),
}
LABELS = {
    "fedbens": "FedBEns (Kron, M = 3; norm-stats auto), starts median (default without BN)",
    "fedbens_avgstats": "FedBEns, norm-stats average",
    "fedbens_mean": "FedBEns, starts mean (per-member averages; the default with BN)",
    "ensemble": "uniform ensemble (C x M members)",
    "ensemble_modes": "uniform ensemble of as many members as FedBEns' modes",
    "ams": "AMS-top1 (member 0 of each client)",
    "fedavg": "FedAvg (norm-stats auto)",
    "fedavg_avgstats": "FedAvg, norm-stats average",
    "fedfisher_kron": "FedFisher (Kron)", "regmean": "RegMean",
    "fisher_merge": "Fisher merging", "otfusion": "OTFusion", "dense": "DENSE",
    "swa": "SWA (HOS)", "pfnm": "PFNM",
}
#: the one-model-per-client baselines FedBEns must beat
ONE_MODEL = ("fedavg", "fedavg_avgstats", "fedfisher_kron", "regmean", "fisher_merge",
             "otfusion", "dense", "swa", "pfnm")
#: run-config keys that decide the uploads: a live run made under others is not reused
UPLOAD_KEYS = (*DATA_KEYS, "extra-sections", "hessian-structure", "curvature-backend",
               "curvature-batch-size", "temperature", "prior-var")
#: server-side keys shared by the live run and every replay (--quick lowers some)
SERVER = {"server_threads": 1, "eval_batch_size": 256}
#: --in-process: live runs without Flower's processes (``InProcessGrid``), e.g. beside
#: another ``flwr run`` on the machine
IN_PROCESS = False
#: when the script started (progress lines)
T0 = time.perf_counter()


def stamp(progress: str) -> str:
    """``[cell i/n, elapsed]`` for a progress line."""
    return f"[{progress} {time.perf_counter() - T0:5.0f} s]"


def kebab(changes: dict[str, object]) -> str:
    """Run-config text of ``changes`` (``Settings`` field names)."""
    out = []
    for key, value in changes.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out.append(f"{key.replace('_', '-')}={shlex.quote(text)}")
    return " ".join(out)


def cell_name(model: str, alpha: float, seed: int) -> str:
    return f"{model}-a{alpha:g}-s{seed}"


def live_config(model: str, alpha: float, seed: int, args: argparse.Namespace) -> str:
    spec = MODELS[model]
    subset = QUICK["subset"][model] if args.quick else spec["subset"]
    epochs = QUICK["epochs"] if args.quick else spec["epochs"]
    return kebab({
        "strategy": "fedbens", "alpha": alpha, "seed": seed, "num_clients": 5,
        "dataset": spec.get("dataset", "fmnist"), "val_size": spec.get("val_size", 500),
        "num_members": args.members, "model": spec["model"],
        "model_kwargs": json.dumps(spec["kwargs"]) if spec["kwargs"] else "",
        "train_subset": subset, "local_epochs": epochs, "batch_size": spec["batch"],
        "hessian_structure": "kron", "extra_sections": "curvature.diag,gram",
        "fedbens_starts": "median", **server_keys(args)})


def server_keys(args: argparse.Namespace) -> dict[str, object]:
    """Server-side run-config keys of the live run and every replay (``Settings`` names)."""
    keys = dict(SERVER)
    if args.quick:
        keys.update(server_steps=QUICK["server_steps"], fedfisher_steps=QUICK["fedfisher_steps"])
    keys.update(args.server_overrides)
    return keys


def parse_overrides(sets: list[str], servers: list[str]) -> dict[str, object]:
    """Apply ``--set MODEL.FIELD=JSON`` to MODELS; return ``--server KEY=VALUE`` as
    ``Settings`` fields (type-checked by ``Settings.from_mapping``)."""
    for item in sets:
        target, _, value = item.partition("=")
        model, _, field = target.partition(".")
        if model not in MODELS or field not in MODELS[model]:
            raise SystemExit(f"--set {item!r}: expected MODEL.FIELD=VALUE with MODEL in "
                             f"{list(MODELS)} and FIELD in {list(MODELS['bn_cnn'])}")
        try:
            MODELS[model][field] = json.loads(value)
        except json.JSONDecodeError:
            MODELS[model][field] = value
    mapping = dict(item.split("=", 1) for item in servers)
    for key, value in mapping.items():
        try:
            mapping[key] = json.loads(value)
        except json.JSONDecodeError:
            pass
    parsed = Settings.from_mapping(mapping)
    return {k.replace("-", "_"): getattr(parsed, k.replace("-", "_")) for k in mapping}


def result_keys(strategy: str, changes: dict[str, object]) -> list[str]:
    """The run-config keys among ``changes`` that can change a replay's result: the
    strategy's own (``STRATEGY_KEYS``) and the general fusion keys; not e.g. server-threads."""
    own = set(STRATEGY_KEYS.get(strategy, {}).values()) | {
        "strategy", "norm-stats", "member-fusion", "server-validation", "replay-members",
        "replay-clients", "replay-client-members"}
    return [k for k in (f.replace("_", "-") for f in changes) if k in own]


def replay(out: str, name: str, method: str, **changes: object) -> dict:
    """Replay the cached uploads of run ``name`` into a strategy, reusing a finished replay
    made with the same result-changing run-config keys."""
    folder = Path(out) / f"{name}-{method}"
    done = folder / "results.json"
    settings = Settings(output_dir=out, run_name=f"{name}-{method}",
                        replay=f"{out}/{name}/uploads", **changes)
    if done.is_file():
        results = json.loads(done.read_text())
        wanted = settings.to_mapping()
        if results.get("status") == "ok" and all(
                results["settings"].get(k) == wanted[k]
                for k in result_keys(settings.strategy, changes)):
            results["reused"] = True
            return results
    start = time.perf_counter()
    try:
        results = run_server(settings)
    except Exception as exc:  # a failed replay is recorded, never fatal to the table
        results = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        print(f"  replay {name}-{method} FAILED: {results['error']}", flush=True)
    results["replay_wall_s"] = time.perf_counter() - start
    return results


def modes_members(live: dict, clients: int) -> dict[str, object]:
    """Replay changes keeping as many members as the live FedBEns run kept modes: member 0
    of every client first, then member 1, ..."""
    modes = int(live.get("strategy_report", {}).get("modes") or clients)
    per_client = [modes // clients + (c < modes % clients) for c in range(clients)]
    kept = [c for c in range(clients) if per_client[c]]
    return {"replay_clients": ",".join(map(str, kept)),
            "replay_client_members": ",".join(str(per_client[c]) for c in kept)}


#: by-design refusals (the message's words): PFNM matches the zoo's plain MLP only; DENSE
#: synthesises float inputs only; OTFusion aligns neither attention nor embeddings
REFUSALS = {"pfnm": "pfnm matches mlps only", "dense": "int", "otfusion": "cannot align"}


def refused(method: str, error: str | None) -> bool:
    """A strategy's by-design refusal of a model (:data:`REFUSALS`)."""
    return method in REFUSALS and bool(error) and REFUSALS[method] in error.lower()


def summary(method: str, results: dict) -> dict:
    if results.get("status") != "ok":
        error = results.get("error")
        return {"accuracy": math.nan, "nll": math.nan, "server_s": math.nan,
                "status": "refused" if refused(method, error) else "failed", "error": error,
                "replay_wall_s": results.get("replay_wall_s", math.nan)}
    out = {"accuracy": results["test"]["accuracy"], "nll": results["test"]["nll"],
           "ece": results["test"].get("ece"), "server_s": results["timing"]["server_fuse_s"],
           "eval_s": results["timing"].get("server_eval_s"), "status": "ok",
           "norm_stats": results.get("norm_stats", {}).get("rule"),
           "recalibrated_layers": results.get("norm_stats", {}).get("recalibrated_layers"),
           "replay_wall_s": results.get("replay_wall_s",
                                        results.get("timing", {}).get("wall_s", math.nan))}
    if method == "dense":
        report = results.get("strategy_report", {})
        out["dense_epochs"] = report.get("epochs")
        out["dense_s_per_iteration"] = report.get("seconds_per_iteration")
    return out


def run_live(out: str, name: str, run_config: str) -> dict:
    """The live run, launched (or reused); a failure is returned, and marked for --stage
    replay. A finished run made under other settings is an error (use another --out)."""
    marker = Path(out) / f"{name}.live-error"
    marker.unlink(missing_ok=True)
    check_settings(out, name, run_config)
    try:
        return (live_run_in_process if IN_PROCESS else live_run)(run_config, out, name)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        Path(out).mkdir(parents=True, exist_ok=True)
        marker.write_text(error)
        return {"status": "failed", "error": error}


def check_settings(out: str, name: str, run_config: str) -> None:
    """Refuse to reuse a finished live run whose uploads were made under other settings;
    warn where only its server-side keys differ (the live FedBEns row keeps them, the
    replays use the new ones)."""
    done = Path(out) / name / "results.json"
    if not done.is_file():
        return
    previous = json.loads(done.read_text())
    if previous.get("status") != "ok":
        return
    wanted = dict(item.split("=", 1) for item in shlex.split(run_config))
    have = previous.get("settings", {})
    changed = {k: (have.get(k), v) for k, v in wanted.items()
               if k in have and str(have[k]).lower() != v.lower()
               and not _same_number(have[k], v)}
    uploads = {k: v for k, v in changed.items() if k in UPLOAD_KEYS}
    if uploads:
        raise SystemExit(f"{done} was made with other settings {uploads} (have, wanted): "
                         "pass another --out, or delete it")
    if changed:
        print(f"note: the live run {name} was made with {changed} (have, wanted); its "
              "FedBEns row keeps them", flush=True)


def _same_number(have: object, want: str) -> bool:
    try:
        return float(have) == float(want)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def run_cell(model: str, alpha: float, seed: int, args: argparse.Namespace,
             cell: str) -> dict | None:
    """One (model, alpha, seed): the live run (stages all / live), then its replays."""
    name = cell_name(model, alpha, seed)
    spec = MODELS[model]
    start = time.perf_counter()
    config = live_config(model, alpha, seed, args)
    if args.stage == "replay":
        check_settings(args.out, name, config)
        live = wait_for_live(args.out, name)
        check_settings(args.out, name, config)
    else:
        print(f"{stamp(cell)} {name}: live FedBEns run ({config})", flush=True)
        live = run_live(args.out, name, config)
        print(f"{stamp(cell)} {name}: live run {live.get('status')} after "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    if args.stage == "live":
        return None
    if live.get("status") != "ok":
        print(f"{stamp(cell)} {name}: live run failed ({live.get('error')}): no row", flush=True)
        return {"model": model, "alpha": alpha, "seed": seed, "live_error": live.get("error"),
                "methods": {}}
    clients = live["clients"]
    members = sum(c["num_members"] for c in clients)
    timing = live["timing"]
    row: dict = {
        "model": model, "alpha": alpha, "seed": seed, "quick": args.quick,
        "settings": {k: live["settings"][k] for k in (
            "model", "model-kwargs", "train-subset", "local-epochs", "batch-size", "lr",
            "num-members", "num-clients", "server-steps", "fedfisher-steps")},
        "num_examples": [c["num_examples"] for c in clients], "members": members,
        "live_wall_s": timing["wall_s"], "client_round_s": timing.get("client_round_s"),
        "client_train_s_sum": timing["client_train_s_sum"],
        "server_live_s": timing["server_fuse_s"],
        # per member: summed over every client's members, divided by their number
        "train_s_per_member": timing["client_train_s_sum"] / members,
        "section_s_per_member": {
            sec: sum(c["section_time_s"].get(sec, 0.0) for c in clients) / members
            for sec in clients[0]["section_time_s"]},
        "section_mb_per_member": section_mb(f"{args.out}/{name}/uploads"),
        "methods": {"fedbens": {**summary("fedbens", live),
                                "replay_wall_s": 0.0, "live": True}},
    }
    dense_epochs = QUICK["dense_epochs"] if args.quick else spec["dense_epochs"]
    for method, (changes, _, used, bn_only) in METHODS.items():
        if method == "fedbens" or (bn_only and not spec["bn"]):
            continue
        changes = {**changes, **server_keys(args)}
        if used:
            changes["replay_members"] = used
        if method == "dense":
            changes["dense_epochs"] = dense_epochs
        if method == "ensemble_modes":
            changes.update(modes_members(live, len(clients)))
        t0 = time.perf_counter()
        results = replay(args.out, name, method, **changes)
        result = summary(method, results)
        row["methods"][method] = result
        acc = result["accuracy"]
        print(f"{stamp(cell)} {name}: {method:<16} " + (
            f"acc {100 * acc:6.2f}%  NLL {result['nll']:.3f}  server {result['server_s']:.1f} s"
            if result["status"] == "ok" else result["status"])
            + ("  (reused)" if results.get("reused") else
               f"  ({time.perf_counter() - t0:.0f} s)"), flush=True)
    row["bench_wall_s"] = time.perf_counter() - start
    return row


# ---------------------------------------------------------------------------- tables
def mean_sd(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    values = [scale * v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} +- {statistics.stdev(values):.{digits}f}"


def method_cost(rows: list[dict], method: str, members: int) -> tuple[str, str, str]:
    """Upload MB per member, client fit seconds per client, server seconds (means)."""
    _, sections, used, _ = METHODS[method]
    used = used or members
    mb = [r["section_mb_per_member"].get("weights", 0.0)
          + sum(r["section_mb_per_member"].get(s, 0.0) for s in sections) for r in rows]
    fit = [used * (r["train_s_per_member"]
                   + sum(r["section_s_per_member"].get(s, 0.0) for s in sections)) for r in rows]
    server = [r["methods"][method]["server_s"] for r in rows if method in r["methods"]]
    server = [v for v in server if not math.isnan(v)]
    return (f"{statistics.mean(mb):.3f}", f"{statistics.mean(fit):.1f}",
            f"{statistics.mean(server):.1f}" if server else "-")


def status_cell(rows: list[dict], method: str) -> str | None:
    """"refused: MLPs only" / "failed" where no cell has a result for the method."""
    entries = [r["methods"][method] for r in rows if method in r["methods"]]
    if not entries or any(e["status"] == "ok" for e in entries):
        return None
    if all(e["status"] == "refused" or refused(method, e.get("error")) for e in entries):
        return {"pfnm": "refused: MLPs only", "dense": "refused: integer inputs",
                "otfusion": "refused: cannot align"}[method]
    return "failed (see JSON)"


def tables(rows: list[dict], members: int) -> str:
    rows = [r for r in rows if r.get("methods")]
    if not rows:
        return "(no results yet)\n"
    lines: list[str] = []
    for model in [m for m in MODELS if any(r["model"] == m for r in rows)]:
        spec = MODELS[model]
        mrows = [r for r in rows if r["model"] == model]
        alphas = sorted({r["alpha"] for r in mrows})
        seeds = sorted({r["seed"] for r in mrows})
        s = mrows[0]["settings"]
        subset = s["train-subset"] or "all"
        lines += [f"**{spec['label']}** (`model={s['model']}` "
                  f"`model-kwargs={s['model-kwargs'] or '{}'}`; {subset} training rows, "
                  f"{s['local-epochs']} epochs, batch {s['batch-size']}; seeds "
                  f"{', '.join(map(str, seeds))}"
                  + ("; QUICK setting, not a result" if mrows[0].get("quick") else "") + ")", ""]
        head = "| method | " + " | ".join(f"acc % a={a:g} | NLL a={a:g}" for a in alphas)
        lines.append(head + " | upload MB / member | client fit s / client | server s |")
        lines.append("|---|" + "---|---|" * len(alphas) + "---|---|---|")
        for method in METHODS:
            if METHODS[method][3] and not spec["bn"]:
                continue
            label = LABELS[method]
            if method == "dense":
                its = {r["methods"]["dense"].get("dense_epochs") for r in mrows
                       if "dense" in r["methods"]}
                label += f" ({', '.join(str(i) for i in sorted(its, key=str))} iterations)"
            status = status_cell(mrows, method)
            cells = []
            for alpha in alphas:
                entries = [r["methods"][method] for r in mrows
                           if r["alpha"] == alpha and method in r["methods"]]
                if status:
                    cells += [status, "-"]
                    continue
                acc = mean_sd([e["accuracy"] for e in entries], 100)
                nll = mean_sd([e["nll"] for e in entries], 1, 3)
                bad = sum(e["status"] != "ok" for e in entries)
                cells += [acc + (f" ({bad} failed)" if bad else ""), nll]
            mb, fit, server = method_cost(mrows, method, members)
            lines.append(f"| {label} | " + " | ".join(cells)
                         + f" | {mb} | {fit} | {status and '-' or server} |")
        lines.append("")
        if spec["bn"] and 0.1 in alphas:
            lines += [target_line(mrows), ""]
        if model == "vit" and 0.1 in alphas:
            lines += [vit_target_line(mrows), ""]
    return "\n".join(lines) + "\n"


def mean_at(mrows: list[dict], method: str, alpha: float = 0.1) -> float:
    """Mean test accuracy (%) of ``method`` over the seeds at ``alpha``; NaN when none."""
    v = [r["methods"][method]["accuracy"] for r in mrows
         if r["alpha"] == alpha and method in r["methods"]
         and r["methods"][method]["status"] == "ok"]
    return 100 * statistics.mean(v) if v else math.nan


def vit_target_line(mrows: list[dict]) -> str:
    """The ViT target at alpha 0.1: FedBEns (defaults) >= FedAvg + 5 points and >= the
    uniform ensemble of as many members as it keeps modes (means over seeds)."""
    fedbens, fedavg = mean_at(mrows, "fedbens"), mean_at(mrows, "fedavg")
    peers = mean_at(mrows, "ensemble_modes")
    misses = [f"FedBEns {fedbens:.2f} < FedAvg {fedavg:.2f} + 5"] * (not fedbens >= fedavg + 5)
    misses += [f"FedBEns {fedbens:.2f} < ensemble of as many members {peers:.2f}"] * (
        not fedbens >= peers)
    return (f"Target at alpha 0.1 (FedBEns >= FedAvg + 5 and >= an ensemble of as many "
            f"members): {'met' if not misses else 'NOT met: ' + '; '.join(misses)}.")


def target_line(mrows: list[dict]) -> str:
    """Issue 24's target at alpha 0.1 for a model with BatchNorm: FedBEns with its default
    starts there (the means) >= FedAvg + 5 points and >= every one-model baseline (means over
    seeds)."""
    def mean(method: str) -> float:
        v = [r["methods"][method]["accuracy"] for r in mrows
             if r["alpha"] == 0.1 and method in r["methods"]
             and r["methods"][method]["status"] == "ok"]
        return 100 * statistics.mean(v) if v else math.nan

    fedbens, fedavg = mean("fedbens_mean"), mean("fedavg")
    misses = []
    if not fedbens >= fedavg + 5:
        misses.append(f"FedBEns {fedbens:.2f} < FedAvg {fedavg:.2f} + 5")
    for method in ONE_MODEL:
        value = mean(method)
        if not math.isnan(value) and value > fedbens:
            misses.append(f"{LABELS[method]} {value:.2f} > FedBEns {fedbens:.2f}")
    verdict = "met" if not misses else "NOT met: " + "; ".join(misses)
    return (f"Target at alpha 0.1 (FedBEns with its default starts for BatchNorm, the means, "
            f">= FedAvg + 5 and >= every one-model baseline): "
            f"{verdict} (FedBEns - FedAvg = {fedbens - fedavg:+.2f} points).")


def timing_text(rows: list[dict]) -> str:
    """Where the time went, per model (means over its cells)."""
    rows = [r for r in rows if r.get("methods")]
    if not rows:
        return ""
    lines = ["Seconds per cell, mean over cells: live `flwr run` wall; client training and "
             "sections summed over clients; replays (wall, one thread) and the slowest three", ""]
    for model in [m for m in MODELS if any(r["model"] == m for r in rows)]:
        mrows = [r for r in rows if r["model"] == model]
        train = statistics.mean(r["client_train_s_sum"] for r in mrows)
        sections = {s: statistics.mean(r["section_s_per_member"].get(s, 0.0) * r["members"]
                                       for r in mrows)
                    for s in mrows[0]["section_s_per_member"] if s != "weights"}
        walls = {m: statistics.mean(r["methods"][m].get("replay_wall_s") or 0.0
                                    for r in mrows if m in r["methods"])
                 for m in METHODS if m != "fedbens" and any(m in r["methods"] for r in mrows)}
        slow = sorted(walls.items(), key=lambda t: -t[1])[:3]
        lines.append(
            f"- {model}: live {statistics.mean(r['live_wall_s'] for r in mrows):.0f} "
            f"(server {statistics.mean(r['server_live_s'] for r in mrows):.0f}); "
            f"training {train:.0f}, " + ", ".join(f"{s} {v:.0f}" for s, v in sections.items())
            + f"; replays {sum(walls.values()):.0f} ("
            + ", ".join(f"{m} {v:.0f}" for m, v in slow) + ")")
    return "\n".join(lines) + "\n"


def write_readme(text: str) -> None:
    readme = PAGE.read_text()
    if TABLE_START not in readme or TABLE_END not in readme:
        print(f"{PAGE} has no generated-table markers: not updated")
        return
    head, rest = readme.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    PAGE.write_text(f"{head}{TABLE_START}\n{text}{TABLE_END}{tail}")
    print(f"updated {PAGE}")


def plot(rows: list[dict], path: Path) -> None:
    """Accuracy per method and model at each alpha (mean over seeds, sd as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("methods")]
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    alphas = sorted({r["alpha"] for r in rows})
    methods = [m for m in METHODS if m != "pfnm"]
    fig, axes = plt.subplots(len(alphas), 1, figsize=(12, 1.2 + 3.6 * len(alphas)),
                             squeeze=False)
    width = 0.8 / len(methods)
    for ax, alpha in zip(axes[:, 0], alphas, strict=True):
        for j, method in enumerate(methods):
            means, sds = [], []
            for model in models:
                v = [100 * r["methods"][method]["accuracy"] for r in rows
                     if r["model"] == model and r["alpha"] == alpha and method in r["methods"]
                     and r["methods"][method]["status"] == "ok"]
                means.append(statistics.mean(v) if v else math.nan)
                sds.append(statistics.stdev(v) if len(v) > 1 else 0.0)
            ax.bar([i + (j - len(methods) / 2) * width for i in range(len(models))], means,
                   width, yerr=sds, capsize=1, label=LABELS[method],
                   color=plt.get_cmap("tab20")(j))
        ax.set_xticks([i - width / 2 for i in range(len(models))], models)
        ax.set(ylabel="test accuracy (%)", title=f"FMNIST, C = 5, Dirichlet alpha {alpha:g}")
    axes[0, 0].legend(fontsize=7, ncol=4, loc="upper left", bbox_to_anchor=(0, -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--alphas", default="0.1,0.4")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--members", type=int, default=3, help="M of FedBEns")
    parser.add_argument("--in-process", action="store_true",
                        help="live runs in this process (InProcessGrid), not through flwr run")
    parser.add_argument("--quick", action="store_true",
                        help="tiny plumbing check: small subsets, 1 epoch, few server steps; "
                             "results under outputs/ only")
    parser.add_argument("--out", default=None,
                        help="live runs and replays (default outputs/bench-real-models, "
                             "-quick with --quick)")
    parser.add_argument("--results", default=None,
                        help=f"results JSON (default {RESULTS.relative_to(REPO)}; with --quick "
                             "<out>/real_models.json)")
    parser.add_argument("--stage", choices=("pipeline", "all", "live", "replay"),
                        default="pipeline",
                        help="pipeline (default): the live runs in a child process (log in "
                             "<out>/live-stage.log) while this one replays each finished "
                             "cell; all: live run then replays, cell by cell; live / replay: "
                             "one half of the pipeline")
    parser.add_argument("--tables-only", action="store_true",
                        help="print the tables of the saved results and exit")
    parser.add_argument("--no-readme", action="store_true",
                        help="do not rewrite the generated table in benchmarks/docs/real-models.md")
    parser.add_argument("--set", action="append", default=[], metavar="MODEL.FIELD=VALUE",
                        help="override a per-model setting of MODELS, e.g. "
                             "resnet_bn.subset=2000 or 'bn_cnn.kwargs={\"width\": 16}' "
                             "(use another --out: finished runs are reused by name)")
    parser.add_argument("--server", action="append", default=[], metavar="KEY=VALUE",
                        help="a server-side run-config key for the live runs and every "
                             "replay, e.g. fedfisher-steps=500")
    parser.add_argument("--print-settings", action="store_true")
    args = parser.parse_args()
    global IN_PROCESS
    IN_PROCESS = args.in_process
    args.server_overrides = parse_overrides(args.set, args.server)
    if args.print_settings:
        for key, spec in MODELS.items():
            print(key, json.dumps(spec))
        print("quick", json.dumps(QUICK))
        return
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    suffix = "-quick" if args.quick else ""
    args.out = args.out or str(REPO / "outputs" / f"bench-real-models{suffix}")
    results = Path(args.results or (Path(args.out) / "real_models.json" if args.quick
                                    else RESULTS))
    readme = not (args.quick or args.no_readme)
    torch.set_num_threads(1)  # replays in this process; the live runs set their own threads

    def load() -> list[dict]:
        return json.loads(results.read_text()) if results.is_file() else []

    rows = load()
    child = None
    if args.stage == "pipeline" and not args.tables_only:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for marker in Path(args.out).glob("*.live-error"):  # a past failure, not this run's
            marker.unlink()
        log_file = Path(args.out) / "live-stage.log"
        argv = [a for a in sys.argv[1:] if not a.startswith("--stage")]
        if "--stage" in sys.argv[1:]:  # "--stage pipeline" as two words
            i = sys.argv[1:].index("--stage")
            argv = sys.argv[1:i + 1] + sys.argv[i + 3:]
        child = subprocess.Popen([sys.executable, __file__, *argv, "--stage", "live"],
                                 stdout=log_file.open("w"), stderr=subprocess.STDOUT)
        print(f"live stage: pid {child.pid}, log {log_file}", flush=True)
        args.stage = "replay"
    cells = [(m, float(a), int(s)) for s in args.seeds.split(",")
             for a in args.alphas.split(",") for m in models]
    started = time.perf_counter()
    if not args.tables_only:
        for i, (model, alpha, seed) in enumerate(cells, 1):
            progress = f"{i}/{len(cells)}"
            row = run_cell(model, alpha, seed, args, progress)
            if row is None:
                continue
            rows = [r for r in load() if (r["model"], r["alpha"], r["seed"])
                    != (model, alpha, seed)] + [row]
            results.parent.mkdir(parents=True, exist_ok=True)
            results.write_text(json.dumps(rows, indent=1))
            print(f"{stamp(progress)} {cell_name(model, alpha, seed)} done in "
                  f"{row.get('bench_wall_s', 0):.0f} s; saved {results}", flush=True)
        if child is not None and child.wait() != 0:
            print(f"the live stage exited with {child.returncode}: see its log", flush=True)
        print(f"all {len(cells)} cells in {time.perf_counter() - started:.0f} s", flush=True)
        if args.stage == "live":
            return
    text = tables(rows, args.members)
    print("\n" + text + "\n" + timing_text(rows))
    if rows and any(r.get("methods") for r in rows):
        plot(rows, results.with_suffix(".png"))
    if readme:
        write_readme(text + "\n" + timing_text(rows))


if __name__ == "__main__":
    main()
