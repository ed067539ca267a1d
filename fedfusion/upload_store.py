"""Cached client uploads on disk, for replaying one client run into every strategy.

Layout of an upload folder::

    manifest.json       schema, version, the run settings that produced the uploads,
                        and one entry per client (model, kwargs, examples, metrics, file)
    client_<id>.npz     arrays "m<member>/<section>/<name>" (numpy, loaded without pickle)

Loading returns :class:`~fedfusion.payload.ClientUpload` objects that go through the
same validation as live uploads when a strategy fuses them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedfusion.payload import SCHEMA, SCHEMA_VERSION, ClientUpload

MANIFEST = "manifest.json"


def save_uploads(directory: str | Path, uploads: Sequence[ClientUpload],
                 run_config: dict[str, Any]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    clients = []
    for upload in uploads:
        file = f"client_{upload.client_id}.npz"
        np.savez(directory / file, **{
            f"m{m}/{section}/{name}": array
            for m, member in enumerate(upload.members)
            for section, arrays in member.items()
            for name, array in arrays.items()
        })
        clients.append({
            "client_id": upload.client_id, "file": file, "model": upload.model,
            "model_kwargs": upload.model_kwargs, "num_examples": upload.num_examples,
            "num_members": upload.num_members, "metrics": upload.metrics,
        })
    manifest = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
                "run_config": run_config, "clients": clients}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return directory


def load_uploads(directory: str | Path) -> tuple[dict[str, Any], list[ClientUpload]]:
    """Return (run_config that produced them, uploads). Raises ValueError on a bad folder."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {directory} an upload folder "
                                "written by a run with save-uploads=true?")
    manifest = json.loads(path.read_text())
    if manifest.get("schema") != SCHEMA or manifest.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema {manifest.get('schema')!r} version "
                         f"{manifest.get('schema_version')!r} is not {SCHEMA!r} v{SCHEMA_VERSION}")
    uploads = []
    for entry in manifest["clients"]:
        members: list[dict[str, dict[str, np.ndarray]]] = [
            {} for _ in range(int(entry["num_members"]))
        ]
        with np.load(directory / entry["file"], allow_pickle=False) as arrays:
            for key in arrays.files:
                member, section, name = key.split("/", 2)
                members[int(member[1:])].setdefault(section, {})[name] = arrays[key]
        uploads.append(ClientUpload(
            client_id=int(entry["client_id"]), model=entry["model"],
            model_kwargs=entry["model_kwargs"], num_examples=int(entry["num_examples"]),
            members=members, metrics=entry["metrics"],
        ))
    return manifest["run_config"], uploads
