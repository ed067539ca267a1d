"""What an upload section is: a builder (client side), a validator (server side) and a cap
on the magnitude of its values, kept together in one :class:`Section`.

The caps bound every value of every array of a section, ``|v| <= value_cap``. Measured on
honest uploads (bias-free LeNet trained 20 epochs on all 59,800 FMNIST training samples in
ONE client, the largest a client here gets; MLP 2x100 likewise, 5 epochs): weights <= 1.5;
curvature <= 1.7e4 (diag GGN; Kron factor eigenvalues <= 5.2e3, diag_full block <= 1.6e4),
i.e. about 0.3 per sample, as the GGN is a sum over samples; Gram matrices <= 3.8e7 (conv1 of
LeNet, summed over samples and 576 positions).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedfusion.sections.options import SectionOptions

#: the section every upload carries: each member's ``state_dict``
WEIGHTS = "weights"

#: weights: 7000x the largest honest value; bias-free nets far from it diverged anyway
MAX_ABS_WEIGHT = 1e4
#: curvature entries (Kron eigenvalues, GGN diagonals and blocks): 0.3 per sample for
#: 10**9 samples (the default cap on ``num-examples``) stays below it. It keeps FedBEns'
#: float32 objective finite: a Kron eigenvalue is a product of two entries, so the quadratic
#: form is at most ||w - m||^2 * cap^2 / T <= (2 * MAX_ABS_WEIGHT)^2 * d * 1e18 / T, 4e35
#: for d = 1e6 parameters and T = 0.01, below float32's 3.4e38.
MAX_ABS_CURVATURE = 1e9
#: RegMean Gram matrices: 2.6e7x the largest honest value (they grow with samples x positions)
MAX_ABS_GRAM = 1e15
#: a section that names no cap of its own (a user's)
MAX_ABS_DEFAULT = 1e15

#: (trained member, client inputs, labels, options, the member's sections built so far) -> arrays
SectionBuilder = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, SectionOptions, Mapping[str, dict[str, np.ndarray]]],
    dict[str, np.ndarray]]
#: (a member's arrays of the section, the model's parameter shapes) -> None; raises ValueError
#: naming the array at fault
SectionValidator = Callable[[Mapping[str, np.ndarray], Mapping[str, tuple[int, ...]]], None]


@dataclass(frozen=True)
class Section:
    """One upload section. ``builder`` computes a trained member's arrays on the client;
    ``validator`` checks them on the server (after the wire format's own checks: names,
    dtypes, finiteness); every value must satisfy ``|v| <= value_cap``."""

    builder: SectionBuilder
    validator: SectionValidator
    value_cap: float = MAX_ABS_DEFAULT
