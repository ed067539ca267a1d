"""Waiting for nodes and sampling them, with Flower's public Grid API only.

Flower's own strategies wait with ``strategy_utils.sample_nodes``: a private helper that
polls ``grid.get_node_ids()`` forever (``round_timeout`` starts only once the messages are
sent) and samples with the process-global ``random`` module. A run whose ``num_clients``
exceeds the SuperNodes that ever connect then hangs with "Waiting for nodes to connect"
until someone kills it. :func:`wait_for_nodes` gives up after a timeout, naming how many
nodes connected of how many were required; :func:`sample_nodes` draws from a generator
seeded by the strategy's seed and the round, so a run samples the same nodes every time and
leaves the caller's RNG alone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
from flwr.serverapp import Grid

from fedfusion.reasons import name_list

log = logging.getLogger("fedfusion")

#: seconds between two looks at the connected nodes
POLL_INTERVAL_S = 1.0
#: seconds between two "waiting for nodes" log lines (one per poll would flood the log)
LOG_INTERVAL_S = 10.0


class NodeWaitTimeout(TimeoutError):
    """Fewer nodes than a round needs connected within the wait timeout."""

    def __init__(self, connected: int, required: int, timeout: float, where: str = "",
                 outside: Sequence[int] = ()):
        self.connected, self.required, self.timeout = connected, required, timeout
        #: nodes that were connected but not admitted (outside the client registry)
        self.outside = list(outside)
        super().__init__(
            (f"{where}: " if where else "")
            + f"{connected} node(s) connected of the {required} required within {timeout:g} s "
            "(num_clients / min_available_nodes / min_train_nodes); start more SuperNodes, "
            "ask for fewer clients or raise node_wait_timeout" + (
                f"; {len(outside)} more connected but not in the client registry: "
                f"{name_list([str(n) for n in outside])}" if outside else ""))


def wait_for_nodes(
    grid: Grid,
    required: int,
    timeout: float,
    *,
    poll_interval: float = POLL_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    where: str = "",
    admits: Callable[[int], bool] | None = None,
) -> list[int]:
    """The connected node ids, sorted, once at least ``required`` are connected (of those
    ``admits`` accepts, where given: an operator registry's nodes; the others are returned
    too, for the caller to exclude, but never counted).

    Polls ``grid.get_node_ids()`` every ``poll_interval`` seconds; raises
    :class:`NodeWaitTimeout` when ``timeout`` seconds pass first (``math.inf`` waits
    forever, as Flower does), its message starting with ``where`` (e.g. the strategy and
    round). ``clock`` and ``sleep`` are parameters so tests need not wait.
    """
    if required < 1:
        raise ValueError(f"required must be >= 1, got {required}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    start = clock()
    logged_at = -math.inf
    while True:
        nodes = sorted(grid.get_node_ids())
        counted = len(nodes) if admits is None else sum(map(admits, nodes))
        if counted >= required:
            return nodes
        now = clock()
        waited = now - start
        if waited >= timeout:
            raise NodeWaitTimeout(counted, required, timeout, where, [
                n for n in nodes if admits is not None and not admits(n)])
        if now - logged_at >= LOG_INTERVAL_S:
            log.info("Waiting for nodes to connect: %d connected%s (minimum required: %d), "
                     "%.0f s of %g s", counted, "" if admits is None else " of the registry's",
                     required, waited, timeout)
            logged_at = now
        sleep(min(poll_interval, max(timeout - waited, 0.0)))


def sample_nodes(nodes: list[int], sample_size: int, rng: np.random.Generator) -> list[int]:
    """``sample_size`` of ``nodes`` without replacement, drawn by ``rng``, in ascending id
    order. Sorting the candidates first makes the draw independent of the order in which
    the grid lists them."""
    if not 1 <= sample_size <= len(nodes):
        raise ValueError(f"cannot sample {sample_size} of {len(nodes)} node(s)")
    candidates = sorted(nodes)
    picked = rng.choice(len(candidates), size=sample_size, replace=False)
    return sorted(candidates[int(i)] for i in picked)


def round_generator(seed: int, server_round: int) -> np.random.Generator:
    """The generator a round samples its nodes with: one stream per (seed, round)."""
    # a third word keeps this stream apart from other draws seeded by the same seed
    return np.random.default_rng([seed % 2**64, server_round % 2**64, 0x5A4D])
