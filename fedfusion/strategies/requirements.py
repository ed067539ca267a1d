"""Every model requirement a strategy may name in its train config, with its function: what a
client checks on the models it was sent before it trains (:mod:`fedfusion.core.model_check`)."""

from __future__ import annotations

from collections.abc import Mapping

from fedfusion.core.model_check import REQUIREMENTS, Requirement
from fedfusion.strategies.otfusion import OTFusion
from fedfusion.strategies.pfnm import PFNM

#: the requirements of :mod:`fedfusion.core.model_check` and of every strategy, by name
ALL_REQUIREMENTS: Mapping[str, Requirement] = {
    **REQUIREMENTS, **OTFusion.requirement_checks, **PFNM.requirement_checks}
