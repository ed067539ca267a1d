"""The Hypothesis settings every property test of the untrusted inputs runs with."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
