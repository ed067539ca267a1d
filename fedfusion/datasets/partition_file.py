"""Bring-your-own partition: per-client row indices (and optional validation rows) from a file.

Two formats, chosen by the file's suffix:

* ``.npz`` -- one int array per client, ``client0``, ``client1``, ..., and optionally ``val``;
  with a ``key`` (a group, e.g. ``C5_a0.05``) the names are ``{key}/client{i}`` and
  ``{key}/val``. Loaded with ``allow_pickle=False``.
* ``.json`` -- ``{"clients": [[rows...], ...], "val": [rows...]}`` (``val`` optional); with a
  ``key``, that object sits under ``{key: {...}}``.

Rows index the dataset's full training set in its original order (for Fashion-MNIST and
MNIST: the order of the IDX file). Client rows keep the file's order; validation rows may
repeat and may overlap the clients' (the FedBEns authors draw them with replacement from
the clients' data), everything else is checked: integer rows in range, no row held by two
clients, no empty client, exactly ``num_clients`` clients. The file's SHA-256 identifies it
in results and replay manifests.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedfusion.datasets.partition import PartitionError

#: a partition file larger than this is refused unread (60,000 rows as JSON are ~0.4 MB)
MAX_PARTITION_FILE_BYTES = 1 << 30
_CLIENT_NAME = re.compile(r"client(\d+)")


@dataclass(frozen=True)
class PartitionFile:
    """The validated content of a partition file."""

    clients: list[np.ndarray]  # per client, int64 rows of the training set, the file's order
    val: np.ndarray | None  # int64 validation rows (may repeat), or None if the file has none
    sha256: str  # of the file's bytes

    def val_overlap(self) -> int:
        """How many distinct validation rows some client also holds."""
        if self.val is None:
            return 0
        return int(np.isin(np.unique(self.val), np.concatenate(self.clients)).sum())


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_partition_file(path: str | Path, num_rows: int, num_clients: int, key: str = ""
                        ) -> PartitionFile:
    """Read and validate the partition in ``path`` for a training set of ``num_rows`` rows.

    Raises :class:`PartitionError` naming the file (and the client) for every defect.
    """
    path = Path(path).expanduser()
    where = f"partition file {str(path)!r}" + (f" (key {key!r})" if key else "")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise PartitionError(f"{where} cannot be read: {exc.strerror or exc}") from exc
    if size > MAX_PARTITION_FILE_BYTES:
        raise PartitionError(f"{where} is {size} bytes, over the {MAX_PARTITION_FILE_BYTES} "
                             "byte limit")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            named = _read_npz(path, key, where)
        elif suffix == ".json":
            named = _read_json(path, key, where)
        else:
            raise PartitionError(f"{where}: unknown format {suffix!r}; use .npz or .json")
    except PartitionError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise PartitionError(f"{where} is not a readable {suffix} file: {exc}") from exc
    clients_raw, val_raw = named
    if len(clients_raw) != num_clients:
        raise PartitionError(f"{where} holds {len(clients_raw)} client(s) but num-clients is "
                             f"{num_clients}")
    clients = [_rows(rows, num_rows, f"{where}: client {c}") for c, rows in
               enumerate(clients_raw)]
    for client, rows in enumerate(clients):
        if rows.size == 0:
            raise PartitionError(f"{where}: client {client} holds no rows")
        if np.unique(rows).size != rows.size:
            raise PartitionError(f"{where}: client {client} lists a row more than once")
    owner = np.full(num_rows, -1, dtype=np.int64)
    for client, rows in enumerate(clients):
        taken = owner[rows] >= 0
        if taken.any():
            row = int(rows[np.argmax(taken)])
            raise PartitionError(f"{where}: row {row} is held by client {int(owner[row])} and "
                                 f"client {client}; a row may belong to one client only")
        owner[rows] = client
    val = None if val_raw is None else _rows(val_raw, num_rows, f"{where}: val")
    if val is not None and val.size == 0:
        raise PartitionError(f"{where}: 'val' is empty; leave it out instead")
    return PartitionFile(clients, val, file_sha256(path))


def write_partition_file(path: str | Path, clients: Sequence[Sequence[int] | np.ndarray],
                         val: Sequence[int] | np.ndarray | None = None, key: str = "") -> str:
    """Write ``clients`` (and ``val``) in the format of ``path``'s suffix; return its SHA-256."""
    path = Path(path)
    prefix = f"{key}/" if key else ""
    if path.suffix.lower() == ".npz":
        arrays = {f"{prefix}client{c}": np.asarray(rows, dtype=np.int64)
                  for c, rows in enumerate(clients)}
        if val is not None:
            arrays[f"{prefix}val"] = np.asarray(val, dtype=np.int64)
        with open(path, "wb") as handle:  # np.savez would append .npz to another suffix
            np.savez(handle, **arrays)
    elif path.suffix.lower() == ".json":
        content: dict = {"clients": [np.asarray(r, dtype=np.int64).tolist() for r in clients]}
        if val is not None:
            content["val"] = np.asarray(val, dtype=np.int64).tolist()
        path.write_text(json.dumps({key: content} if key else content))
    else:
        raise ValueError(f"unknown partition file format {path.suffix!r}; use .npz or .json")
    return file_sha256(path)


