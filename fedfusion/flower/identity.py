"""Which client an upload is: decided by the server from the Flower node id, never by a claim.

A client writes a ``client-id`` into its upload, but anyone can write any number there. What
the server does know is the Flower node id of the message a reply answers (with SuperNode
authentication the SuperLink ties each node id to a registered public key). So the strategy
keeps a server-side registry, node id -> client id, for as long as it lives (every round of
every ``start``), and decides each upload's client id from it:

* **operator registry** (``client_registry``: a mapping, or a JSON file
  ``{"<node id>": <client id>, ...}``, e.g. for an authenticated fleet): a node's upload is
  fused under its registered client id whatever it claims; a node absent from the registry
  is excluded with the reason. The registry is checked when it is loaded: every node id a
  uint64, every client id in 0..2**31-1, no client id given to two nodes.
* **otherwise, first come first registered**: a node keeps the client id it was given in an
  earlier round; a new node's claim is honoured when no other node owns that id and no other
  new node claims it in the same round. A colliding node is neither dropped nor allowed to
  displace anyone: it is fused under a fresh server-assigned id (from
  :data:`SERVER_ID_BASE` up), its claim kept as a label (``claimed_client_id``) and a warning
  logged. An id contested by several new nodes at once is given to none of them (who is
  honest cannot be told from the messages), so no node can take another's place by racing it.

Uploads made without Flower (:meth:`~fedfusion.strategies.FusionStrategy.fuse_uploads`,
``node_id`` None) have no server-side identity; duplicates there are refused as before.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedfusion.files import read_capped, regular_file_size

#: server-assigned client ids count up from here: far above the ids honest clients claim
#: (partition indices), inside the 0..2**31-1 range every upload's client id must lie in
SERVER_ID_BASE = 2**30
MAX_CLIENT_ID = 2**31 - 1
#: Flower node ids are unsigned 64-bit integers
MAX_NODE_ID = 2**64 - 1
#: a registry file larger than this is refused unread (a fleet of 100k nodes is ~3 MB)
MAX_REGISTRY_BYTES = 16 * 1024**2

#: how an upload's client id was decided (``ClientUpload.client_id_source``)
CLAIMED, REGISTERED, REGISTRY, SERVER = "claimed", "registered", "registry", "server"


class RegistryError(ValueError):
    """A client registry (mapping or file) that cannot be used, with the entry named."""


@dataclass(frozen=True)
class Assignment:
    """The server's decision for one node's upload: its client id, how it was decided
    (:data:`CLAIMED`, :data:`REGISTERED`, :data:`REGISTRY` or :data:`SERVER`), and, where it
    is not the claim, why."""

    client_id: int
    source: str
    note: str = ""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_client_registry(registry: Mapping[object, object], where: str = "client_registry"
                          ) -> dict[int, int]:
    """``registry`` as ``{node id: client id}``, checked: node ids are uint64 integers (or
    their decimal strings, as JSON object keys are), client ids ints in 0..2**31-1, and no
    client id belongs to two nodes. Raises :class:`RegistryError` naming the entry."""
    if not isinstance(registry, Mapping):
        raise RegistryError(f"{where} must map node ids to client ids, got "
                            f"{type(registry).__name__}")
    checked: dict[int, int] = {}
    owner: dict[int, int] = {}
    for key, value in registry.items():
        node = key
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 20:
            node = int(key)
        if not _is_int(node) or not 0 <= node <= MAX_NODE_ID:  # type: ignore[operator]
            raise RegistryError(f"{where}: key {str(key)[:40]!r} is not a node id (an "
                                f"integer in 0..2**64-1)")
        if not _is_int(value) or not 0 <= value <= MAX_CLIENT_ID:  # type: ignore[operator]
            raise RegistryError(f"{where}: node {node}: client id must be an int in "
                                f"0..2**31-1, got {str(value)[:40]!r}")
        assert isinstance(node, int) and isinstance(value, int)
        if node in checked:
            raise RegistryError(f"{where}: node {node} appears twice")
        if value in owner:
            raise RegistryError(f"{where}: client id {value} is given to both node "
                                f"{owner[value]} and node {node}")
        checked[node], owner[value] = value, node
    return checked


def read_client_registry(path: str | os.PathLike[str]) -> dict[int, int]:
    """Read a registry file: a JSON object ``{"<node id>": <client id>, ...}`` of at most
    :data:`MAX_REGISTRY_BYTES`. Raises :class:`RegistryError` naming the file and the
    problem (missing, too large, not JSON, hostile nesting, a bad entry)."""
    path = Path(path)
    try:
        size = regular_file_size(path)
        if size > MAX_REGISTRY_BYTES:
            raise RegistryError(f"client registry {path} is {size} bytes, above the cap "
                                f"{MAX_REGISTRY_BYTES}")
        data = read_capped(path, MAX_REGISTRY_BYTES)
    except OSError as exc:
        raise RegistryError(f"client registry {path} cannot be read: {exc.strerror or exc}"
                            ) from exc
    except ValueError as exc:  # not a regular file, or grew after the stat
        raise RegistryError(f"client registry {path} {exc}") from exc
    try:
        registry = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: hostile nesting
        raise RegistryError(f"client registry {path} is not JSON: "
                            f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    if not isinstance(registry, dict):
        raise RegistryError(f"client registry {path} must hold a JSON object "
                            f'{{"<node id>": <client id>}}, got {type(registry).__name__}')
    return check_client_registry(registry, f"client registry {path}")


class NodeIdentities:
    """The server-side registry node id -> client id, and the rules that grant client ids
    (module docstring). ``fixed``: the operator's registry, enforced when given."""

    def __init__(self, fixed: Mapping[int, int] | None = None):
        self.fixed = dict(fixed) if fixed is not None else None
        #: node id -> client id, every node this registry has granted an id to
        self.nodes: dict[int, int] = dict(self.fixed or {})
        self._owners = {client: node for node, client in self.nodes.items()}
        self._next = SERVER_ID_BASE

    def admits(self, node: int) -> bool:
        """Whether ``node`` may take part (always, unless an operator registry lacks it)."""
        return self.fixed is None or node in self.fixed

    def assign(self, claims: Sequence[tuple[int, int]]) -> dict[int, Assignment | str]:
        """Decide the client id of each ``(node id, claimed client id)`` of one round: an
        :class:`Assignment`, or the reason (str) the node is excluded. Deterministic: the
        same claims give the same ids whatever their order."""
        decided: dict[int, Assignment | str] = {}
        if self.fixed is not None:
            for node, claimed in claims:
                if node not in self.fixed:
                    decided[node] = (f"node {node} is not in the client registry (it claims "
                                     f"client id {claimed}); not fused")
                    continue
                client = self.fixed[node]
                decided[node] = Assignment(client, REGISTRY, "" if claimed == client else
                                           f"claims client id {claimed}; registered as "
                                           f"client {client}")
            return decided
        new: dict[int, list[int]] = {}  # claimed id -> the new nodes claiming it
        for node, claimed in sorted(claims):
            if node in self.nodes:  # identity is the node: it keeps its id
                client = self.nodes[node]
                decided[node] = Assignment(client, REGISTERED, "" if claimed == client else
                                           f"claims client id {claimed}; node {node} is "
                                           f"client {client} since an earlier round")
            else:
                new.setdefault(claimed, []).append(node)
        for claimed, nodes in sorted(new.items()):
            if len(nodes) == 1 and claimed not in self._owners:
                self._grant(nodes[0], claimed)
                decided[nodes[0]] = Assignment(claimed, CLAIMED)
                continue
            why = (f"client id {claimed} belongs to node {self._owners[claimed]}"
                   if claimed in self._owners else
                   f"client id {claimed} is claimed by nodes {nodes} at once")
            for node in nodes:
                client = self._fresh(set(new))
                self._grant(node, client)
                decided[node] = Assignment(client, SERVER, f"claims client id {claimed}, but "
                                           f"{why}; fused as server-assigned client {client}")
        return decided

    def _grant(self, node: int, client: int) -> None:
        self.nodes[node], self._owners[client] = client, node

    def _fresh(self, claimed: set[int]) -> int:
        """The next server id no node owns and no node claims this round."""
        while self._next in self._owners or self._next in claimed:
            self._next += 1
        if self._next > MAX_CLIENT_ID:
            raise RuntimeError("no server-assigned client id left")
        return self._next
