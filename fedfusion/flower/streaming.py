"""A Flower grid whose ``send_and_receive`` hands each reply over as it arrives.

Flower's grids return a round's replies as one list once the last node has answered (or the
timeout passed), so a server holds every reply message of the round at once, and can
only start decoding after the slowest node. :class:`StreamingGrid` wraps any grid and does
the same push / pull through the grid's public ``push_messages`` and ``pull_messages``, but
yields the replies as each pull returns them: the strategy decodes, validates and stores an
upload (:class:`~fedfusion.upload_store.UploadWriter`) while the other nodes still train,
and drops the reply message before the next one arrives.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from flwr.app import Message
from flwr.serverapp import Grid

#: seconds between two pulls while replies are outstanding
PULL_INTERVAL_S = 0.5


class StreamingGrid(Grid):
    """``grid`` with a ``send_and_receive`` that yields the replies as they arrive; every
    other call goes to ``grid`` itself. A grid whose class sets ``streams_replies = True``
    already does this and is used as it is (:class:`~fedfusion.flower.local.LocalGrid`)."""

    streams_replies: ClassVar[bool] = True

    def __init__(self, grid: Grid, pull_interval: float = PULL_INTERVAL_S):
        self.grid = grid
        self.pull_interval = pull_interval

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterator[Message]:
        """Push ``messages`` now; the returned iterator yields the replies as the pulls
        return them, until every message has one or ``timeout`` seconds have passed since
        the push (None: wait for all)."""
        outstanding = set(self.grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        del messages  # the sent messages are not kept
        return self._replies(outstanding, deadline)

    def _replies(self, outstanding: set[str], deadline: float | None) -> Iterator[Message]:
        while outstanding and (deadline is None or time.monotonic() < deadline):
            for reply in self.grid.pull_messages(outstanding):
                outstanding.discard(reply.metadata.reply_to_message_id)
                yield reply
            if outstanding:
                time.sleep(self.pull_interval)

    # everything else is the wrapped grid's
    def set_run(self, run_id: Any) -> None:
        self.grid.set_run(run_id)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)
