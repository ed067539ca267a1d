"""Robust aggregation: what one client claims or sends is checked against the other clients
before anything is fused, and a fused model no better than chance is said to be so.

Validation (:mod:`fedfusion.wire.validation`) checks each upload on its own: types, shapes and
magnitude caps. An upload can pass every one of those and still dominate a fusion, because
its weight in an average is what the client says (``num_examples``) and its values may sit at
the caps. The functions here compare each client with the others (pure functions on
:class:`~fedfusion.wire.ClientUpload`, no global state, deterministic); the strategy calls them
once per round, before :meth:`~fedfusion.flower.strategy.FusionStrategy.fuse`, so every
strategy weights by the same capped counts and fuses the same screened uploads.

**Claimed example counts** (:func:`cap_num_examples`). Client c claims n_c; with
m_{-c} = median_{j != c} n_j (the median of the OTHER clients' claims, so a client cannot
raise its own cap), the count every strategy weights by is

    n'_c = min(n_c, max(1, floor(k * m_{-c})))           (k = ``num_examples_cap``; 0 = off)

One client's share of a sample-weighted average is then at most k / (k + C - 1) with C
clients of equal honest counts (4 honest + 1 claiming 1e9 at k = 3: 3/7 = 43% instead of
100%), and no client is capped unless it claims more than k times the median of the others.
The class histogram is no cross-check on its own: validation already requires it to sum to
``num_examples``, and a client that lies about one can lie about both. A capped client's
``class-histogram`` metric is scaled to its capped count (largest remainders), so that
strategies weighting by class (PFNM's output layer) see the same cap.

**Weight norms** (:func:`screen_weight_norms`). For every floating entry p of the ``weights``
section (parameters and running statistics) and client c with members m:
r_{c,m,p} = ||w_{c,m,p}||_2 (in float64). Each client contributes ONE reference value per entry,
the median over its members s_{c,p} = median_m r_{c,m,p} (so uploading many members buys no
say in the reference), and the entry's reference is R_p = median_c s_{c,p} over the clients
whose entry p has the same shape. Client c is an outlier when, for some member m and entry p,

    r_{c,m,p} > f * R_p  and  r_{c,m,p} > max(NORM_FLOOR, f * rho) * sqrt(size_p)
                                                                     (f = ``screen_factor``)

with rho the network's typical entry RMS (median over clients, members and entries of
r_{c,m,p} / sqrt(size_p)). The floor's first part (an RMS of 1e-6) keeps entries the other
clients hold at zero from dividing by zero; its second keeps entries that START at zero
(biases, BatchNorm shifts, zero-initialised residual branches) from screening out an honest
client that simply took more steps: their norm grows with the steps, so a client with 6x the
rows reached 11.6x the median bias norm, yet an RMS far below the network's typical one,
while an entry blown up to dominate an average stands out against both. The median is the
honest clients' as long
as fewer than half of the clients are outliers; with fewer than :data:`MIN_SCREEN_CLIENTS`
clients sharing an entry there is no majority to compare with, so nothing is excluded and
the report says so. Small norms are not screened: a zero or tiny entry pulls an average
towards zero by at most its (capped) weight share, and an untrained honest layer looks the
same. The rule (:func:`entry_outliers`) is shared with the curvature screen.

**Curvature and Gram** (:func:`screen_curvature`), for the sections the strategy fuses
(``curvature.<structure>``: FedBEns, FedFisher, Fisher merging; ``gram``: RegMean). These
are sums over a client's samples, so each layer's scale is divided by the client's count:
for member m of client c and layer p of section s,

    t_{c,m,(s,p)} = tr(H_{c,m,s,p}) / n'_c

with H the layer's matrix (a Kron block: tr(B (x) A) = (sum l_B)(sum l_A); a diagonal:
sum h; a ``diag_full`` block: tr H_L; a Gram: tr G, :func:`section_scales`) and n'_c the
count capped among the clients kept by the weight and validation screens (so a claim of
1e9 examples cannot dilute a trace at the cap). The trace bounds the largest eigenvalue,
but per layer only: a client may put an honest-sized trace on a few entries or one
direction (a diagonal Fisher on 8 weights, a rank-1 Gram) and so pull those entries of a
Fisher merge or RegMean to its own values without passing any factor. The same rule as
the weights then applies with f = ``curvature_screen_factor``
(floor NORM_FLOOR per diagonal entry; values at or below it carry no scale and count
neither in the median nor as holding the layer: on data of one class a client's curvature
vanishes, about 1e-12 per example, and a median of such clients made the one client that
saw every class 4e11x "the median"). Excluding, not clipping: a client whose precision is
out of line by the factor has sent numbers its data cannot explain, and clipping would
still fuse its weights at up to f times the median client's share; the bound this leaves
is f * k times a median client's precision (k = ``num_examples_cap``) for a client just
under both limits. Small traces are not screened: a tiny precision gives a client less say
in every one of these fusions.

**Validation screen** (:func:`screen_on_validation`), with the server's validation rows
(x_i, y_i), i = 1..n: every member predicts yhat_i = argmax f(x_i), and is scored by its
accuracy a = mean_i [yhat_i = y_i] against what its OWN predicted-class rates q_k would
score by chance on the validation labels' class rates p_k,

    e = sum_k q_k p_k,     below  <=>  a < e - max(CHANCE_MARGIN_MIN,
                                                   VAL_SCREEN_SIGMAS * sqrt(e (1 - e) / n))

(a - e is the numerator of Cohen's kappa). A client with any member below is excluded
before fusion. Against its own chance, not 1/K: an honest client that knows one class
predicts it everywhere and scores exactly e (about 1/K on balanced rows), one that knows
a few classes scores above its e, while a member whose last layer is negated or whose rows
are permuted puts its predictions on the wrong classes and scores near 0. What it cannot
catch: a member at or above its own chance that still hurts the fusion (an untrained or
free-riding model scores e; a model trained to be right on the validation rows; hidden
units permuted, which leaves every member's predictions intact but breaks a parameter
average; an attack on a few classes, diluted in a and e), and anything without validation
rows.

**At chance** (:func:`chance_check`): a fused model whose validation accuracy a satisfies
a <= chance + margin, with chance = max(1/K, the validation set's majority-class rate) and
margin = max(:data:`CHANCE_MARGIN_MIN`, 2 * sqrt(chance * (1 - chance) / n)) (two standard
errors of an accuracy measured on n validation rows), is reported as at chance; on so few
rows that chance + margin >= 1, only a <= chance is (a perfect score is not "at chance").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfusion.constraints import FINITE_NON_NEGATIVE
from fedfusion.core.evaluation import Labelled, evaluate
from fedfusion.sections import CURVATURE_PREFIX
from fedfusion.wire import WEIGHTS, ClientUpload

#: the norm screen needs at least this many clients sharing an entry to tell an outlier
#: from the rest (with 2, either could be the outlier)
MIN_SCREEN_CLIENTS = 3
#: norms at most NORM_FLOOR * sqrt(size) (an RMS of 1e-6) are never outliers: entries the
#: other clients hold at (numerically) zero
NORM_FLOOR = 1e-6
#: the least margin above chance a fused model must clear not to be reported at chance
CHANCE_MARGIN_MIN = 0.02
#: the validation screen's margin below a member's own chance, in standard errors
VAL_SCREEN_SIGMAS = 3.0
#: RegMean's upload section (:mod:`fedfusion.sections.gram`), screened with the curvature
GRAM = "gram"


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
    claims = [int(u.num_examples) for u in uploads]
    counts, medians = capped_counts(claims, factor)
    out: list[ClientUpload] = []
    records: list[dict[str, Any]] = []
    for i, upload in enumerate(uploads):
        if i not in medians:
            out.append(upload)
            continue
        metrics = dict(upload.metrics)
        if isinstance(metrics.get("class-histogram"), list):
            metrics["class-histogram"] = scaled_histogram(metrics["class-histogram"], counts[i])
        out.append(dataclasses.replace(upload, num_examples=counts[i], metrics=metrics))
        records.append({"client_id": upload.client_id, "node_id": upload.node_id,
                        "claimed": claims[i], "capped_to": counts[i],
                        "median_of_others": medians[i], "factor": factor})
    return out, records


def scaled_histogram(histogram: Sequence[float], total: int) -> list[int]:
    """``histogram`` scaled to sum to ``total`` (ints; the largest remainders round up, ties to
    the lower class); an empty or all-zero one is returned as it is."""
    values = np.asarray(histogram, dtype=np.float64)
    if not len(values) or not values.sum() > 0:
        return [int(v) for v in histogram]
    exact = values * (total / values.sum())
    scaled = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - scaled), kind="stable")[:total - int(scaled.sum())]
    scaled[order] += 1
    return [int(v) for v in scaled]


def capped_weights(weights: Sequence[float], factor: float) -> list[float]:
    """The count cap's rule for a real-valued client weight (a ``weighted_by_key`` metric):
    w'_c = min(w_c, k m_{-c}), m_{-c} the median of the others' (k = ``factor``; 0 or a
    lone client: no cap)."""
    FINITE_NON_NEGATIVE.check("the num_examples cap factor", factor)
    if not factor or len(weights) < 2:
        return list(weights)
    return [min(w, factor * median) for w, median in zip(weights, _others_medians(weights),
                                                          strict=True)]


def _others_medians(values: Sequence[float]) -> list[float]:
    """m_{-c}: for every value, the median of the others."""
    return [float(np.median(list(values[:i]) + list(values[i + 1:])))
            for i in range(len(values))]


def capped_counts(claims: Sequence[int], factor: float) -> tuple[list[int], dict[int, float]]:
    """n'_c = min(n_c, max(1, floor(k m_{-c}))) for every claim (k = ``factor``; 0 or a lone
    claim: no cap), and the median of the others m_{-c} of each capped index c."""
    FINITE_NON_NEGATIVE.check("the num_examples cap factor", factor)
    counts, medians = list(claims), {}
    if not factor or len(claims) < 2:
        return counts, medians
    for i, (claim, median) in enumerate(zip(claims, _others_medians(claims), strict=True)):
        if claim > factor * median:  # compared as floats: factor may be huge
            counts[i], medians[i] = max(1, math.floor(factor * median)), median
    return counts, medians


def capped_reason(record: dict[str, Any]) -> str:
    """One line for a capped claim (the log, the summary)."""
    node = f" (node {record['node_id']})" if record.get("node_id") is not None else ""
    who = (f"client {record['client_id']}{node}" if record.get("client_id") is not None
           else f"node {record['node_id']}")
    return (f"{who} claims {record['claimed']} examples, "
            f"{record['claimed'] / max(record['median_of_others'], 1e-300):.3g}x the other "
            f"clients' median {record['median_of_others']:g}: weighted as "
            f"{record['capped_to']} (num_examples_cap {record['factor']:g})")


def weight_norms(upload: ClientUpload) -> list[dict[str, float]]:
    """r_{c,m,p}: the L2 norm (float64) of every floating ``weights`` entry p, per member m."""
    return [{name: float(np.linalg.norm(array.astype(np.float64, copy=False).ravel()))
             for name, array in member[WEIGHTS].items() if array.dtype.kind == "f"}
            for member in upload.members]


#: one entry's key in :func:`entry_outliers` (a weight entry: its name and shape; a
#: curvature or Gram layer: its section and parameter name)
EntryKey = tuple[str, Any]
#: one rule hit: (ratio to the reference, member, entry key, value, reference)
Hit = tuple[float, int, EntryKey, float, float]


def entry_outliers(values: Sequence[Sequence[Mapping[EntryKey, float]]], factor: float,
                   floors: Mapping[EntryKey, float],
                   negligible: Mapping[EntryKey, float] | None = None
                   ) -> tuple[dict[int, list[Hit]], int]:
    """The robust rule of every per-entry screen (module docstring), on values
    ``values[c][m][e]`` = v_{c,m,e} >= 0 of client c, member m, entry e: the reference of
    entry e is R_e = median_c median_m v_{c,m,e} over the clients holding e, and (c, m, e) is
    a hit when v_{c,m,e} > factor * R_e and v_{c,m,e} > ``floors[e]``. With ``negligible``,
    values at or below ``negligible[e]`` carry no scale: they count neither in R_e nor as
    holding e (a client whose curvature vanished on data of one class would otherwise make
    every client that learnt something look like an outlier). Entries held by fewer than
    :data:`MIN_SCREEN_CLIENTS` clients are not screened. Returns the hits per client index,
    worst (largest ratio) first, and how many entries were not screened."""
    def counts(key: EntryKey, value: float) -> bool:
        return negligible is None or value > negligible[key]

    holders: dict[EntryKey, list[int]] = {}
    for c, members in enumerate(values):
        for key in dict.fromkeys(k for member in members for k, v in member.items()
                                 if counts(k, v)):
            holders.setdefault(key, []).append(c)
    hits: dict[int, list[Hit]] = {}
    unscreened = 0
    for key, clients in holders.items():
        if len(clients) < MIN_SCREEN_CLIENTS:
            unscreened += 1
            continue
        reference = float(np.median([np.median([m[key] for m in values[c]
                                                if key in m and counts(key, m[key])])
                                     for c in clients]))
        for c in clients:
            for m, member in enumerate(values[c]):
                value = member.get(key)
                if value is None or not (value > factor * reference and value > floors[key]):
                    continue
                ratio = value / reference if reference > 0 else math.inf
                hits.setdefault(c, []).append((ratio, m, key, value, reference))
    return {c: sorted(h, key=lambda hit: -hit[0]) for c, h in hits.items()}, unscreened


def _outlier_reason(upload: ClientUpload, what: str, hits: list[Hit], describe: str,
                    knob: str) -> str:
    """``client 3: weights screened out as an outlier: <worst hit> (knob f); N more entries
    above it``; ``describe`` formats a hit with ``{where}`` (``member m `` for a client
    with several), ``{name}``, ``{value}``, ``{ratio}`` and ``{reference}``."""
    ratio, m, key, value, reference = hits[0]
    where = f"member {m} " if upload.num_members > 1 else ""
    more = f"; {len(hits) - 1} more entr{'y' if len(hits) == 2 else 'ies'} above it" \
        if len(hits) > 1 else ""
    return (f"{who(upload)}: {what} screened out as an outlier: " + describe.format(
        where=where, name=key[0] if what == "weights" else key[1], section=key[0],
        value=value, ratio=ratio, reference=reference) + f" ({knob}){more}")


def screen_weight_norms(uploads: Sequence[ClientUpload], factor: float
                        ) -> tuple[list[ClientUpload], list[tuple[ClientUpload, str]],
                                   list[str]]:
    """The per-entry norm screen of the module docstring at factor f = ``factor`` (0: off).

    Returns (kept uploads in the order given, (upload, reason) per outlier, notes on what
    could not be screened). The reason names the worst entry: ``member m`` (when the client
    has several), the entry, its norm, the ratio to the clients' median, and the factor."""
    FINITE_NON_NEGATIVE.check("the screen factor", factor)
    if not factor:
        return list(uploads), [], []
    if len(uploads) < MIN_SCREEN_CLIENTS:
        return list(uploads), [], [] if not uploads else [
            f"{len(uploads)} client(s): the weight-norm screen needs at least "
            f"{MIN_SCREEN_CLIENTS} to tell an outlier from the rest; nothing screened"]
    # entries keyed by (name, shape): clients of other architectures (AMS) are not compared
    values = [[{(name, member[WEIGHTS][name].shape): norm for name, norm in norms.items()}
               for member, norms in zip(u.members, weight_norms(u), strict=True)]
              for u in uploads]
    rms = float(np.median([np.median([np.median([norm / math.sqrt(max(math.prod(key[1]), 1))
                                                 for key, norm in member.items()] or [0.0])
                                      for member in members]) for members in values]))
    floor = max(NORM_FLOOR, factor * rms)
    floors = {key: floor * math.sqrt(math.prod(key[1]))
              for members in values for member in members for key in member}
    hits, unscreened = entry_outliers(values, factor, floors)
    notes = [f"{unscreened} weight entr{'y' if unscreened == 1 else 'ies'} held by fewer than "
             f"{MIN_SCREEN_CLIENTS} clients of one shape were not screened"] if unscreened else []
    excluded = [(u, _outlier_reason(u, "weights", hits[c], "{where}layer {name}: norm "
                                    "{value:.3g} is {ratio:.3g}x the clients' median "
                                    "{reference:.3g}", f"screen_factor {factor:g}"))
                for c, u in enumerate(uploads) if c in hits]
    return [u for c, u in enumerate(uploads) if c not in hits], excluded, notes


