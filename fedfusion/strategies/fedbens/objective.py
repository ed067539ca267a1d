"""FedBEns' server objective (Eq. 5): the product of the clients' mixture-of-Laplace
posteriors over the stacked Gaussian components (:mod:`fedfusion.curvature.stacked_gaussians`),
with the prior counted ``C`` times divided out ``C - 1`` times.

:func:`mixture_log_posterior` evaluates it over all (run, component) pairs;
:class:`MixtureObjective` evaluates it on the components that carry weight: see its
docstring for why this is exact in float arithmetic and ~5x cheaper.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from fedfusion.curvature import StackedGaussians

#: MixtureObjective refreshes less often while every excluded member is this many margins away
FAR_GAP_MARGINS = 4.0
#: ... and then at most every this many x ``refresh_every`` calls
MAX_REFRESH_GROWTH = 8


def log_prior(w: Mapping[str, torch.Tensor], prior_var: float) -> torch.Tensor:
    """``[R]``: ``log N(w_r | 0, sigma2 I) = -||w_r||^2 / (2 sigma2) - d/2 log(2 pi sigma2)``."""
    sq = sum(v.reshape(v.shape[0], -1).pow(2).sum(-1) for v in w.values())
    d = sum(v[0].numel() for v in w.values())
    return -0.5 * sq / prior_var - 0.5 * d * math.log(2 * math.pi * prior_var)  # type: ignore


def mixture_log_posterior(
    w: Mapping[str, torch.Tensor],
    stacked: StackedGaussians,
    client_of_component: torch.Tensor,
    num_clients: int,
    prior_var: float,
    active: torch.Tensor | None = None,
) -> torch.Tensor:
    """FedBEns objective (Eq. 5) at ``R`` points, ``[R]``:

        sum_c logsumexp_{k : client(k) = c} [ -log M_c + log N(w | m_k, Lambda_k^{-1}) ]
            - (C - 1) log N(w | 0, sigma2 I),

    i.e. each client's posterior is the uniform mixture of its ``M_c`` Laplace components
    (``M_c`` may differ between clients) and the prior counted ``C`` times by the product of
    client posteriors is divided out ``C - 1`` times (Prop. 3.1). Only ``w``-independent
    constants of the paper's ``log p(w | D)`` are dropped; the component normalisers
    (log-determinants) are kept, as they weight the components inside each logsumexp.
    ``w`` should contain exactly the model parameters (the prior is over all of ``w``).

    ``active`` (``[R, K]`` bool), if given, limits the sums to those (run, component) pairs;
    the others count as zero density (see :class:`MixtureObjective`).
    """
    if active is None:
        log_dens = stacked.log_density(w)  # [R, K]
    else:
        log_dens = _scatter_pairs(stacked, w, torch.nonzero(active, as_tuple=True),
                                  tuple(active.shape))
    log_weight, member = _client_weights(client_of_component, stacked, num_clients)
    return _log_posterior(log_dens, log_weight, member, w, stacked, num_clients, prior_var)


def _client_weights(client_of_component: torch.Tensor, stacked: StackedGaussians,
                    num_clients: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(-log M_c(k) [K], membership [C, K])`` after checking the client index of each
    component."""
    client = torch.as_tensor(client_of_component, device=stacked.device).long()
    if client.shape != (stacked.num_components,):
        raise ValueError(
            f"client_of_component must have shape [{stacked.num_components}], "
            f"got {tuple(client.shape)}"
        )
    if client.min() < 0 or client.max() >= num_clients:
        raise ValueError(
            f"client ids must lie in [0, {num_clients}), got "
            f"{client.min().item()}..{client.max().item()}"
        )
    counts = torch.bincount(client, minlength=num_clients)
    if (counts == 0).any():
        raise ValueError(
            f"clients {torch.nonzero(counts == 0).flatten().tolist()} have no component"
        )
    log_weight = -torch.log(counts[client].to(stacked.dtype))  # -log M_c(k), [K]
    member = client[None, :] == torch.arange(num_clients, device=client.device)[:, None]
    return log_weight, member


def _scatter_pairs(stacked: StackedGaussians, w: Mapping[str, torch.Tensor],
                   pairs: tuple[torch.Tensor, torch.Tensor], shape: tuple[int, ...]
                   ) -> torch.Tensor:
    """``[R, K]``: the log-densities of the (run, component) ``pairs``, -inf elsewhere."""
    runs, comps = pairs
    return torch.full(shape, -math.inf, device=stacked.device, dtype=stacked.dtype).index_put(
        (runs, comps), stacked.log_density_pairs(w, runs, comps))


