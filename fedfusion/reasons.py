"""How client-controlled values and exceptions appear in exclusion reasons: clipped, so that
a hostile upload cannot flood logs or ``results.json`` with its own text."""

from __future__ import annotations

from collections.abc import Sequence


def clip(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and its length."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def brief(value: object, limit: int = 80) -> str:
    """``repr(value)`` clipped: client-controlled values appear in reasons, never in full."""
    try:
        return clip(repr(value), limit)
    except (ValueError, RecursionError):  # an int of over 4300 digits; hostile nesting
        return f"<a {type(value).__name__} too large to show>"


def name_list(names: Sequence[str], limit: int = 8) -> str:
    """``['a', 'b']``, or the first ``limit`` names and how many more."""
    names = [clip(str(n), 60) for n in names]
    if len(names) <= limit:
        return str(names)
    return f"{str(names[:limit])[:-1]}, ... ({len(names) - limit} more)]"


def describe(exc: BaseException) -> str:
    """An exception as a reason: ValueError/TypeError messages as they are, others typed."""
    if type(exc) in (ValueError, TypeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
