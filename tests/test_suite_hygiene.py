"""The test suite's own rule: a test file never imports another (a shared builder lives in
``tests/conftest.py`` or ``tests/helpers/``), so each file runs, moves and fails alone."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    """Top-level module names ``path`` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_file_imports_another():
    files = sorted(TESTS.rglob("test_*.py")) + sorted((TESTS / "helpers").glob("*.py"))
    test_modules = {path.stem for path in TESTS.rglob("test_*.py")}
    offenders = {path.relative_to(TESTS).as_posix(): sorted(imported_modules(path) & test_modules)
                 for path in files}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(files) > 50  # the glob found the suite


def test_tests_sit_beside_the_package_they_test():
    """tests/<package>/ mirrors fedfusion/<package>/ (plus app, deploy, examples, datasets and
    training, the App's and the base's parts): a file's folder says what it tests, and two
    test files never share a name (pytest imports them by name)."""
    folders = {p.parent.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")}
    package = TESTS.parent / "fedfusion"
    known = {"core", "curvature", "accel", "wire", "flower", "strategies", "datasets"}
    assert known <= {p.name for p in package.iterdir() if p.is_dir()}
    assert folders <= known | {".", "app", "deploy", "examples", "training"}
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names))
    top = {p.name for p in TESTS.glob("test_*.py")}
    assert top <= {"test_layers.py", "test_library.py", "test_side_effects.py",
                   "test_suite_hygiene.py",  # the package as a whole
                   "test_benchmark_scripts.py"}  # benchmarks/, no package of its own


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("def f():\n    from test_wire import make_upload\n")
    assert "test_wire" in imported_modules(sample)
