"""A ResNet of real size through FedBEns with Kron curvature.

``resnet20`` with ``width=2`` (1.09 M parameters on 1x28x28, BatchNorm after every
convolution: Kron blocks for the 22 Linear/Conv2d parameters, diagonal blocks for the 38
BatchNorm ones) on Fashion-MNIST: C = 5 clients (Dirichlet alpha = 0.4, seed 0) of
``--rows`` training rows each, M = 3 members, ``--epochs`` of SGD, 500 server validation rows.
Every member is fitted once (full Kron factors); the upload is then measured for each
``curvature_rank`` r of ``--ranks`` (0 = every eigenpair; r = the top r per factor) and the
FedBEns server is run on each, in a fresh process whose peak memory is read from its own
``VmHWM`` (not ``ru_maxrss``: Linux carries that across ``exec``, so a spawned child reports
the larger of its own peak and its parent's, here the clients' Kron fits). Targets: upload
per member at most 4x the weights, server peak at most 4 GB. Accuracy here is of a short
training (the point is the cost), with FedAvg and the uniform ensemble of the same uploads
beside it.

    .venv/bin/python benchmarks/real_size.py --rows 200 --epochs 1 --server-ranks 64 \
        --server-steps 20
    .venv/bin/python benchmarks/real_size.py            # servers at ranks 128 and 64

``--cache DIR`` keeps the full-rank uploads (about 30 min of client work on 2 cores) and
reuses them on the next run with the same ``--rows``/``--epochs``.

Prints a table and writes benchmarks/results/real_size.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import own_peak_bytes  # noqa: E402

from fedfusion import client, evaluate  # noqa: E402
from fedfusion.core.architecture import ModelSpec  # noqa: E402
from fedfusion.curvature import KronCurvature, curvature_from_arrays  # noqa: E402
from fedfusion.datasets import load_dataset  # noqa: E402
from fedfusion.datasets.partition import partition_indices  # noqa: E402
from fedfusion.strategies import FedAvg, FedBEns, UniformEnsemble  # noqa: E402
from fedfusion.training import TrainConfig, train_local  # noqa: E402
from fedfusion.upload_store import load_uploads, save_uploads  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "real_size.json"
SPEC = ModelSpec("resnet20", (1, 28, 28), 10, {"width": 2})
CLIENTS, MEMBERS = 5, 3


def client_uploads(rows: int, epochs: int) -> tuple[list, dict]:
    """Train C x M members; each member's upload with full Kron factors, and the timings."""
    bundle = load_dataset("fmnist", val_size=500, seed=0)
    parts = partition_indices(bundle.train.y.numpy(), "dirichlet", CLIENTS, 0, alpha=0.4)
    inits = FedAvg(SPEC, num_members=MEMBERS, seed=0).initial_models()
    uploads, train_s, fit_s = [], 0.0, 0.0
    for c, part in enumerate(parts):
        index = torch.as_tensor(np.asarray(part)[:rows])
        x, y = bundle.train.x[index], bundle.train.y[index]
        members = []
        for m, init in enumerate(inits):
            model = SPEC.build(init)
            start = time.perf_counter()
            train_local(model, x, y, TrainConfig(epochs=epochs, lr=0.05, batch_size=64),
                        seed=100 * c + m)
            train_s += time.perf_counter() - start
            members.append(model)
        start = time.perf_counter()
        uploads.append(client.make_upload(members, x, y, ["weights", "curvature.kron"],
                                          client_id=c, model_name=SPEC.name,
                                          model_kwargs=SPEC.kwargs))
        fit_s += time.perf_counter() - start
        print(f"client {c}: {len(y)} rows, trained and fitted", flush=True)
    return uploads, {"train_s_per_member": train_s / (CLIENTS * MEMBERS),
                     "kron_fit_s_per_member": fit_s / (CLIENTS * MEMBERS)}


def truncate(uploads: list, rank: int) -> list:
    """The same uploads with every Kron factor cut to its top ``rank`` eigenpairs."""
    layout = SPEC.param_shapes()
    for upload in uploads:
        for member in upload.members:
            kron = curvature_from_arrays("kron", member["curvature.kron"], layout, 1.0, 1.0)
            assert isinstance(kron, KronCurvature)
            member["curvature.kron"] = kron.to_arrays(rank=rank or None)
    return uploads


def cached_client_uploads(cache: str | None, rows: int, epochs: int) -> tuple[list, dict]:
    """:func:`client_uploads`, read from ``cache`` when it holds uploads of the same
    ``rows``/``epochs`` (written there otherwise)."""
    info_file = Path(cache) / "timing.json" if cache else None
    if info_file is not None and info_file.is_file():
        info = json.loads(info_file.read_text())
        if (info["rows"], info["epochs"]) == (rows, epochs):
            _, uploads, _ = load_uploads(cache, strict=True)
            print(f"reusing the uploads in {cache}", flush=True)
            return uploads, info
    uploads, info = client_uploads(rows, epochs)
    if info_file is not None:
        save_uploads(cache, uploads, {})
        info_file.write_text(json.dumps({"rows": rows, "epochs": epochs, **info}))
    return uploads, info


