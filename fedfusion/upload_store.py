"""Cached client uploads on disk, for replaying one client run into every strategy.

Layout of an upload folder::

    manifest.json       schema, version, the run settings that produced the uploads,
                        and one entry per client (model, kwargs, examples, metrics, file;
                        its Flower node id and claimed client id where known)
    client_<id>.npz     arrays "m<member>/<section>/<name>" (numpy, loaded without pickle)

Loading returns :class:`~fedfusion.wire.ClientUpload` objects that go through the
same validation as live uploads when a strategy fuses them.

A folder may come from elsewhere, so loading trusts nothing in it. The manifest is checked
as a schema (every field's type, named on error). A client whose entry or file is bad is
left out, named with the reason, and the other clients load (:func:`load_uploads` returns
these failures): an entry field of the wrong type, a file path outside the folder (absolute,
``..``, or a symlink that leads out), a missing, truncated or foreign npz, an npz that does
not match its entry (members), more than the limits' ``upload_bytes`` declared in the zip
headers
(refused before anything is inflated), an array whose ``.npy`` header does not match its
size. Only a problem of the whole folder raises :class:`UploadStoreError`, among them
clients that together declare more than :data:`MAX_REPLAY_BYTES` uncompressed (every client's
zip and ``.npy`` headers are checked, and summed, before any array is read).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, BinaryIO

import numpy as np

from fedfusion.reasons import brief, describe
from fedfusion.wire.format import MAX_MEMBERS, SCHEMA, SCHEMA_VERSION, ClientUpload
from fedfusion.wire.limits import DEFAULT_LIMITS, UploadLimits
from fedfusion.wire.npy import ZIP_COMPRESSIONS, npy_layout, read_npy, zip_directory_bytes

MANIFEST = "manifest.json"
#: a manifest larger than this is refused unread: honest entries are about 1 KB, and the
#: metrics validation lets through (``UploadLimits.metrics_chars``, 1 MiB) bound each, so
#: only hundreds of clients at that cap reach it (the writer then says so)
MAX_MANIFEST_BYTES = 256 * 1024**2
MAX_CLIENTS = 100_000
#: bytes an npz may hold beyond its arrays' declared sizes (zip and .npy headers)
NPZ_OVERHEAD_BYTES = 16 * 1024**2
#: an npz whose zip directory declares more than this is refused before :mod:`zipfile` turns
#: it into one object per entry (np.savez's names take ~100 bytes an array: 16 MiB is about
#: 160,000 arrays, parsed in about a second; an honest ResNet-20 upload of M = 5 needs 0.3 MB)
MAX_NPZ_DIRECTORY_BYTES = 16 * 1024**2
#: cap on the uncompressed bytes ALL clients of a replay declare in their zip headers
#: together (checked, with every ``.npy`` header, before any array is read): a replay holds
#: every upload in memory at once, so its total is capped like one live client's upload
#: (``UploadLimits.upload_bytes``); ``load_uploads(max_total_bytes=...)``
MAX_REPLAY_BYTES = 2 * 1024**3
#: a client entry's fields and their JSON types
ENTRY_FIELDS: dict[str, type] = {
    "client_id": int, "file": str, "model": str, "model_kwargs": dict, "num_examples": int,
    "num_members": int, "metrics": dict,
}
#: optional entry fields (absent from folders written before them): who the server knew
#: the upload came from. ``node_id``: the Flower node (null without Flower);
#: ``claimed_client_id``: the id the upload claimed, a label where the server decided
#: ``client_id`` from the node; ``client_id_source``: how it decided
#: (:mod:`fedfusion.flower.identity`)
OPTIONAL_ENTRY_FIELDS: dict[str, type] = {
    "node_id": int, "claimed_client_id": int, "client_id_source": str,
}
#: Flower node ids are unsigned 64-bit integers; client ids 0..2**31-1 (as validation)
_FIELD_RANGES = {"node_id": (0, 2**64 - 1), "claimed_client_id": (0, 2**31 - 1)}
_ID_SOURCES = ("", "claimed", "registered", "registry", "server")

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

#: (client, reason) of a client left out of a replay
Failure = tuple[str, str]

log = logging.getLogger("fedfusion")


class UploadStoreError(ValueError):
    """The upload folder as a whole cannot be replayed (no manifest, not JSON, wrong schema,
    or, with ``strict=True``, any bad client)."""


def make_folder(directory: str | Path) -> Path:
    """Create ``directory`` (and its parents), or accept it when it is already a real
    directory; refuse it (``OSError``) when it is a symlink or not a directory, so that what
    is written into it cannot land in a folder it points at."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir()
    except FileExistsError:
        pass
    mode = directory.lstat().st_mode
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        raise OSError(errno.EEXIST, f"refusing to write into {directory}: it exists as a "
                      f"{'symlink' if stat.S_ISLNK(mode) else 'non-directory'}, not a folder "
                      "(remove it, or write to another folder)")
    return directory


