"""A run's folder and its results.json: created without following a link, written as
strict JSON (docs/results-format.md)."""

from __future__ import annotations

import errno
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedfusion.app.config import ConfigError, Settings, check_output_name
from fedfusion.upload_store import make_folder, open_no_follow

#: what a run writes into its folder (none of them may be a symlink there)
OUTPUTS = ("results.json", "predictor.pt", "uploads")


def output_folder(settings: Settings) -> Path:
    """``<output-dir>/<run-name>``, created, or an existing real folder; refused (OSError
    naming run-name) when it, or any of :data:`OUTPUTS` in it, is a symlink, and (ConfigError
    naming the key) before anything is created when ``run-name`` is not one folder name
    (absolute, ``..``, a NUL, a separator: also for Settings built without ``validate()``).
    The folder, symlinks resolved, lies directly inside the resolved ``output-dir``."""
    if "\0" in settings.output_dir:  # also for Settings built without validate()
        raise ConfigError("run-config 'output-dir' holds a NUL byte; no path can")
    root = Path(settings.output_dir).expanduser() if settings.output_dir else (
        Path.home() / "fedfusion-outputs")
    name = settings.run_name or (
        f"{time.strftime('%Y%m%d-%H%M%S')}-{settings.strategy}-{settings.dataset}"
        f"-{settings.partitioner}{settings.alpha:g}-s{settings.seed}"
        + ("-replay" if settings.replay else ""))
    check_output_name("run-name", name)  # one name: nothing on the way but output-dir
    root = root.resolve()
    if not settings.run_name:  # a generated name is never shared: runs started in the
        name = _unused_name(root, name)  # same second get -2, -3, ...
    try:
        folder = make_folder(root / name)  # a symlink in its place is refused
    except OSError as exc:
        raise OSError(exc.errno, f"run-config 'run-name' {name!r} in output-dir "
                      f"{str(root)!r}: {exc.strerror or exc}") from exc
    if folder.resolve().parent != root:  # what the checks above guarantee, asserted
        raise ConfigError(f"run-config 'run-name' {name!r} resolves to {folder.resolve()}, "
                          f"outside output-dir {str(root)!r}")
    for output in OUTPUTS:  # refused now rather than after the run: nothing follows a link
        if (folder / output).is_symlink():
            raise OSError(errno.ELOOP, f"refusing to write {folder / output}: it is a symlink "
                          f"(to {os.readlink(folder / output)!r}); remove it, or choose "
                          "another output-dir or run-name")
    return folder


def _unused_name(root: Path, name: str) -> str:
    """``name``, or ``name-2``, ``name-3``, ...: the first one created here (atomically, so
    two processes never get the same)."""
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 10_000):
        candidate = name if attempt == 1 else f"{name}-{attempt}"
        try:
            (root / candidate).mkdir()
        except FileExistsError:
            continue
        return candidate
    raise OSError(errno.EEXIST, f"{root}: 10,000 runs named {name!r}; set run-name")


def write_results(folder: Path, results: dict[str, Any]) -> None:
    """``folder/results.json`` (strict JSON; a symlink in its place is refused)."""
    with open_no_follow(folder / "results.json") as handle:
        handle.write(json.dumps(strict_json(results), indent=1, allow_nan=False).encode())


def strict_json(value: Any) -> Any:
    """``value`` as strict JSON data: numpy scalars and arrays as numbers and lists, NaN and
    Inf as null (a bare NaN is not JSON), anything else unknown as its string."""
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    if isinstance(value, np.ndarray | np.generic):
        return strict_json(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)
