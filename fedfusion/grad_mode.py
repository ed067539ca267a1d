"""Work that needs gradients, whatever autograd mode the caller is in.

Training, curvature fits and the server's optimisations differentiate; a caller that wraps a
fedfusion call in ``torch.no_grad()`` or ``torch.inference_mode()`` (as evaluation code does)
must get the same result as without it, not an error or, worse, another estimator.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def gradients_on() -> Iterator[None]:
    """Inside: autograd on and inference mode off; after: the caller's modes as they were."""
    with torch.inference_mode(False), torch.enable_grad():
        yield