def _log_posterior(log_dens: torch.Tensor, log_weight: torch.Tensor, member: torch.Tensor,
                   w: Mapping[str, torch.Tensor], stacked: StackedGaussians, num_clients: int,
                   prior_var: float) -> torch.Tensor:
    """Eq. 5 from the ``[R, K]`` log-densities: the clients' logsumexps minus C - 1 priors."""
    terms = (log_dens + log_weight)[:, None, :]  # [R, 1, K]
    terms = torch.where(member, terms, -math.inf)  # [R, C, K]
    per_client = torch.logsumexp(terms, dim=-1)  # [R, C]
    extra = set(w) - set(stacked.param_shapes)
    if extra:
        raise ValueError(f"w has parameters the components do not cover: {sorted(extra)}")
    return per_client.sum(-1) - (num_clients - 1) * log_prior(w, prior_var)


class MixtureObjective:
    """Eq. 5 (:func:`mixture_log_posterior`) at ``R`` points, evaluated on the components that
    carry weight: the FedBEns server's objective, called once per optimiser step.

    Inside client c's ``logsumexp_m``, a component whose weighted log-density lies ``g`` nats
    below the client's best changes the sum by ``log(1 + e^-g) < e^-g`` and its gradient
    weight is ``< e^-g``. For real networks the gaps are enormous: LeNet on FMNIST gives
    ``g ~ 10^5`` nats between a client's best and second-best member at the median starts
    (the curvature is ~10^4-dimensional and the members sit in different basins), so each
    client's logsumexp is a max in floating point. Every ``refresh_every`` calls this
    objective evaluates all ``R x K`` log-densities without gradient and keeps, per run and
    client, the components within ``margin`` nats of the client's best (always at least the
    best); the calls in between evaluate only those pairs, ``R x C`` instead of ``R x K``
    for well separated members (~5x less work for M = 5). With ``margin = 50`` a pruned
    component's weight is below e^-50 ~ 2e-22, under float64's resolution of the sum.
    ``margin <= 0`` disables pruning (every call evaluates all pairs). Each run keeps its own
    schedule: while a refresh finds run r's pairs unchanged and every component it excludes
    at least ``FAR_GAP_MARGINS`` margins away, the interval to run r's next refresh doubles,
    up to ``MAX_REFRESH_GROWTH x refresh_every``; a change, or a component nearer than that,
    resets it, and a refresh evaluates the ``K`` components of the runs that are due only.
    The schedule is per run so that one run near a switch does not make every run
    re-evaluate all ``K`` components.

    The smallest gap of an excluded component seen at a refresh and the number of refreshes
    that changed the active set are kept in :meth:`report`, so a run whose components move
    closer than the margin is visible.
    """

    def __init__(self, stacked: StackedGaussians, client_of_component: torch.Tensor,
                 num_clients: int, prior_var: float, margin: float = 50.0,
                 refresh_every: int = 10) -> None:
        if refresh_every < 1:
            raise ValueError("refresh_every must be >= 1")
        self.stacked, self.num_clients, self.prior_var = stacked, num_clients, prior_var
        self.client = torch.as_tensor(client_of_component, device=stacked.device).long()
        # checked and formed once: a step then reads nothing back from the device
        self.log_weight, self.member = _client_weights(self.client, stacked, num_clients)
        #: the active (run, component) pairs of the last refresh, as index tensors
        self.pairs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.margin, self.refresh_every = float(margin), int(refresh_every)
        self.max_refresh_every = MAX_REFRESH_GROWTH * self.refresh_every
        #: per run ``[R]`` (on the CPU, formed at the first call): calls between its
        #: refreshes, and the call of its next one
        self.interval: torch.Tensor | None = None
        self.next_refresh: torch.Tensor | None = None
        self.active: torch.Tensor | None = None
        self.calls = self.refreshes = self.set_changes = self.runs_refreshed = 0
        #: the runs of the first call (before any :meth:`keep_runs`)
        self.num_runs = 0
        self.min_excluded_gap = math.inf
        self.active_pairs: list[int] = []

    def __call__(self, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        self.prepare(w)
        return self.evaluate(w)

    def prepare(self, w: Mapping[str, torch.Tensor]) -> bool:
        """Count a call and refresh the active pairs when due; True when the pairs that
        :meth:`evaluate` uses are new (a captured CUDA graph of it must be captured again)."""
        new = False
        if self.margin > 0:
            interval, next_refresh = self._schedule(self.stacked.num_points(w))
            due = next_refresh <= self.calls
            if bool(due.any()):
                new = self.refresh(w, due)
                self.next_refresh = torch.where(due, self.calls + interval, next_refresh)
        self.calls += 1
        return new

    def _schedule(self, num_runs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each run's refresh interval and next refresh call (formed at the first use)."""
        if self.interval is None or self.next_refresh is None:
            self.num_runs = num_runs
            self.interval = torch.full((num_runs,), self.refresh_every, dtype=torch.long)
            self.next_refresh = torch.zeros(num_runs, dtype=torch.long)
        return self.interval, self.next_refresh

    def evaluate(self, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Eq. 5 at ``w`` on the active pairs of the last refresh, reading nothing back from
        the device (so that it can be captured in a CUDA graph)."""
        if self.margin > 0:
            assert self.pairs is not None and self.active is not None
            log_dens = _scatter_pairs(self.stacked, w, self.pairs, tuple(self.active.shape))
        else:
            log_dens = self.stacked.log_density(w)
        return _log_posterior(log_dens, self.log_weight, self.member, w, self.stacked,
                              self.num_clients, self.prior_var)

    @torch.no_grad()
    def refresh(self, w: Mapping[str, torch.Tensor], due: torch.Tensor | None = None) -> bool:
        """Re-choose the active (run, component) pairs of the runs ``due`` (``[R]`` bool on
        the CPU; default: every run) at the current points ``w``, the other runs keeping
        theirs; True when the pairs differ from the last ones (or are the first)."""
        num_runs = self.stacked.num_points(w)
        if due is None:
            due = torch.ones(num_runs, dtype=torch.bool)
        rows = torch.nonzero(due).flatten()  # CPU
        every = len(rows) == num_runs
        idx = rows.to(self.stacked.device)
        points = {k: v.detach() if every else v.detach()[idx] for k, v in w.items()}
        weighted = self.stacked.log_density(points) + self.log_weight  # [r, K]
        per_client = torch.where(self.member, weighted[:, None, :], -math.inf)  # [r, C, K]
        best = per_client.max(dim=-1).values  # [r, C]
        gap = best[:, self.client] - weighted  # [r, K], >= 0
        fresh = gap <= self.margin
        nearest = torch.where(fresh, math.inf, gap).min(dim=1).values.cpu()  # [r]
        self.min_excluded_gap = min(self.min_excluded_gap, float(nearest.min()))
        if self.active is None:
            moved = torch.zeros(len(rows), dtype=torch.bool)
            active = torch.zeros(num_runs, len(self.client), dtype=torch.bool,
                                 device=fresh.device)
        else:
            moved = (fresh != self.active[idx]).any(dim=1).cpu()  # [r]
            active = self.active.clone()
        active[idx] = fresh
        changed = bool(moved.any())
        self.set_changes += changed
        # a run whose pairs are unchanged and whose nearest excluded member is far beyond the
        # margin: checked less often (doubling, up to MAX_REFRESH_GROWTH x); any change or a
        # close member: as often as refresh_every again
        interval, _ = self._schedule(num_runs)
        steady = (nearest >= FAR_GAP_MARGINS * self.margin) & ~moved
        interval[rows] = torch.where(
            steady, torch.clamp(2 * interval[rows], max=self.max_refresh_every),
            self.refresh_every)
        new = self.active is None or changed
        if new:  # unchanged pairs keep their tensors (a captured graph reads them)
            self.active = active
            self.pairs = torch.nonzero(active, as_tuple=True)
        self.refreshes += 1
        self.runs_refreshed += len(rows)
        self.active_pairs.append(int(active.sum()))
        return new

    def keep_runs(self, rows: Sequence[int]) -> None:
        """Keep the per-run state (refresh schedule, active pairs) of the runs ``rows`` only,
        in that order: the optimiser drops runs that stopped, and each run's pairs are its
        own, so the runs kept are evaluated exactly as before."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        if self.interval is not None and self.next_refresh is not None:
            self.interval, self.next_refresh = self.interval[index], self.next_refresh[index]
        if self.active is not None:
            self.active = self.active[index.to(self.active.device)]
            self.pairs = torch.nonzero(self.active, as_tuple=True)

    def report(self) -> dict[str, float | int | list[int]]:
        return {"prune_margin": self.margin, "refresh_every": self.refresh_every,
                "max_refresh_every": self.max_refresh_every,
                "refreshes": self.refreshes, "active_set_changes": self.set_changes,
                "runs_refreshed": self.runs_refreshed,
                "min_excluded_gap_nats": self.min_excluded_gap,
                "active_pairs": sorted(set(self.active_pairs)),
                "all_pairs": int(self.client.numel()) * self.num_runs}
