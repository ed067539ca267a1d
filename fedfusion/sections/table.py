"""The table of upload sections, :data:`SECTIONS`: name -> :class:`~fedfusion.sections.base.Section`
(builder, validator, value cap), and :func:`build_section`, the client's lookup in it.

The server validates an upload against a table and the client builds from one; both take
:data:`SECTIONS` unless given another (``section_table=`` of a strategy and of
:func:`fedfusion.client.make_upload`). A user's own section is an entry of a table of their
own, ``{**SECTIONS, "mine": Section(builder, validator, cap)}``, passed to both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import torch
from torch import nn

from fedfusion.curvature import STRUCTURES
from fedfusion.sections.base import WEIGHTS, Section
from fedfusion.sections.curvature import curvature_entry, curvature_section
from fedfusion.sections.gram import GRAM_SECTION
from fedfusion.sections.options import SectionOptions
from fedfusion.sections.weights import WEIGHTS_SECTION

SectionTable = Mapping[str, Section]

#: every section fedfusion's strategies ask for; read-only (extend a copy)
SECTIONS: SectionTable = MappingProxyType({
    WEIGHTS: WEIGHTS_SECTION,
    **{curvature_section(structure): curvature_entry(structure) for structure in STRUCTURES},
    # RegMean's and OTFusion's statistic: per Linear/Conv2d weight, the Gram of its inputs
    "gram": GRAM_SECTION,
})


def build_section(section: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  options: SectionOptions, built: Mapping[str, dict[str, np.ndarray]] | None = None,
                  table: SectionTable = SECTIONS) -> dict[str, np.ndarray]:
    """Section ``section`` of one trained member, by ``table``'s builder; ``built`` holds the
    member's sections computed before it (a builder may reuse one: ``diag_full`` reuses
    ``curvature.diag``)."""
    if section not in table:
        raise ValueError(f"this client cannot compute upload section {section!r}; "
                         f"known: {sorted(table)}")
    return table[section].builder(model, x, y, options, built or {})
