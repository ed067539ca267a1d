"""The App's import boundaries, read from the source: the ServerApp does not import the
ClientApp (what both need lives in App modules of its own), and Flower's internal
``flwr.supercore.constant`` enters the package through one module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fedfusion"


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, ``from a import b`` as both ``a`` and ``a.b``."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return modules


def test_the_server_app_does_not_import_the_client_app():
    assert "fedfusion.client_app" not in imported(PACKAGE / "server_app.py")
    assert "fedfusion.app.data_description" in imported(PACKAGE / "server_app.py")


def test_only_staging_imports_flowers_internal_constants():
    users = sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                   if any(m.startswith("flwr.supercore.constant") for m in imported(path)))
    assert users == ["app/staging.py"]
