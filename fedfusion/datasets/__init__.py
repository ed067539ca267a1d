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
from fedfusion.datasets.local_file import (
    LocalData,
    LocalDataError,
    read_local_data,
    write_local_data,
)
from fedfusion.datasets.partition import (
    PARTITIONERS,
    PartitionError,
    class_histogram,
    partition_indices,
)
from fedfusion.datasets.partition_file import (
    PartitionFile,
    read_partition_file,
    write_partition_file,
)

__all__ = [
    "DATASETS",
    "DATA_DIR_ENV",
    "PARTITIONERS",
    "DatasetBundle",
    "DatasetNotFoundError",
    "ImageData",
    "LocalData",
    "LocalDataError",
    "PartitionError",
    "PartitionFile",
    "channel_stats",
    "class_histogram",
    "holdout_indices",
    "load_dataset",
    "partition_indices",
    "read_idx",
    "read_local_data",
    "read_partition_file",
    "write_local_data",
    "write_partition_file",
]
