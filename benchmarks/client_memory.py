"""Peak memory and time of one client's upload: ``fedfusion.client.make_upload`` of M = 3
members on N Fashion-MNIST images, one fresh process per case.

Each case runs in its own interpreter (``python client_memory.py --case ...``), which imports
torch and fedfusion, reads the first N images of the FMNIST test file (the 10,000-row file,
so the data read is small whatever N), builds M untrained members of a zoo model (seeded;
BatchNorm running statistics at their initial values), then calls ``make_upload`` with
``weights`` and one extra section (``curvature.kron``, ``curvature.diag`` or ``gram``) with
the library's defaults. It reports the process's own ``VmHWM`` (peak resident set, read from
``/proc/self/status``; shared libraries included) right after the imports and after the
upload, and the wall time of ``make_upload``. ``token_transformer`` gets int64 tokens of
shape (64,): the images average-pooled to 8 x 8 and quantised to its 17-token vocabulary.

    PYTHONPATH=.:benchmarks OMP_NUM_THREADS=1 .venv/bin/python benchmarks/client_memory.py
    ... --quick     # resnet20 Kron at N = 1,200 and 6,000 only

Writes benchmarks/results/client_memory.json (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "client_memory.json"
FMNIST = Path("/usr/share/datasets/fashion-mnist")
MEMBERS = 3
SECTIONS = {"kron": "curvature.kron", "diag": "curvature.diag", "gram": "gram"}


def _peak_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("VmHWM:"))) / 1024


def run_case(model_name: str, rows: int, section: str, accelerate: bool) -> dict:
    """One case in this process (which must be fresh): the numbers as a dict."""
    import torch  # noqa: F401  (measured with the imports)

    import fedfusion  # noqa: F401
    from fedfusion import client

    after_import = _peak_mb()
    torch.set_num_threads(1)
    from fedfusion.datasets.loading import read_idx
    from fedfusion.models import build_model

    images = torch.from_numpy(read_idx(FMNIST / "t10k-images-idx3-ubyte.gz")[:rows].copy())
    labels = torch.from_numpy(read_idx(FMNIST / "t10k-labels-idx1-ubyte.gz")[:rows].copy())
    if len(images) < rows:
        raise SystemExit(f"the FMNIST test file has only {len(images)} rows")
    x = ((images.float() / 255 - 0.286) / 0.353).unsqueeze(1)
    if model_name == "token_transformer":
        pooled = torch.nn.functional.adaptive_avg_pool2d(images.float().unsqueeze(1), 8)
        x, shape = (pooled / 255 * 16).round().long().reshape(rows, 64), (64,)
    else:
        shape = (1, 28, 28)
    y = labels.long()
    torch.manual_seed(0)
    members = [build_model(model_name, shape, 10) for _ in range(MEMBERS)]
    before = _peak_mb()
    start, cpu = time.perf_counter(), time.process_time()
    upload = client.make_upload(members, x, y, ["weights", SECTIONS[section]],
                                accelerate=accelerate)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert len(upload.members) == MEMBERS
    return {"model": model_name, "rows": rows, "section": section, "accelerate": accelerate,
            "params": sum(p.numel() for p in members[0].parameters()),
            "import_peak_mb": round(after_import, 1), "before_upload_peak_mb": round(before, 1),
            "peak_mb": round(_peak_mb(), 1), "seconds": round(seconds, 2),
            "cpu_seconds": round(cpu, 2)}


def spawn(model_name: str, rows: int, section: str, accelerate: bool) -> dict:
    """:func:`run_case` in a fresh interpreter (one torch thread)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, __file__, "--case", model_name, str(rows), section,
           str(int(accelerate))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"model": model_name, "rows": rows, "section": section, "accelerate": accelerate,
                "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def cases(quick: bool) -> list[tuple[str, int, str, bool]]:
    from fedfusion.models import available_models

    plan = [("resnet20", 1200, "kron", False), ("resnet20", 6000, "kron", False)]
    if quick:
        return plan
    plan += [("resnet20", 1200, "kron", True), ("resnet20", 1200, "diag", False),
             ("resnet20", 6000, "diag", False), ("resnet20", 1200, "gram", False),
             ("resnet20", 6000, "gram", False)]
    plan += [(name, 1200, section, False) for name in available_models() if name != "resnet20"
             for section in SECTIONS]
    return plan


def table(rows: list[dict]) -> str:
    lines = ["| model | params | section | N | import peak MB | peak MB | make_upload s (CPU s) |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        section = r["section"] + (" (accelerate)" if r["accelerate"] else "")
        if "error" in r:
            lines.append(f"| {r['model']} | | {section} | {r['rows']} | | error: "
                         f"{' '.join(r['error'])[:80]} | |")
            continue
        lines.append(f"| {r['model']} | {r['params']:,} | {section} | {r['rows']:,} | "
                     f"{r['import_peak_mb']:.0f} | {r['peak_mb']:.0f} | {r['seconds']:.1f} "
                     f"({r['cpu_seconds']:.1f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=4, metavar=("MODEL", "ROWS", "SECTION", "ACCEL"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only the cases of these models")
    parser.add_argument("--sections", nargs="*", default=None, choices=sorted(SECTIONS),
                        help="run only the cases of these sections")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.case:
        model_name, rows, section, accel = args.case
        print(json.dumps(run_case(model_name, int(rows), section, bool(int(accel)))))
        return
    sys.path.insert(0, str(REPO))
    rows = []
    for case in cases(args.quick):
        if args.only is not None and case[0] not in args.only:
            continue
        if args.sections is not None and case[2] not in args.sections:
            continue
        rows.append(spawn(*case))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"members": MEMBERS, "torch_threads": 1,
                                          "load_before": os.getloadavg(), "cases": rows},
                                         indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
