"""fedfusion ServerApp: build the strategy from the run config, run it (or replay cached
uploads into it), evaluate the global predictor, print a summary and save the results.

Outputs of a run, in ``<output-dir>/<run-name>/``:

* ``results.json``: settings, test/validation metrics, per-round metrics, per-client
  histogram, training time and upload size, excluded clients with reasons, timings;
* ``predictor.pt``: the global predictor (:func:`fedfusion.load_predictor`);
* ``uploads/``: the clients' uploads of a one-shot run (replay them with ``replay=...``).

The strategy's own account (clients, exclusions, report, cost, screening, timing) is the
value :meth:`~fedfusion.core.fusion.Fusion.diagnostics` returns; this module adds the
App's evaluation and settings, and :mod:`fedfusion.app.output` writes the file.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedfusion import setup_logging
from fedfusion.app.config import (
    DATA_KEYS,
    ConfigError,
    Settings,
    build_strategy,
    default_model,
    resolved_holdout,
)
from fedfusion.app.data_description import data_description
from fedfusion.app.federation import federated_split
from fedfusion.app.inprocess import InProcessGrid
from fedfusion.app.output import output_folder, write_results
from fedfusion.app.summary import print_histogram, print_summary
from fedfusion.core.architecture import ModelSpec
from fedfusion.core.evaluation import evaluate
from fedfusion.core.predictors import save_predictor
from fedfusion.datasets import load_dataset
from fedfusion.device import present_device
from fedfusion.strategies import FENS
from fedfusion.upload_store import UploadWriter, load_uploads
from fedfusion.wire import ClientUpload

log = logging.getLogger("fedfusion")

#: where the partition file is: adopted from the manifest unless the run config names one
#: (the file may live elsewhere on this machine; partition-sha256 still has to match)
PARTITION_KEYS = ("partition-file", "partition-key")

app = ServerApp()


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
    device = present_device(settings.server_device, "run-config server-device")
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
    results["excluded"] = strategy.exclusions  # the live list: kept even if the run fails
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
    teacher = strategy.distill_teacher
    if teacher is not None:  # distill: the one network and the predictor it came from
        start = time.perf_counter()
        results["distill"] = distill_results(strategy.distill_report, evaluate(
            teacher, bundle.test.x, bundle.test.y, device, settings.eval_batch_size),
            results["test"])
        eval_seconds[0] += time.perf_counter() - start
    # the strategy's own account: clients, exclusions, its report, cost, robust aggregation
    # (fedfusion.core.screening), the fused model against chance, its timing
    diagnostics = strategy.diagnostics(settings.num_rounds)
    timing = diagnostics.pop("timing")
    results.update(diagnostics)
    results["timing"] = {**timing, "server_eval_s": eval_seconds[0]}
    if local_data:  # what the devices present reported of their own data
        results["partition"].update(
            clients=[c["client_id"] for c in results["clients"]],
            sizes=[c["num_examples"] for c in results["clients"]],
            histogram=[c["class_histogram"] for c in results["clients"]])
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
            "student_init_val": report.get("student_init_val", {}),
            "selection": report.get("selection"), "best_epoch": report.get("best", {}).get(
                "epoch"), "seconds": report.get("seconds"),
            "teacher": {"test": teacher_test, "val": report.get("teacher_val")},
            "student": {"test": student_test, "val": report.get("student_val")},
            "trace": report.get("trace", [])}


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower entry point."""
    run_server(Settings.from_mapping(context.run_config), grid)
