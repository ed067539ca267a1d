"""Flower replies built by hand: an upload claiming a client id, its weights marked."""

from __future__ import annotations

import torch
from conftest import TinyNet
from flwr.app import Message

from fedfusion import client
from fedfusion.wire import encode_upload


def marked_upload(msg: Message, claim: int, mark: float) -> Message:
    """A reply to ``msg`` claiming ``claim``, its weights all ``mark`` (so the test can tell
    whose upload ended up where; marks differ by a few percent, so no outlier screen
    takes an interest in them)."""
    model = TinyNet()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(mark)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    return Message(encode_upload(client.make_upload([model], x, y, client_id=claim)),
                   reply_to=msg)
