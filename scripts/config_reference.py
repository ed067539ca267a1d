"""Rewrite docs/configuration.md's run-config key table from the keys' declarations.

``python scripts/config_reference.py`` regenerates the table between its markers from
:class:`fedfusion.app.config.Settings` (:mod:`fedfusion.app.reference`); ``--check`` changes
nothing and exits 1 when the table, or pyproject.toml's ``[tool.flwr.app.config]``, departs
from the declarations, saying how.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# run as a script from a checkout: the checkout's fedfusion, as the benchmarks do
sys.path.insert(0, str(ROOT))

from fedfusion.app.reference import pyproject_mismatches, with_key_table  # noqa: E402

DOC = ROOT / "docs" / "configuration.md"
PYPROJECT = ROOT / "pyproject.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if the docs or pyproject.toml differ")
    args = parser.parse_args(argv)
    doc = DOC.read_text()
    generated = with_key_table(doc)
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    problems = pyproject_mismatches(config)
    if not args.check:
        if generated != doc:
            DOC.write_text(generated)
            print(f"rewrote the key table of {DOC.relative_to(ROOT)}")
        for problem in problems:  # pyproject keeps its hand-written comments: fix by hand
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    if generated != doc:
        sys.stdout.writelines(difflib.unified_diff(
            doc.splitlines(keepends=True), generated.splitlines(keepends=True),
            str(DOC.relative_to(ROOT)), "generated"))
        problems.append(f"{DOC.relative_to(ROOT)}: the key table is stale; run "
                        "python scripts/config_reference.py")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
