"""What the ServerApp prints: the clients' class histogram before a run, and the summary of
its results.json after."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fedfusion.app.federation import FederatedSplit
from fedfusion.core.screening import capped_reason

log = logging.getLogger("fedfusion")


def print_histogram(split: FederatedSplit) -> None:
    hist = split.histogram
    header = "client " + " ".join(f"{k:>6d}" for k in range(hist.shape[1])) + "   total"
    lines = [header] + [
        f"{c:>6d} " + " ".join(f"{v:>6d}" for v in row) + f" {row.sum():>7d}"
        for c, row in enumerate(hist)
    ]
    log.info("class histogram per client (columns: classes)\n%s", "\n".join(lines))


def print_summary(results: dict[str, Any]) -> None:
    s = results["settings"]
    test = results.get("test", {})
    timing = results.get("timing", {})
    excluded = results.get("excluded") or []
    lines = [
        "=" * 64,
        f"fedfusion {results['status'].upper()}"
        + (" (AT CHANCE)" if results.get("at_chance") else "") + f": strategy {s['strategy']}, "
        f"{(results.get('cost') or {}).get('rounds', s['num-rounds'])} round(s)"
        + (" (replay)" if s.get("replay") else ""),
        f"  data     {s['dataset']}, "
        + ("each device's own data (client-data='local')" if s.get("client-data") == "local"
           else f"partition file {Path(s['partition-file']).name}"
           + (f" [{s['partition-key']}]" if s.get("partition-key") else "")
           if s.get("partition-file") else f"{s['partitioner']} alpha={s['alpha']:g}")
        + f", {clients_line(results)}, seed {s['seed']}",
    ]
    cost = results.get("cost")
    if cost:
        up, down = cost["upload_bytes_per_client"] / 1e6, cost["download_bytes_per_client"] / 1e6
        lines.append(f"  cost     {cost['forward_passes']} forward pass(es) per prediction | "
                     f"{cost['rounds']} round(s) | per client {up:.2f} MB up, {down:.2f} MB "
                     "down")
    blocks = (results.get("strategy_report") or {}).get("curvature_blocks")
    if blocks:  # which parameter got a Kron / diagonal / dense block
        lines.append("  blocks   " + " | ".join(
            f"{kind} {len(names)}" + ("" if kind == "kron" else " (" + ", ".join(names[:3])
                                      + (", ..." if len(names) > 3 else "") + ")")
            for kind, names in blocks.items() if names))
    if test:
        lines.append(f"  test     accuracy {100 * test['accuracy']:.2f}%   NLL {test['nll']:.4f}"
                     f"   ECE {test['ece']:.4f}")
    if "val" in results:
        lines.append(f"  val      accuracy {100 * results['val']['accuracy']:.2f}%")
    distill = results.get("distill")
    if distill:  # the test line above is the student's; both side by side
        for who in ("teacher", "student"):
            metrics = distill[who]["test"]
            lines.append(f"  {who:<8} test accuracy {100 * metrics['accuracy']:.2f}%   NLL "
                         f"{metrics['nll']:.4f}" + (" (the fused predictor)" if who == "teacher"
                                                   else f" (one network, distill="
                                                   f"{distill['mode']!r})"))
    if results.get("at_chance"):
        chance = results["chance"]
        lines.append(f"  WARNING  the fused model is at chance on the validation data: accuracy "
                     f"{100 * chance['accuracy']:.2f}% <= chance {100 * chance['chance']:.2f}% "
                     f"+ margin {100 * chance['margin']:.2f}%")
    norm = results.get("norm_stats")
    if norm:
        lines.append(f"  norm     BatchNorm statistics {norm['rule']!r} ({norm['reason']}): "
                     f"{norm['recalibrated_layers']} of {norm['running_stat_layers']} layer(s) "
                     "re-estimated")
    lines += [f"  capped   {capped_reason(r)}" for r in results.get("capped_claims") or []]
    if "client_train_s_sum" in timing:
        lines.append(f"  time     wall {timing['wall_s']:.1f} s | client training "
                     f"{timing['client_train_s_sum']:.1f} s (sum) | server fuse "
                     f"{timing['server_fuse_s']:.2f} s + eval {timing['server_eval_s']:.2f} s")
    lines.append(f"  excluded {len(excluded)}" + "".join(
        f"\n    - client {e['client']}: {e['reason']}" for e in excluded))
    if results["status"] == "failed":
        lines.append(f"  error    {results.get('error')}")
    lines += [f"  results  {results['output_dir']}/results.json", "=" * 64]
    print("\n".join(lines), flush=True)


def clients_line(results: dict[str, Any]) -> str:
    """"N clients", or for a replay of some of them "K of N clients replayed (...)"."""
    s = results["settings"]
    fused = len(results.get("clients") or [])
    if s.get("replay") and results.get("clients") is not None and fused != s["num-clients"]:
        kept = f", replay-clients={s['replay-clients']}" if s.get("replay-clients") else ""
        return f"{fused} of {s['num-clients']} clients replayed{kept}"
    return f"{s['num-clients']} clients"
