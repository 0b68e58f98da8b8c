"""Suite-wide test settings.

Hypothesis: no per-example deadline and no "too slow" health check anywhere. Both are
wall-clock limits (200 ms an example, about a second to generate the first ones) that a loaded
machine fails without any bug; docs/testing.md: no test depends on wall-clock speed. Explicit
`@settings(...)` in a test module inherit this profile and may still set their own counts.
"""

from hypothesis import HealthCheck, settings

settings.register_profile("poolkeeper", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("poolkeeper")
