"""Accuracy cost of compressing the Kron upload: float16 eigenvectors and top-r
eigenpairs per factor, applied to cached uploads exactly as a client would before sending.

    .venv/bin/python benchmarks/fedbens_compression.py outputs/bench-fedbens/a0.1-s0/uploads

Writes a compressed copy of the upload folder per variant, replays FedBEns on each, prints a
table (upload MB per client, test accuracy) and saves benchmarks/results/fedbens_compression.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedfusion.app.config import Settings  # noqa: E402
from fedfusion.core.predictors import ModelSpec  # noqa: E402
from fedfusion.curvature import KronCurvature  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402
from fedfusion.upload_store import load_uploads, save_uploads  # noqa: E402

VARIANTS = {"float32 (exact)": {}, "float16 eigvecs": {"eigvec_dtype": np.float16},
            "rank 32": {"rank": 32}, "rank 16": {"rank": 16},
            "rank 16 + float16": {"rank": 16, "eigvec_dtype": np.float16}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("uploads")
    args = parser.parse_args()
    run_config, uploads, _ = load_uploads(args.uploads, strict=True)
    out = Path(args.uploads).parent / "compression"
    spec = ModelSpec(run_config["model"] or "lenet", (1, 28, 28), 10)
    shapes = dict(spec.param_shapes())
    exact = [[KronCurvature.from_arrays(m["curvature.kron"], shapes, 1.0, 1.0)
              for m in u.members] for u in uploads]
    rows = []
    for label, options in VARIANTS.items():
        for upload, krons in zip(uploads, exact, strict=True):
            for member, kron in zip(upload.members, krons, strict=True):
                member["curvature.kron"] = kron.to_arrays(**options)
        folder = out / label.replace(" ", "_").replace("(", "").replace(")", "")
        save_uploads(folder, uploads, run_config)
        result = run_server(Settings(strategy="fedbens", replay=str(folder),
                                     fedbens_starts="median",
                                     output_dir=str(out), run_name=f"replay-{folder.name}",
                                     server_threads=1))
        mb = np.mean([sum(a.nbytes for m in u.members for a in m["curvature.kron"].values())
                      for u in uploads]) / 1e6
        rows.append({"variant": label, "kron_mb_per_client": mb,
                     "accuracy": result["test"]["accuracy"], "nll": result["test"]["nll"]})
    print("\n| Kron upload | Kron MB / client | FedBEns test acc | NLL |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['kron_mb_per_client']:.2f} | {100 * r['accuracy']:.2f}% "
              f"| {r['nll']:.4f} |")
    path = REPO / "benchmarks" / "results" / "fedbens_compression.json"
    path.write_text(json.dumps({"uploads": args.uploads, "rows": rows}, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
