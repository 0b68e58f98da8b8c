"""`ScrapingConfig`: how model-server metrics are scraped (`spec.scraping` of a GatewayConfig).

    scraping:
      intervalMs: 50            # one scrape per endpoint every 50 ms (upstream default)
      timeoutMs: 1000           # whole request, body included
      maxResponseBytes: 4194304 # a bigger page is cut off and counted as a failed scrape
      stalenessMs: 200          # the one freshness setting: metrics older than this are stale
                                # (admission counts the endpoint saturated, filters skip it)
      maxBackoffMs: 1000        # a failing endpoint is retried at most this far apart
      path: /metrics
      scheme: http              # or https (certificates checked only if insecureSkipVerify false)
      insecureSkipVerify: true
      engineLabel: inference.networking.k8s.io/engine-type
      defaultEngine: vllm       # an engine name or alias (backend/engines/registry.py)
      client: lean              # or aiohttp (the HTTP client of the scrapes; same guarantees)

Upstream differences: the per-fetch timeout is 1 s here instead of 5-10 s, because a metrics page
slower than that is useless at a 50 ms cadence and would only hold a connection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, field_validator

from poolkeeper.backend.engines import resolve_engine
from poolkeeper.datastore.endpoint import DEFAULT_STALENESS_S
from poolkeeper.schema import CamelModel

__all__ = ["ENGINE_TYPE_LABEL", "ScrapingConfig"]

ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"


class ScrapingConfig(CamelModel, use_attribute_docstrings=True):
    """Settings of the per-endpoint metrics scrapers (camelCase in YAML)."""

    interval_ms: int = Field(default=50, ge=5, le=60_000)
    """Scrape period per endpoint, in milliseconds (upstream default 50)."""
    timeout_ms: int = Field(default=1000, ge=10, le=60_000)
    """Limit for one whole scrape (connect, headers and body), in milliseconds."""
    max_response_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    """Largest accepted metrics page; a bigger one is cut off and counts as a failed scrape."""
    staleness_ms: int = Field(default=round(DEFAULT_STALENESS_S * 1000), ge=1, le=3_600_000)
    """The one freshness setting: metrics older than this are stale, so admission counts the
    endpoint as saturated and the stale-metrics and saturation filters skip it (default 200,
    upstream's SD_METRICS_STALENESS_THRESHOLD). Readiness does not use it: it follows whether
    the last scrape succeeded."""
    max_backoff_ms: int = Field(default=1000, ge=5, le=60_000)
    """Longest wait between retries of a failing endpoint (the delay doubles per failure)."""
    path: str = "/metrics"
    """HTTP path of the metrics page."""
    scheme: Literal["http", "https"] = "http"
    """http or https."""
    insecure_skip_verify: bool = True
    """With https: do not verify the server certificate (upstream default)."""
    engine_label: str = Field(default=ENGINE_TYPE_LABEL, min_length=1)
    """Endpoint (pod) label naming the engine type of the server."""
    default_engine: str = "vllm"
    """Engine type of endpoints without the label: a name or alias from the engine table
    (Engines, above)."""

    client: Literal["lean", "aiohttp"] = "lean"
    """HTTP client of the scrapes: `lean`, one reused keep-alive connection per endpoint on an
    asyncio protocol (backend/httpget.py; about 2.5x less CPU per GET than aiohttp), or `aiohttp`,
    the earlier client, kept selectable. Same limits, timeout and error rule either way."""

    @field_validator("path")
    @classmethod
    def _path_is_absolute(cls, value: str) -> str:
        if not value.startswith("/") or any(c in value for c in " \t\r\n#"):
            raise ValueError("must be an absolute URL path such as /metrics")
        return value

    @field_validator("default_engine")
    @classmethod
    def _engine_is_known(cls, value: str) -> str:
        return resolve_engine(value).value  # raises ValueError naming the known engines

    @property
    def interval_s(self) -> float:
        return self.interval_ms / 1000.0

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000.0

    @property
    def staleness_s(self) -> float:
        return self.staleness_ms / 1000.0

    @property
    def max_backoff_s(self) -> float:
        return self.max_backoff_ms / 1000.0

    def engine_for(self, labels: Mapping[str, str], explicit: str | None = None) -> str:
        """An endpoint's engine: explicit setting, else its engine label, else the default.

        The result is the canonical built-in name; ValueError for an unknown engine type.
        """
        chosen = explicit or labels.get(self.engine_label) or self.default_engine
        return resolve_engine(chosen).value