def screened_section(section: str) -> bool:
    """True for the sections the curvature screen reads: Laplace curvature
    (``curvature.<structure>``) and RegMean's ``gram``."""
    return section.startswith(CURVATURE_PREFIX) or section == GRAM


def section_scales(section: str, arrays: Mapping[str, np.ndarray]
                   ) -> dict[str, tuple[float, int]]:
    """Per layer of one member's curvature or Gram section, (trace, side) of the matrix it
    describes (float64; the arrays passed validation, so every eigenvalue is >= 0 up to
    round-off, clipped here):

    * ``gram``: tr G and the side of G, per Linear/Conv2d weight;
    * a Kron block ``p/eigvals_out``, ``p/eigvals_in``: tr(B (x) A) = tr B * tr A =
      (sum l_B)(sum l_A), side r_B r_A (the kept eigenpairs); eigenvectors are not read
      (validation checked them orthonormal, so they leave the trace alone);
    * ``p/ggn_diag``: sum h, side its size; ``p/ggn_full``: tr H_L, side n.

    A parameter with several arrays (none today) would sum them."""
    scales: dict[str, tuple[float, int]] = {}

    def add(name: str, trace: float, side: int) -> None:
        old = scales.get(name, (0.0, 0))
        scales[name] = (old[0] + trace, old[1] + side)

    for key, array in arrays.items():
        values = array.astype(np.float64, copy=False)
        if section == GRAM:
            add(key, float(np.trace(values)), values.shape[0])
            continue
        name, _, kind = key.rpartition("/")
        if kind == "eigvals_in":
            out = arrays[f"{name}/eigvals_out"].astype(np.float64, copy=False)
            add(name, float(np.maximum(out, 0).sum() * np.maximum(values, 0).sum()),
                out.size * values.size)
        elif kind == "ggn_diag":
            add(name, float(np.maximum(values, 0).sum()), values.size)
        elif kind == "ggn_full":
            add(name, float(np.trace(values)), values.shape[0])
    return scales


