"""FedBEns against the temperature T (paper Appendix C.2, Figure 4), replayed from the cached
uploads of ``benchmarks/fedbens.py``: the clients upload the likelihood curvature only, and T
enters on the server (Lambda = H / T + I / sigma^2), so no client retrains.

    .venv/bin/python benchmarks/fedbens_temperature.py [--out outputs/bench-fedbens]

Every live run ``a<alpha>-s<seed>`` under ``--out`` is replayed with each T of
``--temperatures`` (T = 0.1 is the live run itself). Prints test and validation accuracy,
mean +- sd over seeds per (T, alpha), and saves benchmarks/results/fedbens_temperature.json.
Resumable: a finished replay is reused.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from common import REPO
from fedbens import fmt, replay

LIVE_TEMPERATURE = 0.1
RESULTS = REPO / "benchmarks" / "results" / "fedbens_temperature.json"


def live_runs(out: Path) -> list[tuple[float, int, str]]:
    """(alpha, seed, name) of every finished FedBEns live run under ``out``."""
    runs = []
    for folder in sorted(out.iterdir()):
        match = re.fullmatch(r"a([0-9.]+)-s(\d+)", folder.name)
        if match and (folder / "uploads").is_dir() and (folder / "results.json").is_file():
            runs.append((float(match[1]), int(match[2]), folder.name))
    return runs


def accuracies(results: dict) -> dict[str, float]:
    if results.get("status") != "ok":
        return {"test": float("nan"), "val": float("nan")}
    return {"test": results["test"]["accuracy"], "val": results["val"]["accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench-fedbens"))
    parser.add_argument("--temperatures", default="0.01,0.03,0.1,0.3,1.0")
    args = parser.parse_args()
    out = Path(args.out)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    runs = live_runs(out)
    if not runs:
        raise SystemExit(f"no FedBEns live runs (a<alpha>-s<seed>/uploads) under {out}")
    rows = []
    for alpha, seed, name in runs:
        for t in temperatures:
            if t == LIVE_TEMPERATURE:
                results = json.loads((out / name / "results.json").read_text())
            else:
                results = replay(str(out), name, f"T{t:g}", strategy="fedbens", temperature=t)
            rows.append({"alpha": alpha, "seed": seed, "temperature": t,
                         **accuracies(results)})
            print(f"{name} T={t:g}: test {rows[-1]['test']:.4f} val {rows[-1]['val']:.4f}",
                  flush=True)
    RESULTS.write_text(json.dumps({"out": str(out), "rows": rows}, indent=1))
    alphas = sorted({r["alpha"] for r in rows})
    for split in ("test", "val"):
        print(f"\nFedBEns (Kron, M = 5) {split} accuracy (%), mean +- sd over seeds")
        print("| T | " + " | ".join(f"alpha {a:g}" for a in alphas) + " |")
        print("|---|" + "---|" * len(alphas))
        for t in temperatures:
            cells = [fmt([r[split] for r in rows if r["alpha"] == a and r["temperature"] == t])
                     for a in alphas]
            print(f"| {t:g} | " + " | ".join(cells) + " |")
    print(f"saved {RESULTS}")


if __name__ == "__main__":
    main()
