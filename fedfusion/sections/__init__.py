"""Upload sections: what a client computes for each section of its upload and how the server
checks it, as one table (:data:`SECTIONS`: name -> :class:`Section`).

* :mod:`fedfusion.sections.base`: :class:`Section` (builder, validator, value cap), the caps;
* :mod:`fedfusion.sections.options`: :class:`SectionOptions`, how a client computes them;
* :mod:`fedfusion.sections.weights`: ``weights``, the member's ``state_dict``;
* :mod:`fedfusion.sections.curvature`: ``curvature.<structure>``, Laplace curvature;
* :mod:`fedfusion.sections.gram`: ``gram``, per linear layer the Gram of its inputs;
* :mod:`fedfusion.sections.table`: :data:`SECTIONS` and :func:`build_section`.

The wire format (:mod:`fedfusion.wire`) sits above: it validates an upload against a table it
is given. Nothing registers at import; a user's section goes into a table of their own.
"""

from fedfusion.sections.base import (
    MAX_ABS_CURVATURE,
    MAX_ABS_DEFAULT,
    MAX_ABS_GRAM,
    MAX_ABS_WEIGHT,
    WEIGHTS,
    Section,
    SectionBuilder,
    SectionValidator,
)
from fedfusion.sections.curvature import CURVATURE_PREFIX, curvature_section
from fedfusion.sections.options import SectionOptions
from fedfusion.sections.table import SECTIONS, SectionTable, build_section
from fedfusion.sections.weights import check_array_names

__all__ = [
    "CURVATURE_PREFIX",
    "MAX_ABS_CURVATURE",
    "MAX_ABS_DEFAULT",
    "MAX_ABS_GRAM",
    "MAX_ABS_WEIGHT",
    "SECTIONS",
    "WEIGHTS",
    "Section",
    "SectionBuilder",
    "SectionOptions",
    "SectionTable",
    "SectionValidator",
    "build_section",
    "check_array_names",
    "curvature_section",
]
