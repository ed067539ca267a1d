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

The reader's work is bounded by the training set, not by the file: an ``.npz``'s zip directory
is capped before :mod:`zipfile` parses it, and every array's ``.npy`` header (read from its zip
member without inflating the data) must declare at most ``num_rows`` rows -- and the clients
together at most ``num_rows`` -- before any array is inflated or converted; a ``.json`` list is
measured the same way before it becomes an array. Every defect, a failed allocation included,
is a :class:`PartitionError`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedfusion.datasets.partition import PartitionError
from fedfusion.files import read_capped, regular_file_size
from fedfusion.wire.npy import (
    NPZ_READ_ERRORS,
    ZIP_COMPRESSIONS,
    NpyLayout,
    npy_layout,
    read_npy,
    zip_directory_bytes,
)
from fedfusion.wire.validation import json_depth

#: a partition file larger than this is refused unread (60,000 rows as JSON are ~0.4 MB)
MAX_PARTITION_FILE_BYTES = 1 << 30
#: the arrays an ``.npz`` partition reads may declare at most this many uncompressed bytes
#: (zip and ``.npy`` headers are checked against it before anything is inflated)
MAX_PARTITION_ARRAY_BYTES = 1 << 30
#: an ``.npz``'s zip central directory larger than this is refused before :mod:`zipfile` turns
#: it into one object per entry (about 10,000 arrays as np.savez names them; the FedBEns
#: authors' 141-array file has 12 KB; 16 MiB of empty names would take ~8 s and ~200 MB)
MAX_PARTITION_DIRECTORY_BYTES = 1 << 20
#: a ``.json`` partition larger than this is refused unread (about 2 million rows; larger
#: partitions belong in an ``.npz``): parsing holds ~5x the text as Python objects
MAX_PARTITION_JSON_BYTES = 16 << 20
#: JSON nesting deeper than this is refused before parsing (a partition nests 3 levels, 4
#: under a key; deep nesting makes the parser recurse until RecursionError)
MAX_PARTITION_JSON_DEPTH = 8
#: the scalar types a partition's row arrays may have in their ``.npy`` headers
_ROW_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
               np.uint64, np.float16, np.float32, np.float64, np.bool_)
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
        size = regular_file_size(path)
    except OSError as exc:
        raise PartitionError(f"{where} cannot be read: {exc.strerror or exc}") from exc
    except ValueError as exc:  # a FIFO would block the run, /dev/zero never end
        raise PartitionError(f"{where} {exc}") from exc
    if size > MAX_PARTITION_FILE_BYTES:
        raise PartitionError(f"{where} is {size} bytes, over the {MAX_PARTITION_FILE_BYTES} "
                             "byte limit")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            named = _read_npz(path, key, where, num_rows, num_clients)
        elif suffix == ".json":
            named = _read_json(path, key, where)
        else:
            raise PartitionError(f"{where}: unknown format {suffix!r}; use .npz or .json")
    except PartitionError:
        raise
    except (*NPZ_READ_ERRORS, RecursionError,
            MemoryError, OverflowError) as exc:  # the last three only if a check missed a case
        raise PartitionError(f"{where} is not a readable {suffix} file: "
                             f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    try:
        return _validated(path, where, *named, num_rows, num_clients)
    except PartitionError:
        raise
    except (ValueError, MemoryError, OverflowError) as exc:  # only if a bound above missed one
        raise PartitionError(f"{where} could not be checked: {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from exc


def _validated(path: Path, where: str, clients_raw: list[object], val_raw: object | None,
               num_rows: int, num_clients: int) -> PartitionFile:
    if len(clients_raw) != num_clients:
        raise PartitionError(f"{where} holds {len(clients_raw)} client(s) but num-clients is "
                             f"{num_clients}")
    counts = [_count(rows) for rows in clients_raw]  # measured before anything is converted
    for client, count in enumerate(counts):
        if count > num_rows:
            raise PartitionError(f"{where}: client {client} lists {count} rows, more than the "
                                 f"training set's {num_rows}")
    if sum(counts) > num_rows:
        raise PartitionError(f"{where}: its clients list {sum(counts)} rows in all, more than "
                             f"the training set's {num_rows} (a row belongs to one client)")
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


def _read_npz(path: Path, key: str, where: str, num_rows: int, num_clients: int
              ) -> tuple[list[object], object | None]:
    """The client (and val) arrays of an ``.npz``: the zip directory's size is capped before
    it is parsed; every needed member's zip entry and ``.npy`` header is checked (compression,
    declared sizes, dtype, shape against data bytes, rows against ``num_rows``) before any
    array is read, and their declared total is capped."""
    prefix = f"{key}/" if key else ""
    with open(path, "rb") as handle:
        if not zipfile.is_zipfile(handle):  # e.g. a bare .npy under an .npz name
            raise PartitionError(f"{where} is not an .npz archive (np.savez writes one)")
        directory = zip_directory_bytes(handle)
        if directory > MAX_PARTITION_DIRECTORY_BYTES:
            raise PartitionError(f"{where}: its zip directory declares {directory} bytes, over "
                                 f"the {MAX_PARTITION_DIRECTORY_BYTES} byte limit of a "
                                 "partition file; not parsed")
    with zipfile.ZipFile(path) as archive:
        infos = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
        found = {}
        for name in infos:
            match = _CLIENT_NAME.fullmatch(name[len(prefix):]) if name.startswith(
                prefix) else None
            if match:
                first = found.setdefault(int(match.group(1)), name)
                if first != name:  # "client1" and "client01": which would be client 1?
                    raise PartitionError(f"{where} holds two arrays for client "
                                         f"{int(match.group(1))}: {first!r} and {name!r}")
        if not found:
            groups = sorted({n.rsplit("/", 1)[0] for n in infos if "/" in n})
            hint = (f"; its groups are {', '.join(groups[:20])} (set partition-key)"
                    if groups else "")
            raise PartitionError(f"{where} holds no arrays named {prefix}client<i>{hint}")
        if sorted(found) != list(range(len(found))):
            raise PartitionError(f"{where}: client arrays must be numbered 0..{len(found) - 1}, "
                                 f"found {sorted(found)[:20]}")
        if len(found) != num_clients:
            raise PartitionError(f"{where} holds {len(found)} client(s) but num-clients is "
                                 f"{num_clients}")
        names = [found[c] for c in range(len(found))]
        if f"{prefix}val" in infos:
            names.append(f"{prefix}val")
        declared = sum(infos[name].file_size for name in names)
        if declared > MAX_PARTITION_ARRAY_BYTES:
            raise PartitionError(f"{where}: its arrays declare {declared} uncompressed bytes in "
                                 f"the zip headers, over the {MAX_PARTITION_ARRAY_BYTES} byte "
                                 "limit; not inflated")
        layouts = []
        for name in names:  # every header first: nothing is inflated beyond them
            info = infos[name]
            if info.compress_type not in ZIP_COMPRESSIONS:
                raise PartitionError(f"{where}: array {name!r} uses zip compression "
                                     f"{info.compress_type}; np.savez writes stored or deflated")
            with archive.open(info) as stream:  # inflates the header's bytes only
                layouts.append(npy_layout(stream, info.file_size, name, dtypes=_ROW_DTYPES))
        labels = [f"client {c}" for c in range(len(found))] + ["val"] * (len(names) > len(found))
        for label, layout in zip(labels, layouts, strict=True):
            _check_layout(layout, num_rows, f"{where}: {label}")
        total = sum(math.prod(layout.shape) for layout in layouts[:len(found)])
        if total > num_rows:
            raise PartitionError(f"{where}: its clients' .npy headers declare {total} rows in "
                                 f"all, more than the training set's {num_rows} (a row belongs "
                                 "to one client); not inflated")
        arrays = []
        for name in names:
            with archive.open(infos[name]) as stream:
                arrays.append(read_npy(stream, infos[name].file_size, name, dtypes=_ROW_DTYPES))
    val = arrays.pop() if f"{prefix}val" in infos else None
    return arrays, val


def _read_json(path: Path, key: str, where: str) -> tuple[list[object], object | None]:
    size = path.stat().st_size
    if size > MAX_PARTITION_JSON_BYTES:
        raise PartitionError(f"{where} is {size} bytes, over the {MAX_PARTITION_JSON_BYTES} "
                             "byte limit of a .json partition (write larger ones as .npz)")
    try:
        raw = read_capped(path, MAX_PARTITION_JSON_BYTES)
    except ValueError as exc:  # grew after the size check
        raise PartitionError(f"{where} {exc}") from exc
    text = raw.decode(json.detect_encoding(raw))
    depth = json_depth(text)
    if depth > MAX_PARTITION_JSON_DEPTH:
        raise PartitionError(f"{where} nests {depth} levels deep, the limit is "
                             f"{MAX_PARTITION_JSON_DEPTH} (a partition nests 3, 4 under a key)")
    content = json.loads(text)
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


def _check_layout(layout: NpyLayout, num_rows: int, where: str) -> None:
    """What an array's ``.npy`` header declares, checked before its data is inflated: 1-D,
    integer (an empty array may have any dtype) and at most ``num_rows`` rows."""
    size = math.prod(layout.shape)
    if len(layout.shape) != 1 or not (np.issubdtype(layout.dtype, np.integer) or size == 0):
        raise PartitionError(f"{where} must be a 1-D integer array, got {layout.dtype} "
                             f"{layout.shape}")
    if size > num_rows:
        raise PartitionError(f"{where}: its .npy header declares {size} rows, more than the "
                             f"training set's {num_rows}; not inflated")


def _count(values: object) -> int:
    """How many rows ``values`` (a list or an array, else 0) would convert to."""
    if isinstance(values, np.ndarray):
        return values.size
    return len(values) if isinstance(values, list) else 0


def _rows(values: object, num_rows: int, where: str) -> np.ndarray:
    """``values`` as a 1-D int64 array of rows in ``[0, num_rows)``, or PartitionError."""
    if _count(values) > num_rows:
        raise PartitionError(f"{where} lists {_count(values)} rows, more than the training "
                             f"set's {num_rows}")
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
    # checked in the array's own dtype: a uint64 row above 2**63 would wrap in int64
    if array.size and (array.min() < 0 or array.max() >= num_rows):
        bad = int(array[(array < 0) | (array >= num_rows)][0])
        raise PartitionError(f"{where}: row {bad} is outside the training set's "
                             f"0..{num_rows - 1}")
    return array.astype(np.int64, copy=False)
