"""Shared by the benchmark scripts: run a live simulation once, reuse its results after."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedfusion.app.launch import launch  # noqa: E402

#: the paper's starts (Algorithm 1: M runs from the per-member medians)
PAPER_STARTS = "fedbens-starts='median'"
#: the paper's algorithm: its starts, every run taking all its steps (no early stop) and the
#: ensemble of the modes as the prediction; the benchmarks that reproduce the paper pin it,
#: so their numbers keep that meaning whatever the defaults
PAPER_ALGORITHM = f"{PAPER_STARTS} server-patience=0 fedbens-prediction='modes'"


def finished_run(out: str, name: str) -> dict | None:
    """The results of run ``name`` under ``out`` if it finished ("ok"), else None."""
    done = Path(out) / name / "results.json"
    if done.is_file():
        results = json.loads(done.read_text())
        if results.get("status") == "ok":
            print(f"reusing {done}")
            return results
    return None


def live_run(run_config: str, out: str, name: str,
             federation: dict[str, float] | None = None) -> dict:
    """``launch`` a run named ``name`` under ``out``, unless it already finished there
    (``federation``: simulation overrides, e.g. the clients' GPU share)."""
    done = finished_run(out, name)
    if done is not None:
        return done
    return launch(f"{run_config} output-dir='{out}' run-name={name}", federation=federation)


def live_run_in_process(run_config: str, out: str, name: str) -> dict:
    """:func:`live_run` without Flower's processes: the App's own ClientApp in this process
    (``InProcessGrid``), one client after another; the same results.json."""
    import shlex

    from fedfusion.app.config import Settings
    from fedfusion.app.inprocess import InProcessGrid
    from fedfusion.server_app import run_server

    done = finished_run(out, name)
    if done is not None:
        return done
    def value(text: str) -> object:  # as flwr run reads it: numbers and booleans typed
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    mapping = {k: value(v) for k, v in (item.split("=", 1) for item in shlex.split(run_config))}
    settings = Settings.from_mapping({**mapping, "output-dir": out, "run-name": name})
    return run_server(settings, InProcessGrid(settings))


def kron_fit_s(clients: list[dict]) -> float:
    """The clients' Kron fits of a results.json's ``clients`` table, summed (seconds)."""
    return sum(c["section_time_s"].get("curvature.kron", 0.0) for c in clients)


def own_peak_bytes() -> int:
    """This process's peak resident set (Linux ``VmHWM``: its own address space only; not
    ``ru_maxrss``, which Linux carries across ``exec`` from the parent)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("VmHWM:"))) * 1024


def cell(values: list[float], paper: float | None = None) -> str:
    """``mean +- sd (n)``, then the paper's value in brackets and our difference to it."""
    if not values:
        return "-"
    mean = statistics.mean(values)
    sd = f" +- {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    text = f"{mean:.2f}{sd} ({len(values)})"
    if paper is not None:
        text += f" [{paper:.2f}] {mean - paper:+.2f}"
    return text


def section_mb(uploads_dir: str) -> dict[str, float]:
    """Mean upload MB per member (over every client's members), per section."""
    from fedfusion.upload_store import load_uploads

    _, uploads, _ = load_uploads(uploads_dir, strict=True)
    sizes: dict[str, list[float]] = {}
    for upload in uploads:
        for member in upload.members:
            for section, arrays in member.items():
                sizes.setdefault(section, []).append(
                    sum(a.nbytes for a in arrays.values()) / 1e6)
    return {s: statistics.mean(v) for s, v in sizes.items()}


def wait_for_live(out: str, name: str, poll_s: float = 10.0) -> dict:
    """The results of live run ``name`` once the live stage has written them (or its
    ``<name>.live-error`` marker, where the live stage records a launch that failed)."""
    done, failed = Path(out) / name / "results.json", Path(out) / f"{name}.live-error"
    print(f"waiting for the live run {name} ...", flush=True)
    while True:
        if failed.is_file():
            return {"status": "failed", "error": failed.read_text()}
        if done.is_file():
            try:
                results = json.loads(done.read_text())
            except json.JSONDecodeError:  # being written
                results = {}
            if results.get("status") in ("ok", "failed"):
                return results
        time.sleep(poll_s)
