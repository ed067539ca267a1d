"""The benchmark scripts keep up with the library: every ``benchmarks/*.py`` imports (its
imports resolve against the current API), so a refactor cannot leave a script that fails
before it measures anything (``ams.py`` and ``fedbens_compression.py`` once imported a class
the library had made internal)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: imports each script as a module in one process (the scripts run main() only as __main__)
IMPORT_ALL = """
import importlib, json, pathlib, sys
failures = {}
for path in sorted(pathlib.Path("benchmarks").glob("*.py")):
    try:
        importlib.import_module(path.stem)
    except Exception as error:  # noqa: BLE001 (reported by name)
        failures[path.name] = f"{type(error).__name__}: {error}"
print(json.dumps(failures))
"""


def test_every_benchmark_script_imports():
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    assert len(scripts) > 20  # the glob found them
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(REPO / p) for p in ("", "benchmarks", "tests"))}
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}
