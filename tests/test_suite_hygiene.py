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
    files = sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "helpers").glob("*.py"))
    test_modules = {path.stem for path in TESTS.glob("test_*.py")}
    offenders = {path.relative_to(TESTS).as_posix(): sorted(imported_modules(path) & test_modules)
                 for path in files}
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(files) > 50  # the glob found the suite


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text("def f():\n    from test_wire import make_upload\n")
    assert "test_wire" in imported_modules(sample)