def screen_curvature(uploads: Sequence[ClientUpload], factor: float, sections: Sequence[str],
                     counts: Sequence[int] | None = None
                     ) -> tuple[list[ClientUpload], list[tuple[ClientUpload, str]], list[str]]:
    """The curvature and Gram screen of the module docstring at factor f = ``factor`` (0:
    off) over ``sections`` (those :func:`screened_section` reads; others are skipped), each
    layer's trace divided by the client's example count (``counts[c]``, the capped count the
    strategy weights by; default each upload's ``num_examples``).

    Returns (kept uploads in the order given, (upload, reason) per outlier, notes), as
    :func:`screen_weight_norms`; the reason names the worst layer: member, section, layer,
    its trace per example, the ratio to the clients' median and the factor."""
    FINITE_NON_NEGATIVE.check("the curvature screen factor", factor)
    sections = [s for s in sections if screened_section(s)]
    if not factor or not sections:
        return list(uploads), [], []
    if len(uploads) < MIN_SCREEN_CLIENTS:
        return list(uploads), [], [] if not uploads else [
            f"{len(uploads)} client(s): the curvature screen needs at least "
            f"{MIN_SCREEN_CLIENTS} to tell an outlier from the rest; nothing screened"]
    counts = [u.num_examples for u in uploads] if counts is None else list(counts)
    values: list[list[dict[EntryKey, float]]] = []
    floors: dict[EntryKey, float] = {}
    for upload, count in zip(uploads, counts, strict=True):
        members = []
        for member in upload.members:
            row: dict[EntryKey, float] = {}
            for section in sections:
                for name, (trace, side) in section_scales(section,
                                                          member.get(section, {})).items():
                    row[(section, name)] = trace / max(count, 1)
                    floors[(section, name)] = NORM_FLOOR * side
            members.append(row)
        values.append(members)
    hits, unscreened = entry_outliers(values, factor, floors, negligible=floors)
    notes = [f"{unscreened} curvature/Gram layer(s) held by fewer than {MIN_SCREEN_CLIENTS} "
             f"clients above the floor ({NORM_FLOOR:g} per diagonal entry) were not screened"
             ] if unscreened else []
    excluded = []
    for c, upload in enumerate(uploads):
        if c in hits:
            what = "Gram" if hits[c][0][2][0] == GRAM else "curvature"
            excluded.append((upload, _outlier_reason(
                upload, what, hits[c], "{where}section {section} layer {name}: trace per "
                "example {value:.3g} is {ratio:.3g}x the clients' median {reference:.3g}",
                f"curvature_screen_factor {factor:g}")))
    return [u for c, u in enumerate(uploads) if c not in hits], excluded, notes


