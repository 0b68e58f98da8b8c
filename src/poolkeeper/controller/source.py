"""`ResourceSource`: the seam between where resources come from and the gateway that runs them.

A source feeds one datastore with InferencePools, InferenceModels and endpoints, and yields the
GatewayConfig the gateway runs with. The runtime (`server/runtime.py`) knows nothing else about
it: it calls `start()` once, runs `run()` as a root task until shutdown, and reads `statuses()`.

    source = factory(datastore)        # a SourceFactory, chosen by the CLI
    config = await source.start()      # first full load, applied; ConfigError lists problems
    await source.run()                 # keep the datastore in step (until cancelled)

Sources today: files with hot reload (`controller/files.py`). A Kubernetes source (list/watch of
pools, models and Pods) plugs in here the same way.
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


SourceFactory = Callable[[Datastore], ResourceSource]
