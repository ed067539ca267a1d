"""Who holds what: the federation's data split, rebuilt identically in every process.

The server (for the class histogram and evaluation) and every ClientApp (in its own Ray
actor or SuperNode) call :func:`federated_split` with the same settings and get the same
partition: loading, the validation holdout, the optional training subset and the
partitioner are all functions of the data seed (``split-seed``, or ``seed`` when it is -1).

With ``partition-file`` the clients' rows come from that file instead
(:mod:`fedfusion.datasets.partition_file`), and the server validates on
``val-source``: ``holdout`` (the default) draws ``val-size`` rows that no client holds,
``file`` takes the file's own validation rows (which may overlap the clients' data; the
results then say how many do).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from fedfusion.app.config import ConfigError, Settings
from fedfusion.datasets import (
    DatasetBundle,
    ImageData,
    class_histogram,
    load_dataset,
    partition_indices,
)
from fedfusion.datasets.partition_file import read_partition_file


def holdout_split(num_rows: int, fraction: float, seed: int, client_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, held-out rows) of a client's ``num_rows``: ``floor(fraction * n)``
    rows drawn by a generator of (seed, client) held out, so every round and process of a
    run holds out the same rows (FENS trains its aggregator on them). ``fraction`` comes
    from the server's train config (``holdout-fraction``): outside [0, 1) is a ValueError."""
    if not 0 <= fraction < 1:  # NaN too: every row held out, or rows trained on and held out
        raise ValueError(f"the train config's 'holdout-fraction' must be in [0, 1), got "
                         f"{fraction!r}")
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(
        (seed * 1_000_003 + client_id * 7919 + 17) % 2**62))
    held = int(fraction * num_rows)
    return order[held:].sort().values, order[:held].sort().values


