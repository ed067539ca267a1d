"""What a CPU-only device needs: the installed size of the ClientApp's runtime dependencies
and the memory of one small client round, per Python environment.

For each ``--python LABEL=INTERPRETER`` it runs, in a fresh process of that interpreter (the
repository on ``PYTHONPATH``, as a SuperNode's ``flwr-clientapp`` imports the App's bundle):

* the size of its site-packages (files' apparent bytes), split into torch, the CUDA
  libraries a CUDA build of torch pulls (``nvidia*``, ``cuda*``, ``triton``) and the rest;
* peak resident memory (``VmHWM``) after importing the ClientApp (``fedfusion.client_app``,
  ``flwr.clientapp``), and after one client round: ``client-data='local'`` on a 1,000-image
  Fashion-MNIST file (``python -m fedfusion.datasets demo``), LeNet, one torch thread,
  ``client-device='auto'``, 1 local epoch, M members, a weights + Kron-curvature upload
  (the compiled Kron fit, so laplace-torch is not needed), encoded as the reply.

The processes are plain Python processes doing the ClientApp's work, not Flower's
``flwr-clientapp`` (which adds its gRPC runtime: ``benchmarks/deploy_client.py`` measures
that one).

Besides, for each ``--wheel PATH``: its size and the CUDA packages its metadata requires;
for each ``--import-check LABEL=INTERPRETER`` (e.g. a venv with torch installed
``--no-deps``): whether ``import torch`` works there, and its error.

    .venv/bin/python benchmarks/cpu_only_device.py --python cuda-build=.venv/bin/python \\
        --python cpu-build=/tmp/venv/bin/python [--members 1 3] [--wheel torch-....whl] \\
        [--import-check no-deps=/tmp/nodeps/bin/python]

Prints one line per run, saves benchmarks/results/cpu_only_device.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "cpu_only_device.json"
SECTIONS = ("weights", "curvature.kron")
#: site-packages entries of a CUDA build of torch that a CPU build does without
CUDA_PREFIXES = ("nvidia", "cuda", "triton")


def _status_kb(key: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(key)))


def site_sizes() -> dict[str, float]:
    """MB of this interpreter's site-packages: torch, the CUDA libraries, the rest."""
    import site

    sizes = {"torch": 0, "cuda_libraries": 0, "rest": 0}
    for root in site.getsitepackages():
        for entry in Path(root).iterdir():
            total = entry.stat().st_size if entry.is_file() else sum(
                f.stat().st_size for f in entry.rglob("*") if f.is_file() and not f.is_symlink())
            name = entry.name.lower()
            key = ("torch" if name == "torch" else "cuda_libraries"
                   if name.startswith(CUDA_PREFIXES) else "rest")
            sizes[key] += total
    return {k: round(v / 2**20, 1) for k, v in sizes.items()}


def client_round(data_path: str, members: int) -> dict[str, Any]:
    """One client round in this process (see the module docstring)."""
    started = time.perf_counter()
    import flwr.clientapp  # noqa: F401
    import numpy as np
    import torch

    from fedfusion.app.client_round import run_client
    from fedfusion.app.config import Settings
    from fedfusion.app.data_description import data_description
    from fedfusion.wire import encode_upload

    imports = {"vmhwm_mb": _status_kb("VmHWM:") / 1024,
               "seconds": time.perf_counter() - started}
    with np.load(data_path) as raw:
        pixels = raw["x"].astype(np.float64) / 255
    config = data_description((1, 28, 28), 10, [float(pixels.mean())], [float(pixels.std())])
    settings = Settings(client_data="local", data_path=data_path, local_epochs=1,
                        num_members=members, client_threads=1)
    started = time.perf_counter()
    upload = run_client(settings, 0, (), SECTIONS, server_config=config)
    encoded = encode_upload(upload)
    return {
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "members": members,
        "samples": upload.num_examples, "sections": list(SECTIONS),
        "device_metric": upload.metrics["cuda-device"],
        "after_imports": imports,
        "after_round_vmhwm_mb": _status_kb("VmHWM:") / 1024,
        "after_round_rss_anon_mb": _status_kb("RssAnon:") / 1024,
        "round_seconds": time.perf_counter() - started,
        "upload_mb": upload.nbytes / 1e6, "records": len(encoded),
    }


def wheel_facts(path: Path) -> dict[str, Any]:
    """A wheel's size and the CUDA packages (``nvidia*``, ``cuda*``, ``triton``) it requires."""
    with zipfile.ZipFile(path) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        lines = wheel.read(meta).decode().splitlines()
    requires = [line.split(":", 1)[1].strip() for line in lines
                if line.startswith("Requires-Dist:")]
    return {"file": path.name, "mb": round(path.stat().st_size / 2**20, 1),
            "cuda_requirements": [r for r in requires if r.lower().startswith(CUDA_PREFIXES)]}


def import_check(python: str) -> dict[str, Any]:
    """Whether ``import torch`` works under ``python``, the last line of its error, and the
    size of its site-packages."""
    done = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True)
    lines = (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()
    return {"imports": done.returncode == 0, "output": lines[-1] if lines else "",
            "site_packages_mb": run_child(python, ["--child-sizes"])}


def run_child(python: str, args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([python, __file__, *args], env=env, check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", default=[], metavar="LABEL=PATH")
    parser.add_argument("--members", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--wheel", action="append", default=[], type=Path)
    parser.add_argument("--import-check", action="append", default=[], metavar="LABEL=PATH")
    parser.add_argument("--child-sizes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-round", nargs=2, metavar=("NPZ", "M"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_sizes:
        print(json.dumps(site_sizes()))
        return
    if args.child_round:
        print(json.dumps(client_round(args.child_round[0], int(args.child_round[1]))))
        return
    envs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "fedfusion.datasets", "demo", tmp, "--devices",
                        "1", "--samples", "1000"], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL)
        data = str(next(Path(tmp).glob("*.npz")))
        for item in args.python:
            label, _, python = item.partition("=")
            envs[label] = {"python": python, "site_packages_mb": run_child(python,
                                                                          ["--child-sizes"])}
            envs[label]["rounds"] = []
            for members in args.members:
                row = run_child(python, ["--child-round", data, str(members)])
                envs[label]["rounds"].append(row)
                print(f"{label}: torch {row['torch']}, M={members}: imports "
                      f"{row['after_imports']['vmhwm_mb']:.0f} MB, round peak "
                      f"{row['after_round_vmhwm_mb']:.0f} MB, {row['round_seconds']:.1f} s; "
                      f"site-packages {envs[label]['site_packages_mb']}", flush=True)
    wheels = [wheel_facts(path) for path in args.wheel]
    checks = {label: import_check(python) for label, _, python in
              (item.partition("=") for item in args.import_check)}
    for label, check in checks.items():
        print(f"{label}: import torch -> {check}")
    OUT.write_text(json.dumps({"load_average": os.getloadavg()[0], "environments": envs,
                               "wheels": wheels, "import_checks": checks}, indent=1))
    print(f"saved {OUT}")


if __name__ == "__main__":
    main()
