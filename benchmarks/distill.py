"""``distill``: one network out of the ensemble, AMS and FedBEns predictors (one thread).

One in-process live FedAvg run (``InProcessGrid``, no Ray) saves the clients' uploads with
the Kronecker curvature FedBEns needs; each strategy then fuses the SAME uploads once (its
teacher, ``distill='none'``), and :func:`fedfusion.distillation.distil` turns the teacher
into one LeNet from the FedAvg of the uploads, as ``distill='val'`` does in the strategies,
with and without augmentation. One run of the largest epoch budget per row group: with one
seed a run of E epochs is the first E epochs of a longer one (same batches and draws), so
the test accuracy of what ``distill-epochs=E`` returns is that of the best validation epoch
<= E (test accuracy is recorded at each new best validation epoch, never used to
select). Times are CPU seconds of the distillation (``time.process_time``, robust to other
processes on the cores). Prints the rows and saves ``benchmarks/results/distill-*.json``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/distill.py            # 5 clients
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/distill.py --clients 3 --subset 9000 \\
        --local-epochs 2 --val-size 300                                 # conftest's split
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from common import REPO

from fedfusion.app.config import Settings, build_strategy, default_model  # noqa: E402
from fedfusion.app.federation import federated_split  # noqa: E402
from fedfusion.app.inprocess import InProcessGrid  # noqa: E402
from fedfusion.core.architecture import ModelSpec  # noqa: E402
from fedfusion.core.evaluation import evaluate  # noqa: E402
from fedfusion.distillation import distil  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402
from fedfusion.upload_store import load_uploads  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--subset", type=int, default=10000)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--val-size", type=int, default=500)
    parser.add_argument("--strategies", default="ensemble,ams,fedbens")
    parser.add_argument("--epochs", default="0,5,10,20,30,40")
    parser.add_argument("--augment", default="none,shift,mixup,shift+mixup")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--mode", default="val", choices=("val", "synthetic"),
                        help="synthetic: DENSE's generator (--augment does not apply)")
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-distill"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    name = f"c{args.clients}-n{args.subset}-e{args.local_epochs}-a{args.alpha:g}"
    settings = Settings(strategy="fedavg", num_clients=args.clients, train_subset=args.subset,
                        local_epochs=args.local_epochs, alpha=args.alpha,
                        val_size=args.val_size, extra_sections="curvature.kron",
                        output_dir=args.out, run_name=name, server_threads=1)
    folder = Path(args.out) / name
    if not (folder / "results.json").is_file() or json.loads(
            (folder / "results.json").read_text())["status"] != "ok":
        run_server(settings, InProcessGrid(settings))
    live = json.loads((folder / "results.json").read_text())
    _, uploads, _ = load_uploads(str(folder / "uploads"))
    bundle = federated_split(settings).bundle
    spec = ModelSpec(default_model(settings, bundle.input_shape), bundle.input_shape,
                     bundle.num_classes)
    rows = []
    for strategy_name in args.strategies.split(","):
        strategy = build_strategy(settings.replace(strategy=strategy_name), spec, bundle.val)
        start = time.perf_counter()
        teacher = strategy.fuse_uploads(uploads)
        fuse_s = time.perf_counter() - start
        teacher_test = evaluate(teacher, bundle.test.x, bundle.test.y)
        for augment in args.augment.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                budgets = [int(e) for e in args.epochs.split(",")]
                options = dataclasses.replace(
                    strategy.distill_options, mode=args.mode, epochs=max(budgets), seed=seed,
                    augment=augment != "none", shift="shift" in augment,
                    mixup=0.5 if "mixup" in augment else 0.0)
                tests: dict[int, dict[str, float]] = {}
                record: list[tuple[float, float]] = []

                def on_epoch(entry, student, tests=tests, record=record):
                    # only a new best on validation can be what a budget returns
                    key = (entry["val_accuracy"], -entry["val_nll"])
                    if not record or key > record[0]:
                        record[:] = [key]
                        tests[entry["epoch"]] = evaluate(student, bundle.test.x, bundle.test.y)
                        student.train()

                result = distil(teacher, _fedavg_start(spec, uploads), bundle.val, options,
                                on_epoch=on_epoch)
                trace = result.report["trace"]
                per_epoch = result.report["cpu_seconds"] / max(budgets)
                for budget in budgets:
                    # what distill-epochs=budget returns: the best validation epoch <= budget
                    best = max(trace[:budget + 1],
                               key=lambda e: (e["val_accuracy"], -e["val_nll"]))
                    test = tests[best["epoch"]]
                    rows.append({
                        "strategy": strategy_name, "mode": args.mode, "augment": augment,
                        "seed": seed,
                        "epochs": budget, "fuse_s": fuse_s,
                        "teacher_test_acc": teacher_test["accuracy"],
                        "teacher_test_nll": teacher_test["nll"],
                        "student_test_acc": test["accuracy"], "student_test_nll": test["nll"],
                        "teacher_val_acc": result.report["teacher_val"]["accuracy"],
                        "student_val_acc": best["val_accuracy"], "best_epoch": best["epoch"],
                        "distill_cpu_s": per_epoch * budget,
                        "fedavg_test_acc": live["test"]["accuracy"],
                        "fedavg_test_nll": live["test"]["nll"]})
                    r = rows[-1]
                    print(f"{strategy_name:9s} {augment:12s} seed {seed} epochs {budget:3d}: "
                          f"teacher {100 * r['teacher_test_acc']:.2f} student "
                          f"{100 * r['student_test_acc']:.2f} (val {100 * r['student_val_acc']:.2f}"
                          f", best epoch {r['best_epoch']}) FedAvg "
                          f"{100 * r['fedavg_test_acc']:.2f}  {r['distill_cpu_s']:.1f} CPU s",
                          flush=True)
    tag = args.strategies.replace(",", "-") + ("-synthetic" if args.mode == "synthetic" else "")
    out = REPO / "benchmarks" / "results" / f"distill-{name}-{tag}.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"saved {out}")


def _fedavg_start(spec, uploads):
    from fedfusion.core.state import weighted_average

    return spec.build(weighted_average([u.weights(0) for u in uploads],
                                       [u.num_examples for u in uploads]))


if __name__ == "__main__":
    main()