def server(folder: str, steps: int, queue: multiprocessing.Queue) -> None:
    """FedBEns (``steps`` Adam steps per mode), FedAvg and the ensemble on the saved uploads,
    in a fresh process."""
    torch.set_num_threads(2)
    bundle = load_dataset("fmnist", val_size=500, seed=0)
    _, uploads, failures = load_uploads(folder)
    assert not failures, failures
    val, test = (bundle.val.x, bundle.val.y), bundle.test
    start = time.perf_counter()
    fedbens = FedBEns(SPEC, num_members=MEMBERS, val=val, steps=steps,
                      eval_every=max(1, min(30, steps // 2))).fuse_uploads(uploads)
    server_s = time.perf_counter() - start
    peak = own_peak_bytes()
    row = {"server_s": server_s, "server_steps": steps, "server_peak_bytes": peak,
           "fedbens": evaluate(fedbens, test.x, test.y)}
    for name, cls in (("fedavg", FedAvg), ("ensemble", UniformEnsemble)):
        row[name] = evaluate(cls(SPEC, num_members=MEMBERS, val=val).fuse_uploads(uploads),
                             test.x, test.y)
    queue.put(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1200, help="training rows per client (cap)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ranks", default="0,128,64", help="curvature_rank values to measure")
    parser.add_argument("--server-ranks", default="128,64",
                        help="the ranks whose uploads the FedBEns server also fuses (the full "
                             "factors cost the server many minutes per step on 2 cores)")
    parser.add_argument("--server-steps", type=int, default=300,
                        help="FedBEns Adam steps per mode (fewer: the same peak memory, which "
                             "the mixture's factors set, in less time)")
    parser.add_argument("--cache", help="a folder keeping the full-rank uploads between runs")
    args = parser.parse_args()
    torch.set_num_threads(2)
    params = sum(int(np.prod(s)) for s in SPEC.param_shapes().parameter_shapes().values())
    print(f"{SPEC.name} {SPEC.kwargs}: {params:,} parameters", flush=True)
    uploads, info = cached_client_uploads(args.cache, args.rows, args.epochs)
    weight_bytes = np.mean([sum(a.nbytes for a in m["weights"].values())
                            for u in uploads for m in u.members])
    rows = []
    for rank in (int(r) for r in args.ranks.split(",")):
        truncated = truncate(uploads, rank)
        member_bytes = np.mean([sum(a.nbytes for s in m.values() for a in s.values())
                                for u in truncated for m in u.members])
        row: dict = {}
        if str(rank) in args.server_ranks.split(","):
            with tempfile.TemporaryDirectory() as folder:
                save_uploads(folder, truncated, {})
                queue: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
                process = multiprocessing.get_context("spawn").Process(
                    target=server, args=(folder, args.server_steps, queue))
                process.start()
                row = queue.get()
                process.join()
        row.update(rank=rank, upload_mb_per_member=member_bytes / 1e6,
                   weights_mb=weight_bytes / 1e6, upload_over_weights=member_bytes / weight_bytes)
        rows.append(row)
        print(f"rank {rank or 'all'}: upload {row['upload_mb_per_member']:.2f} MB per member "
              f"({row['upload_over_weights']:.2f}x the weights)" + (
                  f", server {row['server_s']:.1f} s, peak "
                  f"{row['server_peak_bytes'] / 2**30:.2f} GiB, FedBEns "
                  f"{row['fedbens']['accuracy']:.4f}" if "server_s" in row else
                  " (server not run)"), flush=True)
    result = {"model": SPEC.to_dict(), "parameters": params, "clients": CLIENTS,
              "server_steps": args.server_steps,
              "members": MEMBERS, "rows_per_client": args.rows, "epochs": args.epochs,
              "train_s_per_member": info["train_s_per_member"],
              "kron_fit_s_per_member": info["kron_fit_s_per_member"], "rows": rows}
    RESULTS.write_text(json.dumps(result, indent=1))
    print("\n| rank | upload MB / member | x weights | server s | server peak GiB | FedBEns | "
          "FedAvg | ensemble |\n|---|---|---|---|---|---|---|---|")
    for row in rows:
        cells = (f"{row['server_s']:.1f} | {row['server_peak_bytes'] / 2**30:.2f} | "
                  f"{100 * row['fedbens']['accuracy']:.2f} | "
                  f"{100 * row['fedavg']['accuracy']:.2f} | "
                  f"{100 * row['ensemble']['accuracy']:.2f}" if "server_s" in row
                  else "not run | - | - | - | -")
        print(f"| {row['rank'] or 'all'} | {row['upload_mb_per_member']:.2f} | "
              f"{row['upload_over_weights']:.2f} | {cells} |")
    print(f"training {info['train_s_per_member']:.1f} s and Kron fit "
          f"{info['kron_fit_s_per_member']:.1f} s per member; saved {RESULTS}")


if __name__ == "__main__":
    main()
