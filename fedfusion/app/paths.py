"""Run-config values that name where a run's outputs go, checked without importing torch: the
launcher checks ``run-name`` before it starts Flower, ``Settings.validate`` and the server's
``output_folder`` check it again (:func:`fedfusion.app.config.check_output_name`)."""

from __future__ import annotations

import os
from pathlib import PureWindowsPath


def output_name_error(key: str, name: str) -> str:
    """Why ``name`` (run-config ``key``, e.g. ``run-name``) does not name one folder directly
    inside ``output-dir``, or ``""`` when it does: it must not be absolute, hold ``..``, a NUL
    byte or a path separator (``/``, ``\\``), be ``.`` or name a Windows drive. Letters, digits,
    dots, dashes and underscores (``table1-C5_a0.1-s0-fedavg``) pass; ``""`` (an automatic
    name) too."""
    problem = ("is an absolute path" if name.startswith(("/", "\\")) or os.path.isabs(name)
               else "names a drive" if PureWindowsPath(name).drive
               else "holds '..'" if ".." in name
               else "holds a NUL byte" if "\0" in name
               else "holds a path separator" if any(
                   sep and sep in name for sep in ("/", "\\", os.sep, os.altsep))
               else "is '.'" if name == "." else "")
    if not problem:
        return ""
    shown = repr(name) if len(name) <= 80 else repr(name[:77]) + "..."
    return f"run-config {key!r} must name one folder inside output-dir: {shown} {problem}"