def _read_npz(path: Path, key: str, where: str) -> tuple[list[object], object | None]:
    prefix = f"{key}/" if key else ""
    loaded = np.load(path, allow_pickle=False)
    if not isinstance(loaded, np.lib.npyio.NpzFile):  # a bare .npy under an .npz name
        raise PartitionError(f"{where} is not an .npz archive (np.savez writes one)")
    with loaded as archive:
        names = [n for n in archive.files if n.startswith(prefix)]
        found = {}
        for name in names:
            match = _CLIENT_NAME.fullmatch(name[len(prefix):])
            if match:
                found[int(match.group(1))] = name
        if not found:
            groups = sorted({n.rsplit("/", 1)[0] for n in archive.files if "/" in n})
            hint = (f"; its groups are {', '.join(groups[:20])} (set partition-key)"
                    if groups else "")
            raise PartitionError(f"{where} holds no arrays named {prefix}client<i>{hint}")
        if sorted(found) != list(range(len(found))):
            raise PartitionError(f"{where}: client arrays must be numbered 0..{len(found) - 1}, "
                                 f"found {sorted(found)[:20]}")
        clients = [archive[found[c]] for c in range(len(found))]
        val = archive[f"{prefix}val"] if f"{prefix}val" in archive.files else None
    return clients, val


def _read_json(path: Path, key: str, where: str) -> tuple[list[object], object | None]:
    content = json.loads(path.read_bytes())
    if key:
        if not isinstance(content, dict) or key not in content:
            keys = sorted(content)[:20] if isinstance(content, dict) else []
            raise PartitionError(f"{where} has no key {key!r}" +
                                 (f"; it has {', '.join(map(str, keys))}" if keys else ""))
        content = content[key]
    if not isinstance(content, dict) or not isinstance(content.get("clients"), list):
        raise PartitionError(f"{where} must hold an object with a list 'clients' (one list of "
                             "rows per client) and optionally 'val'")
    unknown = sorted(set(content) - {"clients", "val"})
    if unknown:
        raise PartitionError(f"{where} has unknown field(s) {unknown}; use 'clients' and 'val'")
    return content["clients"], content.get("val")


def _rows(values: object, num_rows: int, where: str) -> np.ndarray:
    """``values`` as a 1-D int64 array of rows in ``[0, num_rows)``, or PartitionError."""
    if isinstance(values, np.ndarray):
        array = values
    else:
        if not isinstance(values, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise PartitionError(f"{where} must be a list of integer rows")
        # checked as Python ints: a huge row would overflow int64
        if values and (min(values) < 0 or max(values) >= num_rows):
            bad = next(v for v in values if not 0 <= v < num_rows)
            raise PartitionError(f"{where}: row {bad} is outside the training set's "
                                 f"0..{num_rows - 1}")
        array = np.asarray(values, dtype=np.int64)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise PartitionError(f"{where} must be a 1-D integer array, got {array.dtype} "
                             f"{array.shape}")
    array = array.astype(np.int64, copy=False)
    if array.size and (array.min() < 0 or array.max() >= num_rows):
        bad = int(array[(array < 0) | (array >= num_rows)][0])
        raise PartitionError(f"{where}: row {bad} is outside the training set's "
                             f"0..{num_rows - 1}")
    return array
