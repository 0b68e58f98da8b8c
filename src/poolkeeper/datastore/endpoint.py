"""The endpoint values every layer above reads: identity, scraped metrics, router-side load.

`Endpoint` is one model-server endpoint (a pod's ip:port, or a standalone server);
`EndpointMetrics` is what its last scrape said; `EndpointState` joins the two with the router's
own in-flight counts. The datastore builds them, the scrapers fill the metrics, and the
scheduler, admission, the simulator's virtual fleet and the benchmarks read them. They live at
the bottom of the stack (below the scheduler) so that the datastore and the backend never import
upward. Hot-path values: frozen, slotted dataclasses; no pydantic here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from poolkeeper.hostport import join_hostport

_EMPTY_LABELS: Mapping[str, str] = MappingProxyType({})
_EMPTY_COUNTS: Mapping[str, int] = MappingProxyType({})

# Metrics older than this are stale: admission counts the endpoint saturated and the filters
# skip it. The default of the one freshness setting, `spec.scraping.stalenessMs` (upstream's
# SD_METRICS_STALENESS_THRESHOLD, 200 ms: four missed scrapes at the 50 ms default interval).
DEFAULT_STALENESS_S = 0.2


# dataclasses reject unhashable defaults (a mappingproxy is one), so the shared empty mapping
# is handed out by a factory.
def empty_labels() -> Mapping[str, str]:
    """The shared, read-only empty label mapping."""
    return _EMPTY_LABELS


def empty_counts() -> Mapping[str, int]:
    """The shared, read-only empty count mapping."""
    return _EMPTY_COUNTS


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server endpoint (a pod's ip:port, or a standalone server)."""

    name: str
    address: str
    port: int
    namespace: str = "default"
    labels: Mapping[str, str] = field(default_factory=empty_labels, compare=False, hash=False)
    engine: str = "vllm"
    # `ip:port` (`[v6]:port`), the value of the x-gateway-destination-endpoint header. Computed
    # once here, because the scheduler reads it for every candidate of every decision.
    hostport: str = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hostport", join_hostport(self.address, self.port))


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """What the last scrape of an endpoint said. `updated_at` is a monotonic time in seconds."""

    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    active_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_adapters: int = 0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    updated_at: float = 0.0  # 0.0 = never scraped successfully
    error: str | None = None  # last scrape error, if the last attempt failed
    # The base model the server serves (vLLM and SGLang label every metric `model_name=...`);
    # None if the engine does not say. The base model is always resident, unlike adapters.
    served_model: str | None = None

    @property
    def reachable(self) -> bool:
        """The last scrape succeeded (what readiness and the pool's ready count go by).

        Deliberately not an age test: a scrape a little late must not flip readiness (and so
        the proxy's health check of the EPP); a failed one (refused, timed out, bad page) does.
        """
        return self.updated_at > 0.0 and self.error is None


@dataclass(frozen=True, slots=True)
class EndpointState:
    """The scheduler's view of one endpoint: identity, scraped metrics and router-side load.

    `inflight_requests` / `inflight_tokens` count requests this router sent to the endpoint and
    has not seen finish; `unseen_requests` / `unseen_tokens` are the part of those sent after the
    metrics were scraped, so not yet visible in `metrics.waiting` / `metrics.running`.
    `seconds_per_output_token` is the router's own observation of how fast the endpoint
    serves (`datastore/speed.py`: EWMA of sent-to-finished seconds per output token), None
    until a request there finished. `unseen_answered` is the part of the unseen requests whose
    first response byte already came back: running there, no longer queued, so the queue
    estimates (`datastore/load.py`) leave them out (0 where the router does not learn first
    bytes as they happen). `inflight_models` splits `inflight_requests` by the target model
    the request was sent for (base model or LoRA adapter; empty where the router does not
    say): a server that defers an adapter's requests (no adapter slot free) holds them in its
    queue without batch slots, and only this count says how many of the router's are such
    (`flowcontrol/slots.py`).
    """

    endpoint: Endpoint
    metrics: EndpointMetrics
    inflight_requests: int = 0
    inflight_tokens: int = 0
    unseen_requests: int = 0
    unseen_tokens: int = 0
    seconds_per_output_token: float | None = None
    unseen_answered: int = 0
    inflight_models: Mapping[str, int] = field(
        default_factory=empty_counts, compare=False, hash=False
    )

    @property
    def key(self) -> str:
        return self.endpoint.hostport

    def age(self, now: float) -> float:
        """Seconds since the last successful scrape (infinite if never scraped)."""
        if self.metrics.updated_at <= 0.0:
            return float("inf")
        return max(0.0, now - self.metrics.updated_at)
