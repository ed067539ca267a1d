"""Argument constraints written once, checked by the library and the App alike.

A :class:`Constraint` pairs a predicate with the rule it enforces in words. A library
constructor checks its argument with it (``ValueError: prox_mu must be a finite number >= 0,
got -1``); the App's run-config declaration (:mod:`fedfusion.app.config`) names the same
object for the key that feeds that argument, so the run config is refused by key, before
anything runs, under the very rule the constructor applies.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Constraint:
    """``ok(value)`` holds exactly for the values the rule ``rule`` allows."""

    rule: str
    ok: Callable[[Any], bool]

    def message(self, name: str, value: Any) -> str:
        return f"{name} must be {self.rule}, got {value!r}"

    def check(self, name: str, value: Any, error: type[Exception] = ValueError) -> None:
        """Raise ``error`` naming ``name`` unless ``value`` satisfies the rule."""
        if not self.ok(value):
            raise error(self.message(name, value))


@dataclass(frozen=True)
class OneOf(Constraint):
    """``value`` is one of ``choices()`` (a callable: registries fill up after import)."""

    choices: Callable[[], Iterable[str]]
    #: ``""`` (the key unset) is allowed too
    allow_empty: bool = False

    def message(self, name: str, value: Any) -> str:
        unset = "'' (unset) or " if self.allow_empty else ""
        return f"{name} is {value!r}; choose {unset}one of {', '.join(self.choices())}"


def one_of(choices: Iterable[str] | Callable[[], Iterable[str]], *,
           allow_empty: bool = False) -> OneOf:
    """A choice among ``choices`` (or ``""`` with ``allow_empty``: the key is unset)."""
    if callable(choices):
        source = choices
    else:
        fixed = tuple(choices)

        def source() -> Iterable[str]:
            return fixed
    return OneOf(rule="one of the listed choices",
                 ok=lambda v: (allow_empty and v == "") or v in source(), choices=source,
                 allow_empty=allow_empty)


def _number(value: Any) -> bool:
    """A real number (numpy's and torch's scalars included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """An integer (numpy's included), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


AT_LEAST_ONE = Constraint(">= 1", lambda v: v >= 1)
NON_NEGATIVE = Constraint(">= 0", lambda v: v >= 0)
POSITIVE = Constraint("> 0", lambda v: v > 0)
FINITE_NON_NEGATIVE = Constraint("a finite number >= 0",
                                 lambda v: _number(v) and math.isfinite(v) and v >= 0)
FINITE_POSITIVE = Constraint("a finite number > 0",
                             lambda v: _number(v) and math.isfinite(v) and v > 0)
SECONDS = Constraint("> 0 seconds", lambda v: v > 0)
MOMENTUM = Constraint("a finite number in [0, 1)",
                      lambda v: _number(v) and math.isfinite(v) and 0 <= v < 1)
#: torch threads: a huge count aborts the process in torch's thread pool, naming nothing
THREADS = Constraint("an integer in 1..1024", lambda v: is_integer(v) and 1 <= v <= 1024)
#: a seed: derived seeds (x a constant + an index) stay within torch's 64-bit seeds
SEED = Constraint("an integer in [0, 2**63)", lambda v: is_integer(v) and 0 <= v < 2**63)
#: a screening factor or count cap (:mod:`fedfusion.core.screening`): 0 turns it off;
#: below 1 it would reject the median client itself
OFF_OR_AT_LEAST_ONE = Constraint("0 (off) or a number >= 1",
                                 lambda v: math.isfinite(v) and (v == 0 or v >= 1))
