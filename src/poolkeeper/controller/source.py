"""`ResourceSource`: the seam between where resources come from and the gateway that runs them.

A source feeds one datastore with InferencePools, InferenceModels and endpoints, and yields the
GatewayConfig the gateway runs with. The runtime (`server/runtime.py`) knows nothing else about
it: it calls `start()` once, runs `run()` as a root task until shutdown, and reads `statuses()`.

    source = factory(datastore)        # a SourceFactory, chosen by the CLI
    config = await source.start()      # first full load, applied; ConfigError lists problems
    await source.run()                 # keep the datastore in step (until cancelled)
    source.healthy()                   # readiness: synced
    source.stale_s()                   # seconds not kept in step (the last known state served)

Sources today: files with hot reload (`controller/files.py`), and the Kubernetes API server
(`controller/kubernetes/`: list, then watch pools, models and Pods; writes model status).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from poolkeeper.api.model import InferenceModelStatus
from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.datastore.store import Datastore

__all__ = ["ResourceSource", "SourceFactory"]


class ResourceSource(Protocol):
    """Feeds a datastore and yields the GatewayConfig."""

    def describe(self) -> str:
        """Where the resources come from, for logs (e.g. `files examples/`)."""
        ...

    async def start(self) -> GatewayConfig:
        """Load everything once and apply it to the datastore; the GatewayConfig in force.

        Raises ConfigError naming every problem (file, object, field path) when nothing
        usable could be loaded; the datastore is then left as it was.
        """
        ...

    async def run(self) -> None:
        """Keep the datastore in step with the source until cancelled; never raises."""
        ...

    def statuses(self) -> Mapping[str, InferenceModelStatus]:
        """The computed status of every InferenceModel the source provides, by `ns/name`."""
        ...

    def healthy(self) -> bool:
        """True once the first full load is applied. Readiness requires it; afterwards the
        last known state is served whatever the source does (files: a bad reload keeps the
        last good state; Kubernetes: an API outage keeps the last listed state)."""
        ...

    def stale_s(self) -> float:
        """Seconds the datastore has not been kept in step with the source (0 while it is)."""
        ...


SourceFactory = Callable[[Datastore], ResourceSource]
