"""One live round, its uploads replayed into other strategies, a table by inference budget.

``python -m fedfusion.app.compare [--run-config "k=v ..."] [--methods fedavg,ensemble,...]``

The live run goes through ``flwr run`` (:func:`fedfusion.app.launch.launch`) with the run
config given (``strategy`` defaults to FedBEns); every method named in ``--methods`` is then
fused from the same saved uploads (:func:`fedfusion.app.replay.replay`): a strategy name as
``strategy=`` spells it, or ``<strategy>-distilled`` for one network distilled from that
strategy's predictor (``distill='val'``). The table groups the methods by the forward passes
one prediction costs; ``compare.json`` beside the live run's folder holds its rows.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from fedfusion.app.launch import launch, run_config_value
from fedfusion.app.replay import replay

#: the default job's live run (README "Two commands"): FedBEns on 5 clients, M = 2, 5 local
#: epochs (minutes on 2 cores), each client keeping 10% of its rows out of training for FENS
DEFAULT_RUN_CONFIG = "strategy=fedbens num-members=2 local-epochs=5 holdout-fraction=0.1"
#: what the default job replays the uploads into: the lazy answers and the best one-pass
#: method of the leaderboard (benchmarks/docs/leaderboard.md)
DEFAULT_METHODS = ("fedavg", "ensemble", "fens", "fens-distilled")


def method_config(method: str) -> tuple[str, str]:
    """(strategy, extra run config) of a method name."""
    if method.endswith("-distilled"):
        return method.removesuffix("-distilled"), "distill='val'"
    return method, ""


def row(method: str, results: dict[str, Any]) -> dict[str, Any]:
    """A method's line of the table: accuracy, NLL and costs (``results.json``'s)."""
    test, cost = results.get("test", {}), results.get("cost", {})
    return {"method": method, "status": results.get("status"),
            "accuracy": test.get("accuracy"), "nll": test.get("nll"),
            "forward_passes": cost.get("forward_passes"), "rounds": cost.get("rounds"),
            "upload_bytes_per_client": cost.get("upload_bytes_per_client"),
            "download_bytes_per_client": cost.get("download_bytes_per_client"),
            "error": results.get("error")}


def budget(passes: int | None) -> str:
    """The inference-budget group of a predictor of ``passes`` forward passes."""
    return "one network" if (passes or 0) <= 1 else f"{passes} networks"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a text table, by budget (one network first), best first within one."""
    ok = [r for r in rows if r["status"] == "ok"]
    ok.sort(key=lambda r: (r["forward_passes"] or 0, -(r["accuracy"] or 0)))
    lines = ["budget        method                 accuracy    NLL  rounds  MB up / down "
             "per client"]
    for r in ok:
        lines.append(f"{budget(r['forward_passes']):<13} {r['method']:<22} "
                     f"{100 * r['accuracy']:7.2f}% {r['nll']:6.3f}  {r['rounds']:>6}  "
                     f"{r['upload_bytes_per_client'] / 1e6:5.2f} / "
                     f"{r['download_bytes_per_client'] / 1e6:.2f}")
    lines += [f"{r['method']}: FAILED ({r['error']})" for r in rows if r["status"] != "ok"]
    return "\n".join(lines)


def compare(run_config: str = DEFAULT_RUN_CONFIG, methods: tuple[str, ...] = DEFAULT_METHODS
            ) -> list[dict[str, Any]]:
    """The live run, then each method on its uploads; prints and returns the table's rows."""
    if run_config_value(run_config, "save-uploads") == "false":
        raise ValueError("compare replays the live run's uploads: save-uploads must be true")
    live = launch(run_config)
    strategy = live["settings"]["strategy"]
    folder = Path(live["output_dir"])
    rows = [row(strategy, live)]
    for method in methods:
        name, extra = method_config(method)
        print(f"compare: replaying the uploads into {method} ...", flush=True)
        try:
            results = replay(str(folder / "uploads"), name, f"{extra} output-dir="
                             f"'{folder.parent}' run-name='{folder.name}-{method}'")
        except Exception as exc:  # one failed method never loses the others
            results = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row(method, results))
    (folder.parent / f"{folder.name}-compare.json").write_text(json.dumps(rows, indent=1))
    s = live["settings"]
    print("=" * 78 + f"\nfedfusion compare: {s['dataset']}, {s['num-clients']} clients, "
          f"alpha {s['alpha']:g}, M = {s['num-members']}, seed {s['seed']}; one {strategy} "
          "round, its uploads replayed\n" + table(rows) + "\n" + "=" * 78, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-config", default="", help="the live run's overrides (default: "
                        f"{DEFAULT_RUN_CONFIG!r})")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        compare(args.run_config or DEFAULT_RUN_CONFIG,
                tuple(m for m in args.methods.split(",") if m))
    except (RuntimeError, ValueError) as exc:
        print(f"fedfusion.app.compare: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fedfusion.app.compare: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