@dataclass(frozen=True)
class FederatedSplit:
    bundle: DatasetBundle
    pool: np.ndarray  # rows of bundle.train available to clients (all, or the train-subset)
    client_indices: list[np.ndarray]  # per client, rows of bundle.train
    histogram: np.ndarray  # [num_clients, num_classes]
    partition_sha256: str = ""  # of the partition file, "" without one
    val_overlap: int = 0  # distinct validation rows that some client also holds

    def describe(self) -> dict:
        """What results.json records of the split."""
        return {"histogram": self.histogram.tolist(),
                "sizes": [len(i) for i in self.client_indices],
                **({"file_sha256": self.partition_sha256,
                    "val_rows": len(self.bundle.val),
                    "val_overlap_with_clients": self.val_overlap}
                   if self.partition_sha256 else {})}

    def client_data(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= client_id < len(self.client_indices):
            raise ValueError(
                f"client {client_id} is outside 0..{len(self.client_indices) - 1}; "
                "does num-clients match the number of SuperNodes?"
            )
        rows = torch.from_numpy(self.client_indices[client_id])
        return self.bundle.train.x[rows], self.bundle.train.y[rows]


def federated_split(settings: Settings) -> FederatedSplit:
    """The split of ``settings`` (cached per process on the fields that determine it)."""
    if settings.partition_file:
        split = _file_split(settings.dataset, settings.data_dir or None, settings.val_size,
                            settings.val_source, settings.partition_file,
                            settings.partition_key, settings.num_clients, settings.data_seed,
                            settings.parsed_input_stats(), _file_identity(settings.partition_file))
        if settings.partition_sha256 and split.partition_sha256 != settings.partition_sha256:
            raise ConfigError(
                f"partition file {settings.partition_file!r} has SHA-256 "
                f"{split.partition_sha256[:16]}... but the run expects "
                f"{settings.partition_sha256[:16]}... (partition-sha256): this copy differs "
                "from the server's, or the file changed since the run (or its uploads) began")
        return split
    return _split(settings.dataset, settings.data_dir or None, settings.val_size,
                  settings.train_subset, settings.partitioner, settings.alpha,
                  settings.parsed_labels_per_client(), settings.parsed_fractions(),
                  settings.min_samples,
                  settings.num_clients, settings.data_seed, settings.parsed_input_stats())


def client_for_partition(settings: Settings, partition_id: int) -> int:
    """The client that simulation node ``partition_id`` trains under
    ``largest-client-first``: the clients in decreasing size (ties: lower id first), so
    partition 0 trains the largest.

    Flower's simulation engine hands the nodes' messages to its workers in partition order.
    With uneven clients and fewer workers than clients, starting the largest first (longest
    processing time first) shortens the client phase: the authors' setting (5 Dirichlet-0.1
    FMNIST clients of 9.7k-17.9k samples on 2 workers) then ends after 31.4k samples on the
    busiest worker instead of 38.6k in id order. The data partitions are virtual (every
    process derives the same split), so this only changes which node trains which client;
    uploads carry the client id. On real SuperNodes ``partition-id`` names the node's own
    data, so the flag must stay off there (``scripts/deploy_tools.py`` refuses it).
    Out-of-range ids are returned as they are (the split reports them)."""
    sizes = [len(rows) for rows in federated_split(settings).client_indices]
    if not 0 <= partition_id < len(sizes):
        return partition_id
    return sorted(range(len(sizes)), key=lambda c: (-sizes[c], c))[partition_id]


@functools.lru_cache(maxsize=4)
def _split(dataset: str, data_dir: str | None, val_size: int, train_subset: int,
           partitioner: str, alpha: float, labels_per_client: tuple[int, int],
           fractions: tuple[float, ...] | None, min_samples: int, num_clients: int,
           seed: int, stats: tuple | None = None) -> FederatedSplit:
    bundle = load_dataset(dataset, data_dir=data_dir, val_size=val_size, seed=seed, stats=stats)
    labels = bundle.train.y.numpy()
    pool = np.arange(len(labels))
    if train_subset:
        rng = np.random.default_rng([seed, 1])  # a stream of its own, apart from the holdout's
        pool = np.sort(rng.permutation(len(labels))[: min(train_subset, len(labels))])
    parts = partition_indices(
        labels[pool], partitioner, num_clients, seed, alpha=alpha,
        labels_per_client=labels_per_client, fractions=fractions, min_samples=min_samples,
    )
    client_indices = [pool[p] for p in parts]
    return FederatedSplit(bundle, pool, client_indices,
                          class_histogram(labels, client_indices, bundle.num_classes))


def _file_identity(path: str) -> tuple:
    try:
        stat = os.stat(os.path.expanduser(path))
    except OSError:
        return ()  # read_partition_file names the problem
    return (stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=4)
def _file_split(dataset: str, data_dir: str | None, val_size: int, val_source: str,
                path: str, key: str, num_clients: int, seed: int,
                stats: tuple | None, identity: tuple) -> FederatedSplit:
    """(``identity``: the file's size, mtime and inode, so that a changed file is read
    again.)"""
    # rows in the file index the full training set: load it without a holdout
    full = load_dataset(dataset, data_dir=data_dir, val_size=0, seed=seed, stats=stats)
    part = read_partition_file(path, len(full.train), num_clients, key)
    if val_source == "file":
        if part.val is None:
            raise ConfigError(f"val-source='file' but partition file {path!r}"
                              + (f" (key {key!r})" if key else "") + " holds no validation rows")
        val_rows = part.val
    else:
        free = np.setdiff1d(np.arange(len(full.train)), np.concatenate(part.clients))
        if len(free) < val_size:
            raise ConfigError(
                f"partition file {path!r} leaves {len(free)} training rows to no client, fewer "
                f"than the val-size={val_size} rows the server holds out for validation: set "
                "val-source='file' (the file's validation rows), a smaller val-size, or "
                "val-size=0 (no validation)")
        rng = np.random.default_rng([seed, 2])  # a stream apart from the holdout's and subset's
        val_rows = np.sort(rng.choice(free, size=val_size, replace=False))
    rows = torch.from_numpy(val_rows)
    bundle = dataclasses.replace(full, val=ImageData(full.train.x[rows], full.train.y[rows]),
                                 val_indices=val_rows)
    overlap = part.val_overlap() if val_source == "file" else 0
    return FederatedSplit(bundle, np.arange(len(full.train)), part.clients,
                          class_histogram(full.train.y.numpy(), part.clients, full.num_classes),
                          part.sha256, overlap)
