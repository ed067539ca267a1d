"""fedfusion ServerApp: build the strategy from the run config, run it (or replay cached
uploads into it), evaluate the global predictor, print a summary and save the results.

Outputs of a run, in ``<output-dir>/<run-name>/``:

* ``results.json``: settings, test/validation metrics, per-round metrics, per-client
  histogram, training time and upload size, excluded clients with reasons, timings;
* ``predictor.pt``: the global predictor (:func:`fedfusion.core.predictors.load_predictor`);
* ``uploads/``: the clients' uploads of a one-shot run (replay them with ``replay=...``).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedfusion import setup_logging
from fedfusion.app.config import (
    DATA_KEYS,
    ConfigError,
    Settings,
    build_strategy,
    check_output_name,
    default_model,
    resolved_holdout,
)
from fedfusion.app.federation import FederatedSplit, federated_split
from fedfusion.app.inprocess import InProcessGrid
from fedfusion.client_app import data_description
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.evaluation import evaluate, resolve_device
from fedfusion.core.predictors import Ensemble, save_predictor
from fedfusion.core.screening import capped_reason
from fedfusion.core.state import state_arrays
from fedfusion.datasets import load_dataset
from fedfusion.device import DEVICE_METRIC, device_label
from fedfusion.strategies import FENS, FusionStrategy
from fedfusion.upload_store import UploadWriter, load_uploads, make_folder, open_no_follow
from fedfusion.wire import ClientUpload

log = logging.getLogger("fedfusion")

#: where the partition file is: adopted from the manifest unless the run config names one
#: (the file may live elsewhere on this machine; partition-sha256 still has to match)
PARTITION_KEYS = ("partition-file", "partition-key")

app = ServerApp()


#: what a run writes into its folder (none of them may be a symlink there)
OUTPUTS = ("results.json", "predictor.pt", "uploads")


def output_folder(settings: Settings) -> Path:
    """``<output-dir>/<run-name>``, created, or an existing real folder; refused (OSError
    naming run-name) when it, or any of :data:`OUTPUTS` in it, is a symlink, and (ConfigError
    naming the key) before anything is created when ``run-name`` is not one folder name
    (absolute, ``..``, a NUL, a separator: also for Settings built without ``validate()``).
    The folder, symlinks resolved, lies directly inside the resolved ``output-dir``."""
    if "\0" in settings.output_dir:  # also for Settings built without validate()
        raise ConfigError("run-config 'output-dir' holds a NUL byte; no path can")
    root = Path(settings.output_dir).expanduser() if settings.output_dir else (
        Path.home() / "fedfusion-outputs")
    name = settings.run_name or (
        f"{time.strftime('%Y%m%d-%H%M%S')}-{settings.strategy}-{settings.dataset}"
        f"-{settings.partitioner}{settings.alpha:g}-s{settings.seed}"
        + ("-replay" if settings.replay else ""))
    check_output_name("run-name", name)  # one name: nothing on the way but output-dir
    root = root.resolve()
    try:
        folder = make_folder(root / name)  # a symlink in its place is refused
    except OSError as exc:
        raise OSError(exc.errno, f"run-config 'run-name' {name!r} in output-dir "
                      f"{str(root)!r}: {exc.strerror or exc}") from exc
    if folder.resolve().parent != root:  # what the checks above guarantee, asserted
        raise ConfigError(f"run-config 'run-name' {name!r} resolves to {folder.resolve()}, "
                          f"outside output-dir {str(root)!r}")
    for output in OUTPUTS:  # refused now rather than after the run: nothing follows a link
        if (folder / output).is_symlink():
            raise OSError(errno.ELOOP, f"refusing to write {folder / output}: it is a symlink "
                          f"(to {os.readlink(folder / output)!r}); remove it, or choose "
                          "another output-dir or run-name")
    return folder


def replay_settings(settings: Settings
                    ) -> tuple[Settings, list[ClientUpload], list[tuple[str, str]]]:
    """Adopt the data/model settings the cached uploads were produced under; also return
    the (client, reason) of every cached client that failed to load."""
    produced_under, uploads, failures = load_uploads(settings.replay)
    changes = {}
    for key in DATA_KEYS:
        if key in produced_under and produced_under[key] != settings.to_mapping()[key]:
            log.warning("replay: using %s=%r from the upload folder (run config had %r)", key,
                        produced_under[key], settings.to_mapping()[key])
            changes[key] = produced_under[key]
    if not settings.partition_file:
        changes.update({k: produced_under[k] for k in PARTITION_KEYS if k in produced_under})
    keep = settings.parsed_replay_clients()
    if keep is not None:
        failures = [f for f in failures if not f[0].isdigit() or int(f[0]) in keep]
        missing = sorted(set(keep) - {u.client_id for u in uploads}
                         - {int(c) for c, _ in failures if c.isdigit()})
        if missing:
            raise ValueError(f"replay-clients names clients {missing} absent from the uploads")
        uploads = [u for u in uploads if u.client_id in keep]
        log.info("replay: keeping clients %s of the cached run", list(keep))
    if settings.replay_members:
        for upload in uploads:
            upload.members = upload.members[: settings.replay_members]
        log.info("replay: keeping each client's first %d member(s)", settings.replay_members)
    per_client = settings.parsed_replay_client_members()
    if per_client is not None:
        for upload in uploads:
            if upload.client_id >= len(per_client):
                raise ValueError(f"replay-client-members lists {len(per_client)} clients but "
                                 f"the uploads hold client {upload.client_id}")
            upload.members = upload.members[: per_client[upload.client_id]]
        log.info("replay: members per client %s", list(per_client))
    # from_mapping, not replace: the manifest's values are type-checked by key
    return Settings.from_mapping({**settings.to_mapping(), **changes}), uploads, failures


def print_histogram(split: FederatedSplit) -> None:
    hist = split.histogram
    header = "client " + " ".join(f"{k:>6d}" for k in range(hist.shape[1])) + "   total"
    lines = [header] + [
        f"{c:>6d} " + " ".join(f"{v:>6d}" for v in row) + f" {row.sum():>7d}"
        for c, row in enumerate(hist)
    ]
    log.info("class histogram per client (columns: classes)\n%s", "\n".join(lines))


def run_server(settings: Settings, grid: Grid | None = None) -> dict[str, Any]:
    """Run one fedfusion job (live through ``grid``, or a replay) and save its results."""
    setup_logging()
    wall_start = time.perf_counter()
    uploads: list[ClientUpload] | None = None
    failures: list[tuple[str, str]] = []
    if settings.replay:
        settings, uploads, failures = replay_settings(settings)
    folder = output_folder(settings)
    results: dict[str, Any] = {"status": "running", "settings": settings.to_mapping(),
                               "output_dir": str(folder)}
    # a process killed from outside (out of memory, a lost Ray node) runs no `finally`: the
    # file says "running" then, and the launcher turns it into a failed run
    write_results(folder, results)
    try:
        _run(settings, grid, uploads, folder, results, failures)
        results["status"] = "ok"
    except Exception as exc:
        results.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                       traceback=traceback.format_exc())
        raise
    finally:
        results.setdefault("timing", {})["wall_s"] = time.perf_counter() - wall_start
        write_results(folder, results)
        print_summary(results)
    return results


def write_results(folder: Path, results: dict[str, Any]) -> None:
    """``folder/results.json`` (strict JSON; a symlink in its place is refused)."""
    with open_no_follow(folder / "results.json") as handle:
        handle.write(json.dumps(strict_json(results), indent=1, allow_nan=False).encode())


def _run(settings: Settings, grid: Grid | None, uploads: list[ClientUpload] | None,
         folder: Path, results: dict[str, Any], failures: Sequence[tuple[str, str]] = ()
         ) -> None:
    local_data = settings.client_data == "local"
    if uploads is None:  # recorded as it applies (a replay's manifest then says it)
        settings = settings.replace(holdout_fraction=resolved_holdout(settings))
        results["settings"] = settings.to_mapping()
    if local_data:
        # each device trains on its own file: no split, the server only holds its
        # validation holdout and the test set (what it evaluates on)
        split = None
        bundle = load_dataset(settings.dataset, data_dir=settings.data_dir or None,
                              val_size=settings.val_size, seed=settings.data_seed,
                              stats=settings.parsed_input_stats())
        results["partition"] = {"client_data": "local"}
    else:
        split = federated_split(settings)
        if split.partition_sha256 and not settings.partition_sha256:
            # pinned from here on: the clients check their copy, the manifest records it
            settings = settings.replace(partition_sha256=split.partition_sha256)
            results["settings"] = settings.to_mapping()
        bundle = split.bundle
        print_histogram(split)
        results["partition"] = split.describe()
    if split is not None and split.val_overlap and settings.server_validation:
        log.warning("validation: %d distinct rows of the %d validation rows are also client data "
                    "(val-source='file')", split.val_overlap, len(bundle.val))
    device = resolve_device(settings.server_device)
    if settings.server_threads:
        # small batched steps: with another process on a core, extra OpenMP threads wait on
        # each other (measured ~30x slower at 2 threads than 1 on a loaded 2-core machine)
        torch.set_num_threads(settings.server_threads)
    spec = ModelSpec(default_model(settings, bundle.input_shape), bundle.input_shape,
                     bundle.num_classes, settings.parsed_model_kwargs())
    use_val = settings.server_validation and len(bundle.val) > 0
    sink = None
    if uploads is None and settings.save_uploads and settings.num_rounds == 1:
        # each upload on disk as it arrives, the manifest before fusion
        sink = UploadWriter(folder / "uploads", settings.to_mapping())
    strategy = build_strategy(settings, spec, bundle.val if use_val else None, device,
                              upload_sink=sink)
    context = strategy.context
    results["excluded"] = strategy.exclusions  # kept in results.json even if the run fails
    if strategy.one_shot_only and settings.num_rounds > 1:
        raise ConfigError(f"strategy {settings.strategy!r} is one-shot: set num-rounds=1")
    results["rounds"] = rounds = []
    eval_seconds = [0.0]

    def evaluate_predictor(server_round: int) -> dict[str, float]:
        start = time.perf_counter()
        assert strategy.predictor is not None
        metrics = {f"test_{k}": v for k, v in evaluate(
            strategy.predictor, bundle.test.x, bundle.test.y, device, settings.eval_batch_size
        ).items()}
        eval_seconds[0] += time.perf_counter() - start
        rounds.append({"round": server_round, **metrics})
        log.info("round %d: test accuracy %.2f%%, NLL %.4f, ECE %.4f", server_round,
                 100 * metrics["test_accuracy"], metrics["test_nll"], metrics["test_ece"])
        return metrics

    if uploads is not None:
        results["replay_of"] = str(Path(settings.replay).resolve())
        for client, reason in failures:  # cached clients that did not load
            strategy.exclude(1, client, reason)
        strategy.fuse_uploads(uploads)
        evaluate_predictor(1)
        if isinstance(strategy, FENS):  # its aggregator rounds, with the uploads' clients
            if not settings.holdout_fraction:
                raise ConfigError("strategy 'fens' trains its aggregator on rows the clients "
                                  "held out of local training; these uploads were trained on "
                                  "all rows (holdout-fraction 0 in their manifest)")
            if grid is None:  # the uploads' own clients, each on its own rows
                grid = InProcessGrid(settings)
                nodes = [grid.node_of(u.client_id) for u in strategy.uploads]
            else:  # a replay inside Flower: its nodes (the uploads' node ids are stale)
                nodes = sorted(grid.get_node_ids())
            used = strategy.train_aggregator(grid, nodes)
            evaluate_predictor(1 + used)
    else:
        if grid is None:
            raise ValueError("a live run needs a Flower grid; pass replay=<folder> to replay")
        strategy.start(
            grid,
            num_rounds=settings.num_rounds,
            # with client-data='local' the devices learn the data's shape and normalisation
            # from the server (they hold raw pixels, not the dataset)
            train_config=ConfigRecord(data_description(
                bundle.input_shape, bundle.num_classes, bundle.mean, bundle.std)
                if local_data else {}),
            evaluate_fn=lambda rnd, _arrays: (
                MetricRecord(evaluate_predictor(rnd)) if rnd > 0 else None),
        )
    assert strategy.predictor is not None
    save_predictor(strategy.predictor, folder / "predictor.pt")
    results["test"] = {k.removeprefix("test_"): v for k, v in rounds[-1].items() if k != "round"}
    if context.val is not None:
        results["val"] = evaluate(strategy.predictor, context.val.x, context.val.y, device)
    results["num_members"] = [u.num_members for u in strategy.uploads]
    results["clients"] = client_table(strategy.uploads)
    if local_data:  # what the devices present reported of their own data
        results["partition"].update(
            clients=[c["client_id"] for c in results["clients"]],
            sizes=[c["num_examples"] for c in results["clients"]],
            histogram=[c["class_histogram"] for c in results["clients"]])
    results["excluded"] = strategy.exclusions
    results["strategy_report"] = strategy.report()
    results["cost"] = inference_and_traffic(strategy, results["strategy_report"],
                                            settings.num_rounds)
    teacher = strategy.distill_teacher
    if teacher is not None:  # distill: the one network and the predictor it came from
        start = time.perf_counter()
        results["distill"] = distill_results(strategy.distill_report, evaluate(
            teacher, bundle.test.x, bundle.test.y, device, settings.eval_batch_size),
            results["test"])
        eval_seconds[0] += time.perf_counter() - start
    # robust aggregation (fedfusion.core.screening): the claims every strategy weighted
    # by less than claimed, what could not be screened, and the fused model against chance
    results["capped_claims"] = strategy.capped_claims
    weighted = {r["client_id"]: r["capped_to"] for r in strategy.capped_claims}
    for row in results["clients"]:  # num_examples is the claim; this is what counted
        if row["client_id"] in weighted:
            row["num_examples_weighted"] = weighted[row["client_id"]]
    results["screening"] = {"screen_factor": strategy.screen_factor,
                            "curvature_screen_factor": strategy.curvature_screen_factor,
                            "val_screen": strategy.val_screen,
                            "num_examples_cap": strategy.num_examples_cap,
                            "notes": strategy.screen_notes}
    results["chance"] = strategy.chance
    results["at_chance"] = None if strategy.chance is None else strategy.chance["at_chance"]
    # the BatchNorm-statistics rule in force, as in the strategy's report
    results["norm_stats"] = results["strategy_report"]["norm_stats"]
    train_times = [c["train_time_s"] for c in results["clients"]]
    results["timing"] = {
        "client_train_s_sum": float(np.sum(train_times)),
        "client_train_s_max": float(np.max(train_times)) if train_times else 0.0,
        "client_stats_s_sum": float(np.sum([c["stats_time_s"] for c in results["clients"]])),
        "client_round_s": strategy.client_round_seconds,
        "server_fuse_s": strategy.fuse_seconds,
        "server_eval_s": eval_seconds[0],
    }
    # a local-data run used no split: its devices' own files (results["partition"])
    results.update(strategy=strategy.name, dataset=settings.dataset, model=spec.name,
                   partitioner="local" if local_data else settings.partitioner,
                   alpha=None if local_data else settings.alpha,
                   num_clients=settings.num_clients, seed=settings.seed,
                   split_seed=settings.data_seed,
                   num_rounds=settings.num_rounds, device=str(device))


def distill_results(report: dict[str, Any], teacher_test: dict[str, float],
                    student_test: dict[str, float]) -> dict[str, Any]:
    """results.json's ``distill``: the teacher's (the fused predictor) and the student's
    (the one network distilled from it, the run's predictor) test and validation metrics,
    and the distillation's options, selected epoch, seconds and trace."""
    options = report.get("options", {})
    return {"mode": options.get("mode"), "options": options,
            "student_init": report.get("student_init"),
            "selection": report.get("selection"), "best_epoch": report.get("best", {}).get(
                "epoch"), "seconds": report.get("seconds"),
            "teacher": {"test": teacher_test, "val": report.get("teacher_val")},
            "student": {"test": student_test, "val": report.get("student_val")},
            "trace": report.get("trace", [])}


def inference_and_traffic(strategy: FusionStrategy, report: dict[str, Any],
                          num_rounds: int = 1) -> dict[str, Any]:
    """What the predictor costs per prediction and what the run cost per client: forward
    passes (networks run per input), the rounds, and the bytes a client receives (the M
    models of every round, plus FENS' aggregator rounds) and sends (every round, the
    sections and members this strategy uses; a replay's uploads may carry more for other
    strategies)."""
    predictor = strategy.predictor
    model_bytes = _model_bytes(strategy)
    used = [u.members[:1] if strategy.member_fusion == "first" else u.members
            for u in strategy.uploads]
    up = [sum(a.nbytes for m in members for section in strategy.required_sections
              for a in m.get(section, {}).values()) for members in used]
    return {
        "forward_passes": len(predictor.members) if isinstance(predictor, Ensemble) else 1,
        "rounds": int(report.get("rounds", num_rounds)),
        "download_bytes_per_client": num_rounds * strategy.num_members * model_bytes
        + report.get("aggregator_download_bytes_per_client", 0.0),
        "upload_bytes_per_client": num_rounds * (float(np.mean(up)) if up else 0.0)
        + report.get("aggregator_upload_bytes_per_client", 0.0),
    }


def _model_bytes(strategy: FusionStrategy) -> int:
    """Bytes of one broadcast model (the server's architecture, its wire arrays)."""
    return sum(a.nbytes for a in state_arrays(strategy.context.model_spec.build()).values())


def client_table(uploads: Sequence[ClientUpload]) -> list[dict[str, Any]]:
    return [{
        "client_id": u.client_id,
        # who the server knew it as: the Flower node, the id it claimed (a label where the
        # server decided client_id from the node) and how client_id was decided
        "node_id": u.node_id,
        "claimed_client_id": u.claimed_client_id,
        "client_id_source": u.client_id_source,
        "num_examples": u.num_examples,
        "num_members": u.num_members,
        "model": u.model,
        # where it trained and built its upload ("cpu", "cuda:<i>"; None: not reported)
        "device": device_label(u.metrics.get(DEVICE_METRIC)),
        "class_histogram": u.metrics.get("class-histogram"),
        "train_time_s": float(u.metrics.get("train-time-s", 0.0)),
        "stats_time_s": float(u.metrics.get("stats-time-s", 0.0)),
        # the client's data loading, and its whole handling of the train message
        "load_time_s": float(u.metrics.get("load-time-s", 0.0)),
        "client_time_s": float(u.metrics.get("client-time-s", 0.0)),
        "section_time_s": {k.removeprefix("time-s/"): float(v) for k, v in u.metrics.items()
                           if k.startswith("time-s/")},
        "upload_mb": u.nbytes / 1e6,
        # members trained with the contrastive term (absent when it was off)
        **({"contrastive_members": int(u.metrics["contrastive-members"])}
           if "contrastive-members" in u.metrics else {}),
    } for u in uploads]


def print_summary(results: dict[str, Any]) -> None:
    s = results["settings"]
    test = results.get("test", {})
    timing = results.get("timing", {})
    excluded = results.get("excluded") or []
    lines = [
        "=" * 64,
        f"fedfusion {results['status'].upper()}"
        + (" (AT CHANCE)" if results.get("at_chance") else "") + f": strategy {s['strategy']}, "
        f"{(results.get('cost') or {}).get('rounds', s['num-rounds'])} round(s)"
        + (" (replay)" if s.get("replay") else ""),
        f"  data     {s['dataset']}, "
        + ("each device's own data (client-data='local')" if s.get("client-data") == "local"
           else f"partition file {Path(s['partition-file']).name}"
           + (f" [{s['partition-key']}]" if s.get("partition-key") else "")
           if s.get("partition-file") else f"{s['partitioner']} alpha={s['alpha']:g}")
        + f", {clients_line(results)}, seed {s['seed']}",
    ]
    cost = results.get("cost")
    if cost:
        up, down = cost["upload_bytes_per_client"] / 1e6, cost["download_bytes_per_client"] / 1e6
        lines.append(f"  cost     {cost['forward_passes']} forward pass(es) per prediction | "
                     f"{cost['rounds']} round(s) | per client {up:.2f} MB up, {down:.2f} MB "
                     "down")
    blocks = (results.get("strategy_report") or {}).get("curvature_blocks")
    if blocks:  # which parameter got a Kron / diagonal / dense block
        lines.append("  blocks   " + " | ".join(
            f"{kind} {len(names)}" + ("" if kind == "kron" else " (" + ", ".join(names[:3])
                                      + (", ..." if len(names) > 3 else "") + ")")
            for kind, names in blocks.items() if names))
    if test:
        lines.append(f"  test     accuracy {100 * test['accuracy']:.2f}%   NLL {test['nll']:.4f}"
                     f"   ECE {test['ece']:.4f}")
    if "val" in results:
        lines.append(f"  val      accuracy {100 * results['val']['accuracy']:.2f}%")
    distill = results.get("distill")
    if distill:  # the test line above is the student's; both side by side
        for who in ("teacher", "student"):
            metrics = distill[who]["test"]
            lines.append(f"  {who:<8} test accuracy {100 * metrics['accuracy']:.2f}%   NLL "
                         f"{metrics['nll']:.4f}" + (" (the fused predictor)" if who == "teacher"
                                                   else f" (one network, distill="
                                                   f"{distill['mode']!r})"))
    if results.get("at_chance"):
        chance = results["chance"]
        lines.append(f"  WARNING  the fused model is at chance on the validation data: accuracy "
                     f"{100 * chance['accuracy']:.2f}% <= chance {100 * chance['chance']:.2f}% "
                     f"+ margin {100 * chance['margin']:.2f}%")
    norm = results.get("norm_stats")
    if norm:
        lines.append(f"  norm     BatchNorm statistics {norm['rule']!r} ({norm['reason']}): "
                     f"{norm['recalibrated_layers']} of {norm['running_stat_layers']} layer(s) "
                     "re-estimated")
    lines += [f"  capped   {capped_reason(r)}" for r in results.get("capped_claims") or []]
    if "client_train_s_sum" in timing:
        lines.append(f"  time     wall {timing['wall_s']:.1f} s | client training "
                     f"{timing['client_train_s_sum']:.1f} s (sum) | server fuse "
                     f"{timing['server_fuse_s']:.2f} s + eval {timing['server_eval_s']:.2f} s")
    lines.append(f"  excluded {len(excluded)}" + "".join(
        f"\n    - client {e['client']}: {e['reason']}" for e in excluded))
    if results["status"] == "failed":
        lines.append(f"  error    {results.get('error')}")
    lines += [f"  results  {results['output_dir']}/results.json", "=" * 64]
    print("\n".join(lines), flush=True)


def clients_line(results: dict[str, Any]) -> str:
    """"N clients", or for a replay of some of them "K of N clients replayed (...)"."""
    s = results["settings"]
    fused = len(results.get("clients") or [])
    if s.get("replay") and results.get("clients") is not None and fused != s["num-clients"]:
        kept = f", replay-clients={s['replay-clients']}" if s.get("replay-clients") else ""
        return f"{fused} of {s['num-clients']} clients replayed{kept}"
    return f"{s['num-clients']} clients"


def strict_json(value: Any) -> Any:
    """``value`` as strict JSON data: numpy scalars and arrays as numbers and lists, NaN and
    Inf as null (a bare NaN is not JSON), anything else unknown as its string."""
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    if isinstance(value, np.ndarray | np.generic):
        return strict_json(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower entry point."""
    run_server(Settings.from_mapping(context.run_config), grid)
