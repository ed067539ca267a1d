"""The exception a ClientApp raised, recovered from the error reply Flower sends for it.

Flower turns an exception in a ClientApp into an error reply whose ``reason`` is
``str(type(ex)) + ":<'" + str(ex) + "'>"`` (``flwr.supernode.runtime.run_clientapp`` on a
SuperNode, ``flwr.server.superlink.fleet.vce.vce_api.worker`` in a simulation). On a
SuperNode ``ex`` is the ClientApp's own exception, so the reason reads
``<class 'ValueError'>:<'...'>``. Under the Ray simulation backend it is not: the actor
re-raises it as ``ClientAppException(str(ex)) from ex`` (losing its type) and Ray wraps that
into ``RayTaskError(ClientAppException)``, whose ``str`` is the actor's formatted traceback,
ANSI colours included. The original type and message survive only in that traceback's first
chained exception, so a reason cut to its first or last lines names
``RayTaskError(ClientAppException)`` and ``ClientAppException:`` instead of the error.

:func:`parse_client_error` finds the original: it splits a traceback at Python's chaining
lines, reads each link's exception line, and drops the wrappers Flower and Ray add.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: Flower's error reason: ``<class 'module.Type'>:<'message'>``
_FLOWER_REASON = re.compile(r"<class '(?P<type>[^']+)'>:<'(?P<body>.*)'>", re.DOTALL)
#: ANSI colour codes (Ray colours the process title of each traceback)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: the lines Python prints between the links of a chained traceback
_CHAIN = re.compile(r"^(The above exception was the direct cause of the following exception:"
                    r"|During handling of the above exception, another exception occurred:)$",
                    re.MULTILINE)
#: an exception line of a traceback: ``pkg.Type: message`` or a bare ``Type``
_EXCEPTION_LINE = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?:: (?P<msg>.*))?$")
#: the ClientAppException's message prefix (``flwr.clientapp.client_app.ClientAppException``)
_WRAPPED_MESSAGE = re.compile(r"^\s*Exception ClientAppException occurred\. Message: ",
                              re.DOTALL)


def _is_wrapper(type_name: str) -> bool:
    """Exceptions Flower and Ray raise around the ClientApp's own, never its cause."""
    short = type_name.rsplit(".", 1)[-1]
    return short == "ClientAppException" or short.startswith("RayTaskError")


@dataclass(frozen=True)
class ClientError:
    """What a ClientApp raised: ``type`` (as Python prints it, e.g. ``ValueError`` or
    ``torch.OutOfMemoryError``; "" when the reason names none), its ``message``, the
    ``causes`` chained below it (innermost first, each ``"Type: message"``), ``wrapper``
    (the exception type Flower reported when it differs, e.g.
    ``ray.exceptions.RayTaskError(ClientAppException)``) and ``traceback`` (the reason
    without colour codes when it holds one, else "")."""

    type: str
    message: str
    causes: tuple[str, ...] = ()
    wrapper: str = ""
    traceback: str = field(default="", repr=False)

    def __str__(self) -> str:
        head = f"{self.type}: {self.message}" if self.type and self.message else (
            self.type or self.message)
        if self.causes:
            head += f" (caused by {self.causes[0]})"
        if _PLAIN_BROADCAST_READ.search(self.message):
            head += ("; the broadcast holds every member as '<m>/<param>': read it with "
                     "fedfusion.client.initial_models(msg, model_fn)")
        return head


#: torch's error when a plain ``load_state_dict`` reads fedfusion's ``"<m>/<param>"``
#: broadcast (Flower's own examples load ``msg.content["arrays"]`` that way)
_PLAIN_BROADCAST_READ = re.compile(r'Unexpected key\(s\) in state_dict: "\d+/')


def _links(traceback: str) -> list[tuple[str, str]]:
    """The exceptions of a formatted (chained) traceback as ``(type, message)``, innermost
    first. In each link the exception line follows the last frame (``  File ...``) and its
    source and caret lines (indented by four spaces or more); the lines after it, whatever
    their indentation, continue its message."""
    found = []
    for link in _CHAIN.split(traceback):
        if _CHAIN.fullmatch(link.strip()):
            continue
        lines = link.strip("\n").splitlines()
        frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
        if not frames:
            continue
        start = frames[-1] + 1
        while start < len(lines) and lines[start].startswith("    "):
            start += 1
        match = _EXCEPTION_LINE.match(lines[start]) if start < len(lines) else None
        if match is None:
            continue
        message = "\n".join([match["msg"] or "", *lines[start + 1:]]).strip()
        found.append((match["type"], message))
    return found


def parse_client_error(reason: str) -> ClientError:
    """The ClientApp's exception in a Flower error ``reason`` (see the module docstring).

    A reason in neither of Flower's forms (e.g. an in-process grid's ``"Type: message"``)
    is returned as the message, with the type it starts with where it has one."""
    text = _ANSI.sub("", reason)
    flower = _FLOWER_REASON.fullmatch(text.strip())
    reported, body = (flower["type"], flower["body"]) if flower else ("", text.strip())
    links = _links(body) if "\n  File " in body else []
    own = [link for link in links if not _is_wrapper(link[0])]
    if own:
        (kind, message), inner = own[-1], own[:-1]
        return ClientError(kind, message, tuple(f"{t}: {m}" if m else t for t, m in inner),
                           wrapper=reported if reported != kind else "", traceback=body)
    if flower and _is_wrapper(reported):
        # no traceback to read: the wrapper's message is the original's, its type is lost
        message = _WRAPPED_MESSAGE.sub("", body).strip()
        return ClientError("", message, wrapper=reported, traceback=body if links else "")
    if flower:
        return ClientError(reported, body.strip())
    match = _EXCEPTION_LINE.match(body.splitlines()[0] if body else "")
    if match is not None and match["msg"] is not None and "\n" not in body:
        return ClientError(match["type"], match["msg"])
    return ClientError("", body)


#: Flower's error codes for replies the SuperLink (not the ClientApp) makes, as in
#: ``flwr.common.constant.ErrorCode`` (tests/flower/test_node_loss.py checks them against Flower's)
MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE = 3, 4, 5


def infrastructure_error(code: int, seconds: float | None) -> str | None:
    """The exclusion reason for an error reply the SuperLink made in the node's place
    (``code`` one of the three above), naming what happened and ``seconds`` after sending;
    None for any other code (an error of the ClientApp itself)."""
    after = f" after {seconds:.0f} s" if seconds is not None else ""
    if code == NODE_UNAVAILABLE:
        return (f"node unavailable (lost heartbeat){after}: the SuperLink stopped hearing "
                "from the node during the round (it left, crashed or lost its network)")
    if code == MESSAGE_UNAVAILABLE:
        return (f"message unavailable{after}: the round's message expired or the node was "
                "removed from the federation before it replied")
    if code == REPLY_MESSAGE_UNAVAILABLE:
        return f"reply expired{after}: the node's reply outlived its TTL before it was pulled"
    return None