def agreement_scores(predictions: Sequence[torch.Tensor], y: torch.Tensor, num_classes: int
                     ) -> list[dict[str, float]]:
    """Per member, its validation accuracy against what its own predictions would score by
    chance (module docstring, validation screen): ``accuracy`` a = mean[yhat = y],
    ``expected`` e = sum_k q_k p_k (q: the member's predicted-class rates, p: the
    validation labels' class rates), ``margin`` (:func:`chance_margin` of e at
    :data:`VAL_SCREEN_SIGMAS` standard errors), ``below`` (a < e - margin)."""
    y = y.long().flatten().cpu()
    n = max(len(y), 1)
    labels = torch.bincount(y, minlength=num_classes).double() / n
    scores = []
    for predicted in predictions:
        predicted = predicted.long().flatten().cpu()
        rates = torch.bincount(predicted, minlength=num_classes).double() / n
        accuracy = float((predicted == y).double().mean())
        expected = float((rates[:len(labels)] * labels[:len(rates)]).sum())
        margin = chance_margin(expected, len(y), VAL_SCREEN_SIGMAS)
        scores.append({"accuracy": accuracy, "expected": expected, "margin": margin,
                       "below": accuracy < expected - margin})
    return scores


def screen_on_validation(uploads: Sequence[ClientUpload],
                         predict: Callable[[ClientUpload], Sequence[torch.Tensor]],
                         y: torch.Tensor | None, num_classes: int
                         ) -> tuple[list[ClientUpload], list[tuple[ClientUpload, str]]]:
    """The validation screen (module docstring): every member of every upload predicts the
    validation rows (``predict(upload)``: one tensor of predicted classes per member, in
    the order of ``y``), and a client with any member below its own chance
    (:func:`agreement_scores`) is excluded, the worst member named in the reason. No
    validation rows (``y`` None or empty): nothing is screened."""
    if y is None or not len(y):
        return list(uploads), []
    kept, excluded = [], []
    for upload in uploads:
        scores = agreement_scores(predict(upload), y, num_classes)
        below = [(s["accuracy"] - s["expected"], m, s) for m, s in enumerate(scores)
                 if s["below"]]
        if not below:
            kept.append(upload)
            continue
        _, m, worst = min(below, key=lambda hit: hit[0])
        where = f"member {m} " if upload.num_members > 1 else ""
        more = f"; {len(below) - 1} more member(s) below" if len(below) > 1 else ""
        excluded.append((upload, (
            f"{who(upload)}: {where}below chance on the validation data: accuracy "
            f"{worst['accuracy']:.3f} against {worst['expected']:.3f} expected of its own "
            f"predictions by chance (margin {worst['margin']:.3f}, {len(y)} rows){more}")))
    return kept, excluded


