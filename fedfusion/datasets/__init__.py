"""Datasets as normalised in-memory tensors, and partitioners that split them among clients."""

from fedfusion.datasets.loading import (
    DATA_DIR_ENV,
    DATASETS,
    DatasetBundle,
    DatasetNotFoundError,
    ImageData,
    channel_stats,
    holdout_indices,
    load_dataset,
    read_idx,
)
from fedfusion.datasets.partition import (
    PARTITIONERS,
    PartitionError,
    class_histogram,
    partition_indices,
)

__all__ = [
    "DATASETS",
    "DATA_DIR_ENV",
    "PARTITIONERS",
    "DatasetBundle",
    "DatasetNotFoundError",
    "ImageData",
    "PartitionError",
    "channel_stats",
    "class_histogram",
    "holdout_indices",
    "load_dataset",
    "partition_indices",
    "read_idx",
]
