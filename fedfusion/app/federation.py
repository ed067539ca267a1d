"""Who holds what: the federation's data split, rebuilt identically in every process.

The server (for the class histogram and evaluation) and every ClientApp (in its own Ray
actor or SuperNode) call :func:`federated_split` with the same settings and get the same
partition: loading, the validation holdout, the optional training subset and the
partitioner are all functions of the data seed (``split-seed``, or ``seed`` when it is -1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from fedfusion.app.config import Settings
from fedfusion.datasets import DatasetBundle, class_histogram, load_dataset, partition_indices


@dataclass(frozen=True)
class FederatedSplit:
    bundle: DatasetBundle
    pool: np.ndarray  # rows of bundle.train available to clients (all, or the train-subset)
    client_indices: list[np.ndarray]  # per client, rows of bundle.train
    histogram: np.ndarray  # [num_clients, num_classes]

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
    return _split(settings.dataset, settings.data_dir or None, settings.val_size,
                  settings.train_subset, settings.partitioner, settings.alpha,
                  settings.parsed_labels_per_client(), settings.parsed_fractions(),
                  settings.min_samples,
                  settings.num_clients, settings.data_seed)


@functools.lru_cache(maxsize=4)
def _split(dataset: str, data_dir: str | None, val_size: int, train_subset: int,
           partitioner: str, alpha: float, labels_per_client: tuple[int, int],
           fractions: tuple[float, ...] | None, min_samples: int, num_clients: int,
           seed: int) -> FederatedSplit:
    bundle = load_dataset(dataset, data_dir=data_dir, val_size=val_size, seed=seed)
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


def client_for_partition(settings: Settings, partition_id: int) -> int:
    """The client a node with ``partition-id`` ``partition_id`` trains: the clients in
    decreasing size (ties: lower id first), so partition 0 trains the largest.

    Flower's simulation hands the nodes' messages to its workers in partition order; with
    uneven clients and fewer workers than clients, starting the largest first (longest
    processing time first) shortens the client phase: the authors' setting (5 Dirichlet-0.1
    FMNIST clients of 9.7k-17.9k samples on 2 workers) finishes its clients' work after 31.4k
    samples of the busiest worker instead of 38.6k in id order (~18% sooner). The data
    partitions are virtual (every process derives the same split), so this only relabels which
    node trains which client; uploads carry the client id. Out-of-range ids are returned as
    they are (the split reports them)."""
    sizes = [len(rows) for rows in federated_split(settings).client_indices]
    if not 0 <= partition_id < len(sizes):
        return partition_id
    return sorted(range(len(sizes)), key=lambda c: (-sizes[c], c))[partition_id]
