"""Does the client's curvature backend change FedBEns' accuracy?

The default Kron backend (``asdl_mc``, a one-sample Monte-Carlo Fisher K-FAC) was chosen for
its fit time and its fidelity to the exact GGN K-FAC on one member. This script checks the
end result instead: it refits the Kron curvature of every member of a cached FedBEns run
with another laplace-torch backend (default ``asdl_ggn``, the exact GGN K-FAC that the
reference code uses) on the same client data and the same trained weights, saves those
uploads next to the originals, and replays FedBEns on both (with and without the server
validation set). Weights, partitions and server settings are identical; only the curvature
differs.

    .venv/bin/python benchmarks/fedbens_backend_check.py outputs/bench-fedbens/a0.05-s0/uploads

Prints a table and merges its rows into benchmarks/results/fedbens_backend_check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedfusion.app.client_round import section_options  # noqa: E402
from fedfusion.app.config import Settings, default_model  # noqa: E402
from fedfusion.app.federation import federated_split  # noqa: E402
from fedfusion.core.predictors import ModelSpec  # noqa: E402
from fedfusion.sections import SectionOptions, build_section  # noqa: E402
from fedfusion.server_app import run_server  # noqa: E402
from fedfusion.upload_store import load_uploads, save_uploads  # noqa: E402
from fedfusion.wire import WEIGHTS  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "fedbens_backend_check.json"
SECTION = "curvature.kron"


def refit(uploads_dir: Path, backend: str, out: Path) -> float:
    """Write ``out`` = the uploads with every member's Kron curvature refitted by ``backend``;
    return the mean fit seconds per member."""
    run_config, uploads, _ = load_uploads(uploads_dir, strict=True)
    settings = Settings.from_mapping(run_config).replace(curvature_backend=backend)
    split = federated_split(settings)
    bundle = split.bundle
    spec = ModelSpec(default_model(settings, bundle.input_shape), bundle.input_shape,
                     bundle.num_classes, settings.parsed_model_kwargs())
    options = SectionOptions(**section_options(settings))
    seconds = []
    for upload in uploads:
        x, y = split.client_data(upload.client_id)
        for m, member in enumerate(upload.members):
            start = time.perf_counter()
            member[SECTION] = build_section(SECTION, spec.build(member[WEIGHTS]), x, y, options)
            seconds.append(time.perf_counter() - start)
            print(f"client {upload.client_id} member {m + 1}/{upload.num_members}: {backend} "
                  f"fit {seconds[-1]:.1f} s ({len(y)} samples)", flush=True)
    save_uploads(out, uploads, {**run_config, "curvature-backend": backend})
    return sum(seconds) / len(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("uploads", type=Path)
    parser.add_argument("--backend", default="asdl_ggn")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = args.uploads.resolve().parent
    refitted = run / f"uploads-{args.backend}"
    fit_s = refit(args.uploads, args.backend, refitted)
    original = load_uploads(args.uploads)[0].get("curvature-backend") or "asdl_mc (default)"
    rows = []
    for label, folder, fit in ((original, args.uploads, None), (args.backend, refitted, fit_s)):
        accuracy = {}
        for validation in (True, False):
            tag = f"{folder.name}-{'val' if validation else 'noval'}"
            result = run_server(Settings(strategy="fedbens", replay=str(folder),
                                         fedbens_starts="median",
                                         server_validation=validation, server_threads=1,
                                         output_dir=str(run / "backend-check"), run_name=tag))
            accuracy["validation" if validation else "no_validation"] = result["test"]["accuracy"]
        rows.append({"run": run.name, "backend": label, "fit_s_per_member": fit, **accuracy})
    print(f"\nFedBEns (Kron, M=5) on the cached run {run.name}: curvature backend")
    print("| backend | fit s / member | test acc (validation) | test acc (no validation) |")
    print("|---|---|---|---|")
    for r in rows:
        fit = "-" if r["fit_s_per_member"] is None else f"{r['fit_s_per_member']:.1f}"
        print(f"| {r['backend']} | {fit} | {100 * r['validation']:.2f}% "
              f"| {100 * r['no_validation']:.2f}% |")
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    saved = [s for s in saved if (s["run"], s["backend"]) not in {(r["run"], r["backend"])
                                                                 for r in rows}]
    RESULTS.write_text(json.dumps(saved + rows, indent=1))
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
