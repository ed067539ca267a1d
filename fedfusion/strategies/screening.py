"""Robust aggregation: what one client claims or sends is checked against the other clients
before anything is fused, and a fused model no better than chance is said to be so.

Validation (:mod:`fedfusion.wire.validation`) checks each upload on its own: types, shapes and
magnitude caps. An upload can pass every one of those and still dominate a fusion, because
its weight in an average is what the client says (``num_examples``) and its values may sit at
the caps. The functions here compare each client with the others (pure functions on
:class:`~fedfusion.wire.ClientUpload`, no global state, deterministic); the strategy calls them
once per round, before :meth:`~fedfusion.strategies.base.FusionStrategy.fuse`, so every
strategy weights by the same capped counts and fuses the same screened uploads.

**Claimed example counts** (:func:`cap_num_examples`). Client c claims n_c; with
m_{-c} = median_{j != c} n_j (the median of the OTHER clients' claims, so a client cannot
raise its own cap), the count every strategy weights by is

    n'_c = min(n_c, max(1, floor(k * m_{-c})))           (k = ``num_examples_cap``; 0 = off)

One client's share of a sample-weighted average is then at most k / (k + C - 1) with C
clients of equal honest counts (4 honest + 1 claiming 1e9 at k = 3: 3/7 = 43% instead of
100%), and no client is capped unless it claims more than k times the median of the others.
The class histogram is no cross-check on its own: validation already requires it to sum to
``num_examples``, and a client that lies about one can lie about both.

**Weight norms** (:func:`screen_weight_norms`). For every floating entry p of the ``weights``
section (parameters and running statistics) and client c with members m:
r_{c,m,p} = ||w_{c,m,p}||_2 (in float64). Each client contributes ONE reference value per entry,
the median over its members s_{c,p} = median_m r_{c,m,p} (so uploading many members buys no
say in the reference), and the entry's reference is R_p = median_c s_{c,p} over the clients
whose entry p has the same shape. Client c is an outlier when, for some member m and entry p,

    r_{c,m,p} > f * R_p  and  r_{c,m,p} > NORM_FLOOR * sqrt(size_p)   (f = ``screen_factor``)

(the floor, an RMS of 1e-6, keeps entries the other clients hold at zero from dividing by
zero without letting a large value there through). The median is the honest clients' as long
as fewer than half of the clients are outliers; with fewer than :data:`MIN_SCREEN_CLIENTS`
clients sharing an entry there is no majority to compare with, so nothing is excluded and
the report says so. Only weights are screened: curvature and Gram matrices are sums over a
client's samples, so their norms grow with honest data and a ratio test would exclude large
clients (their magnitude caps bound them instead). Small norms are not screened: a zero or
tiny entry pulls an average towards zero by at most its (capped) weight share, and an
untrained honest layer looks the same.

**At chance** (:func:`chance_check`): a fused model whose validation accuracy a satisfies
a <= chance + margin, with chance = max(1/K, the validation set's majority-class rate) and
margin = max(:data:`CHANCE_MARGIN_MIN`, 2 * sqrt(chance * (1 - chance) / n)) (two standard
errors of an accuracy measured on n validation rows), is reported as at chance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfusion.evaluation import Labelled, evaluate
from fedfusion.wire import WEIGHTS, ClientUpload

#: the norm screen needs at least this many clients sharing an entry to tell an outlier
#: from the rest (with 2, either could be the outlier)
MIN_SCREEN_CLIENTS = 3
#: norms at most NORM_FLOOR * sqrt(size) (an RMS of 1e-6) are never outliers: entries the
#: other clients hold at (numerically) zero
NORM_FLOOR = 1e-6
#: the least margin above chance a fused model must clear not to be reported at chance
CHANCE_MARGIN_MIN = 0.02


@dataclass
class ScreenResult:
    """The uploads a round fuses and what screening did to the others.

    ``kept``: the uploads that passed, as received, in the order given. ``weighted``: the
    same uploads as fused: a copy with the capped ``num_examples`` where capped, else the
    upload itself (the inputs are never modified). ``excluded``: (upload, reason) of every
    outlier. ``capped``: one record per capped claim. ``notes``: what could not be screened."""

    kept: list[ClientUpload]
    weighted: list[ClientUpload]
    excluded: list[tuple[ClientUpload, str]] = field(default_factory=list)
    capped: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def who(upload: ClientUpload) -> str:
    """``client 3 (node 103)``, or ``client 3`` for an upload made without Flower."""
    node = f" (node {upload.node_id})" if upload.node_id is not None else ""
    return f"client {upload.client_id}{node}"


def cap_num_examples(uploads: Sequence[ClientUpload], factor: float
                     ) -> tuple[list[ClientUpload], list[dict[str, Any]]]:
    """Every client's ``num_examples`` capped at ``factor`` x the median of the OTHER
    clients' claims (module docstring); ``factor`` 0 caps nothing, and neither does a lone
    client. Returns the uploads (a copy with the capped count where capped, else the upload
    itself) and one record per capped client: ``client_id``, ``node_id``, ``claimed``,
    ``capped_to``, ``median_of_others``, ``factor``."""
    if factor < 0 or not math.isfinite(factor):
        raise ValueError(f"the num_examples cap factor must be a finite number >= 0, got "
                         f"{factor!r}")
    if not factor or len(uploads) < 2:
        return list(uploads), []
    claims = [int(u.num_examples) for u in uploads]
    out: list[ClientUpload] = []
    records: list[dict[str, Any]] = []
    for i, upload in enumerate(uploads):
        median = float(np.median(claims[:i] + claims[i + 1:]))
        cap = max(1, math.floor(factor * median))
        if claims[i] <= cap:
            out.append(upload)
            continue
        out.append(dataclasses.replace(upload, num_examples=cap))
        records.append({"client_id": upload.client_id, "node_id": upload.node_id,
                        "claimed": claims[i], "capped_to": cap, "median_of_others": median,
                        "factor": factor})
    return out, records


def capped_reason(record: dict[str, Any]) -> str:
    """One line for a capped claim (the log, the summary)."""
    node = f" (node {record['node_id']})" if record.get("node_id") is not None else ""
    return (f"client {record['client_id']}{node} claims {record['claimed']} examples, "
            f"{record['claimed'] / max(record['median_of_others'], 1e-300):.3g}x the other "
            f"clients' median {record['median_of_others']:g}: weighted as "
            f"{record['capped_to']} (num_examples_cap {record['factor']:g})")


def weight_norms(upload: ClientUpload) -> list[dict[str, float]]:
    """r_{c,m,p}: the L2 norm (float64) of every floating ``weights`` entry p, per member m."""
    return [{name: float(np.linalg.norm(array.astype(np.float64, copy=False).ravel()))
             for name, array in member[WEIGHTS].items() if array.dtype.kind == "f"}
            for member in upload.members]


def screen_weight_norms(uploads: Sequence[ClientUpload], factor: float
                        ) -> tuple[list[ClientUpload], list[tuple[ClientUpload, str]],
                                   list[str]]:
    """The per-entry norm screen of the module docstring at factor f = ``factor`` (0: off).

    Returns (kept uploads in the order given, (upload, reason) per outlier, notes on what
    could not be screened). The reason names the worst entry: ``member m`` (when the client
    has several), the entry, its norm, the ratio to the clients' median, and the factor."""
    if factor < 0 or not math.isfinite(factor):
        raise ValueError(f"the screen factor must be a finite number >= 0, got {factor!r}")
    if not factor:
        return list(uploads), [], []
    if len(uploads) < MIN_SCREEN_CLIENTS:
        return list(uploads), [], [] if not uploads else [
            f"{len(uploads)} client(s): the weight-norm screen needs at least "
            f"{MIN_SCREEN_CLIENTS} to tell an outlier from the rest; nothing screened"]
    norms = [weight_norms(u) for u in uploads]
    # entries keyed by (name, shape): clients of other architectures (AMS) are not compared
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for c, upload in enumerate(uploads):
        for name, array in upload.weights(0).items():
            if array.dtype.kind == "f":
                groups.setdefault((name, tuple(array.shape)), []).append(c)
    worst: dict[int, list[tuple[float, str]]] = {}
    unscreened = 0
    for (name, shape), clients in groups.items():
        if len(clients) < MIN_SCREEN_CLIENTS:
            unscreened += 1
            continue
        reference = float(np.median([np.median([m[name] for m in norms[c] if name in m])
                                     for c in clients]))
        floor = NORM_FLOOR * math.sqrt(math.prod(shape))
        for c in clients:
            for m, member in enumerate(norms[c]):
                norm = member.get(name)
                if norm is None or not (norm > factor * reference and norm > floor):
                    continue
                ratio = norm / reference if reference > 0 else math.inf
                where = f"member {m} " if len(norms[c]) > 1 else ""
                worst.setdefault(c, []).append((ratio, (
                    f"{where}layer {name}: norm {norm:.3g} is {ratio:.3g}x the clients' "
                    f"median {reference:.3g}")))
    notes = [f"{unscreened} weight entr{'y' if unscreened == 1 else 'ies'} held by fewer than "
             f"{MIN_SCREEN_CLIENTS} clients of one shape were not screened"] if unscreened else []
    kept, excluded = [], []
    for c, upload in enumerate(uploads):
        if c not in worst:
            kept.append(upload)
            continue
        hits = sorted(worst[c], key=lambda hit: -hit[0])
        more = f"; {len(hits) - 1} more entr{'y' if len(hits) == 2 else 'ies'} above it" \
            if len(hits) > 1 else ""
        excluded.append((upload, f"{who(upload)}: weights screened out as an outlier: "
                                 f"{hits[0][1]} (screen_factor {factor:g}){more}"))
    return kept, excluded, notes


