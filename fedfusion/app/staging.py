"""A copy of an App folder holding exactly the files ``flwr run`` packs into its FAB.

Flower 1.41 has no public API for which files a FAB holds: its include and exclude patterns
live in ``flwr.supercore.constant``, an internal module. This module is the one place that
imports it, so a Flower upgrade that moves them breaks here, and the staging test
(``tests/app/test_launch.py``: the staged copy packs into the same FAB) says so.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def stage_app(app_dir: Path, into: Path) -> Path:
    """Copy into ``into`` the App's files that ``flwr run`` may pack into its FAB: those of
    the kinds a FAB holds (``.py``, ``.toml``, ``.md``, ...) that neither ``.gitignore`` nor
    Flower's own exclusions (``.venv/``, ``__pycache__/``, ...) leave out, outside ``.git``;
    folders so left out are not entered. Flower builds the FAB by walking and resolving
    EVERY file under the App folder before it applies those rules: with the ``.venv`` inside
    the checkout that is ~53,000 files and ~4 s per launch, against ~0.1 s for the ~100 files
    staged here. Flower then filters the copy by the same rules, so the FAB (and its hash) is
    the one it would have built from ``app_dir``."""
    import pathspec
    from flwr.supercore.constant import (
        APP_PUBLISH_EXCLUDE_PATTERNS,
        APP_PUBLISH_INCLUDE_PATTERNS,
    )

    gitignore = app_dir / ".gitignore"
    ignored = pathspec.GitIgnoreSpec.from_lines(
        [*APP_PUBLISH_EXCLUDE_PATTERNS,
         *(gitignore.read_text().splitlines() if gitignore.is_file() else [])])
    packed = pathspec.GitIgnoreSpec.from_lines(APP_PUBLISH_INCLUDE_PATTERNS)
    for folder, subfolders, files in os.walk(app_dir):
        relative = Path(folder).relative_to(app_dir)
        subfolders[:] = [d for d in subfolders if d != ".git" and not ignored.match_file(
            f"{(relative / d).as_posix()}/")]
        for name in files:
            source, path = Path(folder) / name, (relative / name).as_posix()
            if source.is_symlink() or ignored.match_file(path) or not packed.match_file(path):
                continue  # Flower skips symlinks too
            (into / relative).mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / relative / name)
    return into