def screen_uploads(uploads: Sequence[ClientUpload], *, screen_factor: float,
                   num_examples_cap: float, curvature_screen_factor: float = 0.0,
                   sections: Sequence[str] = (),
                   predict: Callable[[ClientUpload], Sequence[torch.Tensor]] | None = None,
                   val_labels: torch.Tensor | None = None, num_classes: int = 0
                   ) -> ScreenResult:
    """Every screen, once, in this order: the weight-norm screen, the validation screen
    (with ``predict`` and ``val_labels``), the curvature/Gram screen over ``sections``
    (traces per example of the counts capped among the clients kept so far), then the count
    cap among the clients kept (an outlier's claim does not move the others' medians)."""
    kept, excluded, notes = screen_weight_norms(uploads, screen_factor)
    if predict is not None:
        kept, out = screen_on_validation(kept, predict, val_labels, num_classes)
        excluded += out
    capped, _ = cap_num_examples(kept, num_examples_cap)
    kept, out, more = screen_curvature(kept, curvature_screen_factor, sections,
                                       [u.num_examples for u in capped])
    excluded, notes = excluded + out, notes + more
    weighted, records = cap_num_examples(kept, num_examples_cap)
    return ScreenResult(kept, weighted, excluded, records, notes)


def chance_level(y: torch.Tensor, num_classes: int) -> float:
    """max(1/K, the majority-class rate of ``y``): the accuracy of guessing."""
    counts = torch.bincount(y.long().flatten(), minlength=num_classes)
    return max(1.0 / num_classes, float(counts.max()) / max(len(y), 1))


def chance_margin(chance: float, num_rows: int, sigmas: float = 2.0) -> float:
    """max(CHANCE_MARGIN_MIN, ``sigmas`` standard errors of an accuracy of ``chance`` on
    ``num_rows`` rows)."""
    return max(CHANCE_MARGIN_MIN,
               sigmas * math.sqrt(chance * (1.0 - chance) / max(num_rows, 1)))


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
    # too few rows for the margin to leave room below 1: only "no better than chance" is said
    bar = chance + margin if chance + margin < 1 else chance
    return {"accuracy": accuracy, "chance": chance, "margin": margin, "num_rows": len(val),
            "at_chance": bool(accuracy <= bar)}