def screen_uploads(uploads: Sequence[ClientUpload], *, screen_factor: float,
                   num_examples_cap: float) -> ScreenResult:
    """The norm screen (outliers out), then the count cap among the clients kept (an
    outlier's claim does not move the others' medians)."""
    kept, excluded, notes = screen_weight_norms(uploads, screen_factor)
    weighted, capped = cap_num_examples(kept, num_examples_cap)
    return ScreenResult(kept, weighted, excluded, capped, notes)


def chance_level(y: torch.Tensor, num_classes: int) -> float:
    """max(1/K, the majority-class rate of ``y``): the accuracy of guessing."""
    counts = torch.bincount(y.long().flatten(), minlength=num_classes)
    return max(1.0 / num_classes, float(counts.max()) / max(len(y), 1))


def chance_margin(chance: float, num_rows: int) -> float:
    """max(CHANCE_MARGIN_MIN, two standard errors of an accuracy of ``chance`` on
    ``num_rows`` rows)."""
    return max(CHANCE_MARGIN_MIN, 2.0 * math.sqrt(chance * (1.0 - chance) / max(num_rows, 1)))


def chance_check(predictor: nn.Module, val: Labelled | None, device: torch.device
                 ) -> dict[str, Any] | None:
    """Validation accuracy of ``predictor`` against chance (module docstring): a dict with
    ``accuracy``, ``chance``, ``margin``, ``num_rows`` and ``at_chance``; None without
    validation data."""
    if val is None or not len(val):
        return None
    with torch.no_grad():
        num_classes = int(predictor.to(device)(val.x[:1].to(device)).shape[-1])
        accuracy = float(evaluate(predictor, val.x, val.y, device)["accuracy"])
    num_classes = max(num_classes, int(val.y.max()) + 1)
    chance = chance_level(val.y, num_classes)
    margin = chance_margin(chance, len(val))
    return {"accuracy": accuracy, "chance": chance, "margin": margin, "num_rows": len(val),
            "at_chance": bool(accuracy <= chance + margin)}