def open_no_follow(path: str | Path) -> BinaryIO:
    """Open ``path`` for writing (created or truncated) WITHOUT following a symlink: a
    symlink at ``path`` raises ``OSError`` instead of overwriting the file it points at."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_NOFOLLOW, 0o644)
    except OSError as exc:
        if path.is_symlink():
            raise OSError(errno.ELOOP, f"refusing to write {path}: it is a symlink (to "
                          f"{os.readlink(path)!r}); remove it first") from exc
        raise
    if not _O_NOFOLLOW and path.is_symlink():  # no O_NOFOLLOW here (Windows): check after
        os.close(fd)
        raise OSError(errno.ELOOP, f"refusing to write {path}: it is a symlink")
    return os.fdopen(fd, "wb")


class UploadWriter:
    """Writes uploads into ``directory`` as they arrive, then a round's manifest.

    :meth:`write` stores one upload's arrays at once (``node_<node id>.npz``, or
    ``upload_<n>.npz`` without a node: its client id may still change); calling the writer
    with the round's uploads (it is an ``upload_sink``, :class:`~fedfusion.core.fusion.
    Fusion`) renames each to ``client_<final id>.npz`` (writing those not written yet),
    writes the manifest, and removes the files of uploads written but not in the round
    (excluded after they arrived). The folder is created on the first
    write (or an existing real folder; a symlink in its place, or at any file written, is
    refused with ``OSError``). Two uploads of one client id are refused (``ValueError``,
    before anything more is written)."""

    def __init__(self, directory: str | Path, run_config: dict[str, Any]):
        self.directory = Path(directory)
        self.run_config = run_config
        #: (upload, its file) of what was written this round, in arrival order
        self._written: list[tuple[ClientUpload, str]] = []

    def write(self, upload: ClientUpload, file: str | None = None) -> str:
        """Write ``upload``'s arrays (to ``file`` in the folder); return the file name."""
        if file is None:
            file = (f"node_{upload.node_id}.npz" if upload.node_id is not None
                    else f"upload_{len(self._written)}.npz")
        if any(name == file for _, name in self._written):
            raise ValueError(f"{file} was already written this round")
        directory = make_folder(self.directory)
        with open_no_follow(directory / file) as handle:
            np.savez(handle, **{
                f"m{m}/{section}/{name}": array
                for m, member in enumerate(upload.members)
                for section, arrays in member.items()
                for name, array in arrays.items()
            })
        self._written.append((upload, file))
        return file

    def __call__(self, uploads: Sequence[ClientUpload]) -> Path:
        ids = [upload.client_id for upload in uploads]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"uploads of client id(s) {twice} appear more than once; each "
                             "client's file would overwrite another's")
        arrived = {id(upload): file for upload, file in self._written}
        for upload in uploads:
            file = f"client_{upload.client_id}.npz"
            if id(upload) in arrived:  # on disk since it arrived: named by its final id now
                os.replace(self.directory / arrived.pop(id(upload)), self.directory / file)
            else:
                self.write(upload, file)
        for file in arrived.values():  # arrived, then excluded from the round
            (self.directory / file).unlink(missing_ok=True)
        self._written = []
        clients = [{
            "client_id": upload.client_id, "file": f"client_{upload.client_id}.npz",
            "model": upload.model, "model_kwargs": upload.model_kwargs,
            "num_examples": upload.num_examples, "num_members": upload.num_members,
            "metrics": upload.metrics, "node_id": upload.node_id,
            "claimed_client_id": upload.claimed_client_id,
            "client_id_source": upload.client_id_source,
        } for upload in uploads]
        manifest = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                    "run_config": self.run_config, "clients": clients}
        text = json.dumps(manifest, indent=1).encode()
        if len(text) > MAX_MANIFEST_BYTES:  # written all the same: nothing computed is lost
            largest = sorted(clients, key=lambda e: -len(json.dumps(e["metrics"])))[:5]
            log.error("upload folder %s: its manifest is %d bytes, above the %d that "
                      "load_uploads reads (MAX_MANIFEST_BYTES); the clients with the largest "
                      "metrics: %s", self.directory, len(text), MAX_MANIFEST_BYTES,
                      [e["client_id"] for e in largest])
        directory = make_folder(self.directory)
        with open_no_follow(directory / MANIFEST) as handle:
            handle.write(text)
        return directory


def save_uploads(directory: str | Path, uploads: Sequence[ClientUpload],
                 run_config: dict[str, Any]) -> Path:
    """Write ``uploads`` to ``directory`` at once (:class:`UploadWriter`): one
    ``client_<id>.npz`` per upload and the manifest, which keeps each upload's node id and
    claimed id (:data:`OPTIONAL_ENTRY_FIELDS`)."""
    return UploadWriter(directory, run_config)(uploads)


def load_uploads(directory: str | Path, limits: UploadLimits = DEFAULT_LIMITS, *,
                 strict: bool = False, max_total_bytes: int = MAX_REPLAY_BYTES
                 ) -> tuple[dict[str, Any], list[ClientUpload], list[Failure]]:
    """Return (run_config that produced them, the uploads that load, the failures).

    ``limits.upload_bytes`` caps each client's npz as it caps a live upload.
    ``failures`` lists ``(client, reason)`` for every client left out (``client`` is its
    ``client_id``, or ``"entry <i>"`` when the entry has no usable id). A folder-level
    problem raises :class:`UploadStoreError`; so does any failure when ``strict`` (for
    tools that must see every client), and a total above ``max_total_bytes``: every
    client's zip headers and ``.npy`` headers are checked, and the uncompressed bytes they
    declare summed over all clients, before any array is read."""
    root = Path(directory)
    manifest = _read_manifest(root)
    failures: list[Failure] = []

    def fail(index: int, entry: object, exc: Exception) -> None:
        client, reason = _label(index, entry), describe(exc)
        if strict:
            raise UploadStoreError(f"{root}: client {client}: {reason}") from exc
        failures.append((client, reason))

    plans: list[tuple[int, dict[str, Any], _Plan]] = []
    seen: set[int] = set()
    for index, entry in enumerate(manifest["clients"]):
        try:  # whatever one client's files raise leaves that client out
            plan = _plan_client(root, index, entry, limits.upload_bytes)
            if entry["client_id"] in seen:
                raise ValueError(f"clients[{index}]: client_id {entry['client_id']} appears "
                                 "twice")
        except Exception as exc:
            fail(index, entry, exc)
            continue
        seen.add(entry["client_id"])
        plans.append((index, entry, plan))
    total = sum(plan.declared for _, _, plan in plans)
    if total > max_total_bytes:
        sizes = ", ".join(f"client {entry['client_id']}: {plan.declared}"
                          for _, entry, plan in plans[:8]) + (", ..." if len(plans) > 8 else "")
        raise UploadStoreError(f"{root}: its {len(plans)} clients declare {total} uncompressed "
                               f"bytes together ({sizes}), above the cap on a replay "
                               f"({max_total_bytes} bytes, MAX_REPLAY_BYTES / "
                               "max_total_bytes); nothing was read")
    uploads: list[ClientUpload] = []
    for index, entry, plan in plans:
        try:
            members = _read_arrays(plan)
        except Exception as exc:
            fail(index, entry, exc)
            continue
        uploads.append(ClientUpload(
            client_id=entry["client_id"], model=entry["model"],
            model_kwargs=entry["model_kwargs"], num_examples=entry["num_examples"],
            members=members, metrics=entry["metrics"], node_id=entry.get("node_id"),
            claimed_client_id=entry.get("claimed_client_id"),
            client_id_source=entry.get("client_id_source") or ""))
    return manifest["run_config"], uploads, failures


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise UploadStoreError(f"{path} not found: is {root} an upload folder written by "
                               "fedfusion.upload_store.save_uploads?")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise UploadStoreError(f"{path} is {size} bytes, above the cap {MAX_MANIFEST_BYTES}")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:  # RecursionError: hostile nesting
        raise UploadStoreError(f"{path} is not JSON: {describe(exc)}") from exc
    if not isinstance(manifest, dict):
        raise UploadStoreError(f"{path} must hold a JSON object, got {type(manifest).__name__}")
    version = manifest.get("schema_version")
    if manifest.get("schema") != SCHEMA or version != SCHEMA_VERSION or isinstance(version,
                                                                                   bool):
        raise UploadStoreError(f"{path}: schema {brief(manifest.get('schema'))} version "
                               f"{brief(version)} is not {SCHEMA!r} v{SCHEMA_VERSION}")
    run_config, clients = manifest.get("run_config"), manifest.get("clients")
    if not isinstance(run_config, dict) or not all(isinstance(k, str) for k in run_config):
        raise UploadStoreError(f"{path}: field 'run_config' must be a JSON object, got "
                               f"{type(run_config).__name__}")
    if not isinstance(clients, list) or len(clients) > MAX_CLIENTS:
        raise UploadStoreError(f"{path}: field 'clients' must be a list of at most "
                               f"{MAX_CLIENTS} entries, got {type(clients).__name__}")
    return manifest


def _label(index: int, entry: object) -> str:
    client_id = entry.get("client_id") if isinstance(entry, dict) else None
    if isinstance(client_id, int) and not isinstance(client_id, bool):
        return str(client_id)
    return f"entry {index}"


@dataclass
class _Plan:
    """One client's npz, checked from its headers: its arrays' zip entries and layouts."""

    path: Path
    file: str
    num_members: int
    arrays: list[tuple[zipfile.ZipInfo, int, str, str]]  # info, member, section, name
    declared: int  # uncompressed bytes the zip headers declare


def _plan_client(root: Path, index: int, entry: object, max_upload_bytes: int) -> _Plan:
    where = f"clients[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(entry).__name__}")
    for name, kind in ENTRY_FIELDS.items():
        if name not in entry:
            raise ValueError(f"{where}.{name} is missing")
        value = entry[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}.{name} must be {kind.__name__}, got {brief(value)}")
    for name, kind in OPTIONAL_ENTRY_FIELDS.items():
        value = entry.get(name)
        if value is None:  # absent, or null: not known (an upload made without Flower)
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}.{name} must be {kind.__name__} or null, got "
                             f"{brief(value)}")
        low, high = _FIELD_RANGES.get(name, (None, None))
        if low is not None and not low <= value <= high:
            raise ValueError(f"{where}.{name} is {value}, expected {low}..{high}")
        if name == "client_id_source" and value not in _ID_SOURCES:
            raise ValueError(f"{where}.{name} is {brief(value)}, expected one of "
                             f"{list(_ID_SOURCES)}")
    unknown = sorted(map(str, set(entry) - set(ENTRY_FIELDS) - set(OPTIONAL_ENTRY_FIELDS)))
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {brief(unknown)}")
    num_members = entry["num_members"]
    if not 1 <= num_members <= MAX_MEMBERS:
        raise ValueError(f"{where}.num_members is {num_members}, expected 1..{MAX_MEMBERS}")
    path = _inside(root, entry["file"], where)
    return _check_npz(path, entry["file"], num_members, max_upload_bytes)


def _inside(root: Path, file: str, where: str) -> Path:
    """``root / file``, refused unless it is a regular file inside ``root`` (no absolute path,
    no ``..``, no symlink leading out)."""
    relative = PurePath(file)
    if not file or relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"{where}.file {brief(file)} is not a path inside the upload folder")
    path = (root / relative).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ValueError(f"{where}.file {brief(file)} leads outside the upload folder "
                         "(a symlink?)")
    if not path.is_file():
        raise ValueError(f"{where}.file {brief(file)} is not a file in the upload folder")
    return path


def _check_npz(path: Path, file: str, num_members: int, max_upload_bytes: int) -> _Plan:
    """Check one client's npz from the file size, the zip headers and every array's ``.npy``
    header, reading no array data."""
    size = path.stat().st_size
    if size > max_upload_bytes + NPZ_OVERHEAD_BYTES:
        raise ValueError(f"{file} is {size} bytes, above the cap on one client's upload "
                         f"({max_upload_bytes} bytes, UploadLimits.upload_bytes)")
    arrays: list[tuple[zipfile.ZipInfo, int, str, str]] = []
    with open(path, "rb") as handle:
        directory = zip_directory_bytes(handle)
    if directory > MAX_NPZ_DIRECTORY_BYTES:
        raise ValueError(f"{file}: its zip directory declares {directory} bytes, above the cap "
                         f"{MAX_NPZ_DIRECTORY_BYTES} (MAX_NPZ_DIRECTORY_BYTES); not parsed")
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
        declared = sum(info.file_size for info in infos)
        if declared > max_upload_bytes:
            raise ValueError(f"{file} declares {declared} uncompressed bytes in its zip "
                             f"headers, above the cap on one client's upload "
                             f"({max_upload_bytes} bytes, UploadLimits.upload_bytes); not "
                             "inflated")
        seen: set[tuple[int, str, str]] = set()
        for info in infos:
            m, section, name = _array_key(info.filename, file, num_members)
            if info.compress_type not in ZIP_COMPRESSIONS:
                raise ValueError(f"{file}: {brief(info.filename)} uses zip compression "
                                 f"{info.compress_type}; np.savez writes stored or deflated")
            if (m, section, name) in seen:
                raise ValueError(f"{file}: array {brief(info.filename)} appears twice")
            seen.add((m, section, name))
            with archive.open(info) as stream:
                npy_layout(stream, info.file_size, f"{file}:{info.filename}")
            arrays.append((info, m, section, name))
    empty = sorted(set(range(num_members)) - {m for _, m, _, _ in arrays})
    if empty:
        raise ValueError(f"the manifest says {num_members} member(s) but {file} holds no "
                         f"arrays for member(s) {brief(empty)}")
    return _Plan(path, file, num_members, arrays, declared)


def _read_arrays(plan: _Plan) -> list[dict[str, dict[str, np.ndarray]]]:
    """The members of a checked npz (each array's header is checked again as it is read:
    the file may have changed)."""
    members: list[dict[str, dict[str, np.ndarray]]] = [{} for _ in range(plan.num_members)]
    with zipfile.ZipFile(plan.path) as archive:
        for info, m, section, name in plan.arrays:
            with archive.open(info) as stream:
                array = read_npy(stream, info.file_size, f"{plan.file}:{info.filename}")
            members[m].setdefault(section, {})[name] = array
    return members


def _array_key(filename: str, file: str, num_members: int) -> tuple[int, str, str]:
    """``"m<member>/<section>/<name>.npy"`` -> (member, section, name)."""
    parts = filename.removesuffix(".npy").split("/", 2)
    if not filename.endswith(".npy") or len(parts) != 3 or not all(parts) or not (
            parts[0][:1] == "m" and parts[0][1:].isdigit() and parts[0][1:].isascii()):
        raise ValueError(f"{file}: entry {brief(filename)} is not 'm<member>/<section>/"
                         "<name>.npy'")
    member = int(parts[0][1:])
    if member >= num_members:
        raise ValueError(f"{file} holds member {member} but the manifest says {num_members} "
                         "member(s)")
    return member, parts[1], parts[2]
