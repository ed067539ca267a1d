"""Replaying a launch-bound step as one CUDA graph: the capture, and the eager steps around
it on the side stream the graph is captured on (CUDA graphs' recipe: warm-ups set up lazy
cuBLAS/cuDNN state outside the capture). Shared by the GPU trainer
(:mod:`fedfusion.accel.vmapped`) and the FedBEns server's steps
(:mod:`fedfusion.strategies.fedbens.server_optim`).

A capture that fails (:func:`try_capture`) marks the process (:func:`capture_failed`): its
callers then stay eager and try no other capture, because a broken capture can leave the
allocator's capture state behind (torch < 2.12).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("fedfusion")

#: a capture failed in this process; see :func:`capture_failed`
_failed = False


def capture_failed() -> bool:
    """Whether a capture failed in this process (then none is tried again)."""
    return _failed


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """One stream of its own for a step's warm-ups, capture and eager steps (None on other
    devices, whose steps are never graphed)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def capture(work: Callable[[], torch.Tensor], device: torch.device,
            stream: torch.cuda.Stream | None) -> Callable[[], torch.Tensor]:
    """``work`` recorded (not run) as a CUDA graph on ``stream``; a function that replays it
    and returns the tensor ``work`` returned, rewritten by each replay. Other threads' CUDA
    work is left alone during the capture (``thread_local``), and the thread's current stream
    is restored even when the capture fails."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device):
        current = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                output = work()
        finally:  # the graph restores the stream only when its capture succeeds
            torch.cuda.set_stream(current)

    def replay() -> torch.Tensor:
        with torch.cuda.device(device):  # a replay runs on the current device's stream
            graph.replay()
        return output
    return replay


def try_capture(work: Callable[[], torch.Tensor], device: torch.device,
                stream: torch.cuda.Stream | None, what: str) -> Callable[[], torch.Tensor] | None:
    """:func:`capture`, or None when ``work`` cannot be captured: then a warning names
    ``what`` and the process is marked (:func:`capture_failed`)."""
    global _failed
    try:
        return capture(work, device, stream)
    except RuntimeError as error:  # an operation that cannot be captured
        _failed = True
        log.warning("fedfusion: %s cannot be captured as a CUDA graph (%.200s); its steps "
                    "stay eager in this process", what, error)
        return None


def on_side_stream(work: Callable[[], torch.Tensor], device: torch.device,
                   side: torch.cuda.Stream | None) -> torch.Tensor:
    """``work`` run eagerly on ``side`` that waits for, and is waited for by, the current
    stream (how CUDA graphs' warm-ups must run); its output is marked as used there."""
    with torch.cuda.device(device):
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                output = work()
        finally:
            current.wait_stream(side)
    output.record_stream(current)
    return output
