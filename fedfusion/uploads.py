"""Client side of the upload format: what a client computes for each upload section.

The server's strategy names the sections it needs (``config["sections"]``); the ClientApp
runs the registered builder of each on every trained member. Builders for curvature and
statistics register themselves here with :func:`register_builder`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fedfusion.config import Settings
from fedfusion.payload import WEIGHTS, NumpyDict

SectionBuilder = Callable[[nn.Module, torch.Tensor, torch.Tensor, Settings], NumpyDict]
_BUILDERS: dict[str, SectionBuilder] = {}


def register_builder(section: str) -> Callable[[SectionBuilder], SectionBuilder]:
    def decorator(builder: SectionBuilder) -> SectionBuilder:
        _BUILDERS[section] = builder
        return builder

    return decorator


def build_section(section: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  settings: Settings) -> NumpyDict:
    if section not in _BUILDERS:
        raise ValueError(f"this client cannot compute upload section {section!r}; "
                         f"known: {sorted(_BUILDERS)}")
    return _BUILDERS[section](model, x, y, settings)


@register_builder(WEIGHTS)
def model_weights(model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: Settings
                  ) -> NumpyDict:
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}
