"""Split a labelled training pool among federated clients.

Every scheme is a pure function of ``(labels, scheme, num_clients, seed, options)``
driven by ``np.random.default_rng(seed)``, so each Flower client process can compute
the same split on its own and take its part. Parts are sorted int64 row indices into
``labels``; they are disjoint.

Schemes (:data:`PARTITIONERS`):

* ``dirichlet`` -- FedBEns / FedFisher: each client draws a label distribution
  ``q_c ~ Dir(alpha * 1_K)``; class ``k`` is shuffled and split among clients in
  proportion to ``q[c, k] / sum_c q[c, k]``. Redrawn until every client holds at
  least ``min_samples`` samples.
* ``flwr-dirichlet`` -- Flower Datasets' ``DirichletPartitioner`` (needs the
  ``flwr-datasets`` package).
* ``hetero-label`` -- AMS: each client holds ``k ~ U{lo..hi}`` random labels; each
  class is split evenly among the clients holding it (unchosen classes are unused).
* ``iid`` -- shuffle, then equal parts.
* ``fractions`` -- shuffle, then parts of the given relative sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedfusion.constraints import FINITE_POSITIVE

PARTITIONERS = ("dirichlet", "flwr-dirichlet", "hetero-label", "iid", "fractions")


class PartitionError(ValueError):
    """The requested split is invalid or could not be produced."""


def partition_indices(
    labels: np.ndarray,
    scheme: str,
    num_clients: int,
    seed: int,
    *,
    alpha: float = 0.1,
    labels_per_client: tuple[int, int] = (3, 6),
    fractions: Sequence[float] | None = None,
    min_samples: int = 10,
    max_retries: int = 100,
) -> list[np.ndarray]:
    """Split ``range(len(labels))`` among ``num_clients`` clients with ``scheme``.

    ``alpha`` and ``min_samples`` apply to the Dirichlet schemes (``max_retries`` only to
    ``dirichlet``; Flower's partitioner retries 10 times itself), ``labels_per_client`` to
    ``hetero-label`` and ``fractions`` to ``fractions``. The other schemes require every
    client to get at least one sample. Returns one sorted int64 index array per client.
    """
    if scheme not in PARTITIONERS:
        raise PartitionError(
            f"unknown partition scheme {scheme!r}; choose one of {', '.join(PARTITIONERS)}"
        )
    if num_clients < 1:
        raise PartitionError(f"num_clients must be >= 1, got {num_clients}")
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise PartitionError(
            f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}"
        )
    rng = np.random.default_rng(seed)

    if scheme == "dirichlet":
        parts = _dirichlet(labels, num_clients, rng, alpha, min_samples, max_retries)
    elif scheme == "flwr-dirichlet":
        parts = _flwr_dirichlet(labels, num_clients, seed, alpha, min_samples)
    else:
        if scheme == "hetero-label":
            parts = _hetero_label(labels, num_clients, rng, labels_per_client)
        elif scheme == "iid":
            parts = np.array_split(rng.permutation(len(labels)), num_clients)
        else:
            parts = _split_by_sizes(
                rng.permutation(len(labels)), _fraction_sizes(fractions, num_clients, len(labels))
            )
        _require_nonempty(parts, scheme)
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


def class_histogram(
    labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int
) -> np.ndarray:
    """Count each class on each client: int64 ``[len(parts), num_classes]``."""
    labels = np.asarray(labels)
    if labels.size and not 0 <= labels.min() <= labels.max() < num_classes:
        raise ValueError(f"labels fall outside [0, {num_classes})")
    histogram = np.zeros((len(parts), num_classes), dtype=np.int64)
    for client, part in enumerate(parts):
        histogram[client] = np.bincount(labels[part], minlength=num_classes)
    return histogram


# --- schemes -------------------------------------------------------------------------


def _split_by_sizes(indices: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """Cut ``indices`` into consecutive chunks of the given sizes."""
    return np.split(indices, np.cumsum(sizes)[:-1])


def _require_nonempty(parts: Sequence[np.ndarray], scheme: str) -> None:
    """A client without data cannot train: reject such splits with a clear message."""
    for client, part in enumerate(parts):
        if len(part) == 0:
            raise PartitionError(
                f"{scheme} split gives client {client} no samples; use fewer clients"
            )


def _log_dirichlet_rows(
    rng: np.random.Generator, alpha: float, shape: tuple[int, int]
) -> np.ndarray:
    """Log of ``shape[0]`` draws from ``Dir(alpha * 1_K)``, exact even for tiny ``alpha``.

    ``Gamma(alpha) = Gamma(alpha + 1) * U ** (1 / alpha)``, so its log is finite even
    when the gamma variate itself underflows to 0 (alpha ~ 5**-4). Working in log space
    means class columns of ``q`` never sum to 0, and no floor or fallback is needed.
    """
    log_gamma = np.log(rng.standard_gamma(alpha + 1.0, size=shape))
    log_gamma += np.log(1.0 - rng.random(size=shape)) / alpha  # 1 - U lies in (0, 1]
    return log_gamma - _logsumexp(log_gamma, axis=1)


def _logsumexp(values: np.ndarray, axis: int) -> np.ndarray:
    """``log(sum(exp(values)))`` along ``axis`` (kept as a size-1 axis), without overflow."""
    peak = values.max(axis=axis, keepdims=True)
    return peak + np.log(np.exp(values - peak).sum(axis=axis, keepdims=True))


def _dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    min_samples: int,
    max_retries: int,
) -> list[np.ndarray]:
    """FedBEns / FedFisher Dirichlet split, redrawn until every client has ``min_samples``."""
    FINITE_POSITIVE.check("alpha", alpha, PartitionError)
    if num_clients * min_samples > len(labels):
        raise PartitionError(
            f"{num_clients} clients x min_samples={min_samples} exceeds the "
            f"{len(labels)} samples available; use fewer clients or a smaller min_samples"
        )
    classes = np.unique(labels)
    class_members = [np.flatnonzero(labels == k) for k in classes]
    smallest = (0, 0)
    for _ in range(max_retries + 1):
        log_q = _log_dirichlet_rows(rng, alpha, (num_clients, len(classes)))
        # share of class k going to client c: q[c, k] / sum_c q[c, k], computed in log space
        shares = np.exp(log_q - _logsumexp(log_q, axis=0))
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for k, members in enumerate(class_members):
            shuffled = rng.permutation(members)
            cuts = (np.cumsum(shares[:, k]) * len(shuffled)).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(shuffled, cuts)):
                parts[client].append(chunk)
        merged = [np.concatenate(chunks) for chunks in parts]
        sizes = [len(part) for part in merged]
        if min(sizes) >= min_samples:
            return merged
        smallest = (int(np.argmin(sizes)), min(sizes))
    raise PartitionError(
        f"dirichlet split (alpha={alpha}) left client {smallest[0]} with {smallest[1]} "
        f"samples < min_samples={min_samples} after {max_retries + 1} draws; use a larger "
        "alpha, fewer clients or a smaller min_samples"
    )


def _flwr_dirichlet(
    labels: np.ndarray, num_clients: int, seed: int, alpha: float, min_samples: int
) -> list[np.ndarray]:
    """Flower Datasets' DirichletPartitioner on a one-column ``label`` dataset."""
    try:
        from datasets import Dataset
        from flwr_datasets.partitioner import DirichletPartitioner
    except ImportError as err:
        raise ImportError(
            "the 'flwr-dirichlet' scheme needs Flower Datasets: pip install flwr-datasets"
        ) from err
    try:
        partitioner = DirichletPartitioner(
            num_partitions=num_clients,
            partition_by="label",
            alpha=float(alpha),
            min_partition_size=min_samples,
            seed=seed,
        )
        # The row-number column lets us read back which rows each partition selected.
        partitioner.dataset = Dataset.from_dict(
            {"label": labels.tolist(), "row": np.arange(len(labels)).tolist()}
        )
        return [
            np.asarray(partitioner.load_partition(client)["row"], dtype=np.int64)
            for client in range(num_clients)
        ]
    except ValueError as err:
        raise PartitionError(f"flwr-dirichlet split failed: {err}") from err


def _hetero_label(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    labels_per_client: tuple[int, int],
) -> list[np.ndarray]:
    """AMS split: client c holds k_c ~ U{lo..hi} random classes, each shared evenly."""
    classes = np.unique(labels)
    low, high = labels_per_client
    if not 1 <= low <= high <= len(classes):
        raise PartitionError(
            f"labels_per_client={labels_per_client} must satisfy 1 <= lo <= hi <= "
            f"{len(classes)} (the number of classes present)"
        )
    held = [
        set(rng.choice(classes, size=int(rng.integers(low, high + 1)), replace=False).tolist())
        for _ in range(num_clients)
    ]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k in classes.tolist():
        holders = [client for client in range(num_clients) if k in held[client]]
        if not holders:
            continue
        members = rng.permutation(np.flatnonzero(labels == k))
        for client, chunk in zip(holders, np.array_split(members, len(holders)), strict=True):
            parts[client].append(chunk)
    return [np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64) for chunks in parts]


def _fraction_sizes(fractions: Sequence[float] | None, num_clients: int, total: int) -> list[int]:
    """Integer part sizes for ``fractions`` of ``total``, each within 1 of ``f * total``.

    Floors first, then hands the leftover samples to the largest remainders.
    """
    if fractions is None:
        raise PartitionError("the 'fractions' scheme needs fractions=[...], one per client")
    values = np.asarray(fractions, dtype=np.float64)
    if values.shape != (num_clients,):
        raise PartitionError(f"fractions has {values.size} entries but num_clients={num_clients}")
    if not np.all(values > 0):
        raise PartitionError(f"fractions must all be positive, got {list(fractions)}")
    if abs(values.sum() - 1.0) > 1e-6:
        raise PartitionError(f"fractions must sum to 1, got sum {values.sum():.6g}")
    exact = values * total
    sizes = np.floor(exact).astype(np.int64)
    leftover = total - int(sizes.sum())
    sizes[np.argsort(-(exact - sizes), kind="stable")[:leftover]] += 1
    return sizes.tolist()
