"""What a run-config key declares: its doc, its rule and its roles.

Each field of :class:`fedfusion.app.config.Settings` is one run-config key (field ``foo_bar``
is key ``foo-bar``), declared once with :func:`knob`: the field gives its name, type and
default; the knob its one-line doc, its valid range in words, the :class:`Constraint` that
enforces that range when the run config is parsed, and its roles (which strategy constructor
argument it sets, whether a replay adopts it, whether a node config may override it).
pyproject.toml's ``[tool.flwr.app.config]`` and the key table of docs/configuration.md are
checked against these declarations (``scripts/config_reference.py --check``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fedfusion.constraints import Constraint
from fedfusion.device import CLIENT_DEVICE_PATTERN


@dataclass(frozen=True)
class Knob:
    """One run-config key's declaration beside its field's name, type and default."""

    #: what the key does (docs/configuration.md's "meaning" column)
    doc: str
    #: the values it takes, in words, with where they are checked (the "valid range" column)
    valid: str
    #: the range or choice enforced by ``Settings.validate``; None: checked where it is used
    #: (the ``valid`` text says where) or by a parser of the key's string form
    check: Constraint | None = None
    #: (strategy, constructor argument) pairs this key sets through ``build_strategy``;
    #: strategy :data:`EVERY` for an argument all of them take
    strategy: tuple[tuple[str, str], ...] = ()
    #: decides the clients' data and models: a replay adopts it from the upload manifest,
    #: since the uploads were trained under it
    data: bool = False
    #: a SuperNode's node config may override it for its own client
    node: bool = False
    #: names a file or folder (a NUL byte is refused: no path holds one)
    path: bool = False
    #: said after the default in the docs (e.g. a launcher that sets another value)
    default_note: str = ""


def knob(default: Any, *, doc: str, valid: str, check: Constraint | None = None,
         strategy: tuple[tuple[str, str], ...] = (), data: bool = False, node: bool = False,
         path: bool = False, default_note: str = "") -> Any:
    """A ``Settings`` field with ``default``, declaring its key (:class:`Knob`)."""
    return dataclasses.field(default=default, metadata={"knob": Knob(
        doc=doc, valid=valid, check=check, strategy=strategy, data=data, node=node, path=path,
        default_note=default_note)})


#: the ``strategy`` of a key that sets an argument every strategy takes
EVERY = "*"

#: the App-only rules (a strategy argument's rule lives with its constructor)
SPLIT_SEED = Constraint("-1 (follow 'seed') or an integer in [0, 2**63)",
                        lambda v: -1 <= v < 2**63)
SERVER_THREADS = Constraint("0 (torch's default) or an integer in 1..1024",
                            lambda v: 0 <= v <= 1024)
HOLDOUT_FRACTION = Constraint(
    "in [0, 1) (0: FENS' own for strategy 'fens', none otherwise)", lambda v: 0 <= v < 1)
SERVER_DEVICE = Constraint("'auto', 'cpu' or 'cuda[:i]'",
                           lambda v: v in ("auto", "cpu") or v.startswith("cuda"))
CLIENT_DEVICE = Constraint("'auto', 'cpu', 'cuda' or 'cuda:<i>'",
                           lambda v: CLIENT_DEVICE_PATTERN.fullmatch(v) is not None)
SHA256 = Constraint("'' or 64 lowercase hex digits",
                    lambda v: v == "" or (len(v) == 64 and all(c in "0123456789abcdef"
                                                               for c in v)))

#: the docs' key table's group headings, each before the key that opens it
GROUPS: dict[str, str] = {
    "strategy": "**what runs**",
    "dataset": "**data**",
    "model": "**model and local training**",
    "hessian-structure": "**Laplace curvature** (FedBEns and the curvature-based baselines)",
    "server-device": "**server**",
    "server-steps": "**FedBEns**",
    "fedfisher-steps": "**FedBEns' baselines**",
    "holdout-fraction": "**SWA, FedProx, contrastive clients**",
    "ensemble-size": "**the uniform ensemble**",
    "ams-top-k": "**AMS and PFNM**",
    "output-dir": "**outputs and replay**",
}
