"""Starting the Envoy `serve` runs: the routed cluster's endpoints file (rewritten on every
pool change), the bootstrap file (the EPP's token inside: 0600), the supervisor (a dead
Envoy's routed requests settled at once), and the wait until it is ready and has seen the
EPP healthy. The runtime decides the parameters (`server/envoy_bootstrap.py`, the connection
cap) and keeps the supervisor; stopping it is `server/envoy_drain.py`'s drain, then the
supervisor's stop."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from poolkeeper.datastore.snapshot import DatastoreSnapshot
from poolkeeper.datastore.store import Datastore
from poolkeeper.envoy.bootstrap import BootstrapParams, build_bootstrap, render
from poolkeeper.envoy.endpoints_file import EndpointsFile
from poolkeeper.envoy.params import EPP_CLUSTER, downstream_connection_cap
from poolkeeper.envoy.process import EnvoyOptions, EnvoySupervisor, raise_descriptor_limit
from poolkeeper.extproc.accesslog import DetachedExchanges
from poolkeeper.extproc.conncap import ConnectionCounter

log = logging.getLogger("poolkeeper.server")


def follow_endpoints(workdir: Path, datastore: Datastore) -> tuple[Path, Callable[[], None]]:
    """The routed cluster's endpoints file in `workdir`, written now and rewritten whenever
    the pools change (hot reload): its path, and the unsubscribe that stops the rewrites."""
    endpoints = EndpointsFile(workdir / "endpoints.json")
    endpoints.write(e.hostport for e in datastore.snapshot().all_endpoints())

    def rewrite(snapshot: DatastoreSnapshot, _kind: object) -> None:
        endpoints.write(e.hostport for e in snapshot.all_endpoints())

    return endpoints.path, datastore.subscribe(rewrite)


def supervise(
    params: BootstrapParams,
    *,
    binary: str,
    workdir: Path,
    concurrency: int,
    detached: DetachedExchanges | None,
    conncap: ConnectionCounter | None,
) -> tuple[EnvoySupervisor, BootstrapParams]:
    """The supervisor of an Envoy on `params` (not started) and the parameters it runs with:
    the connection cap lowered below the raised descriptor limit, the bootstrap written to
    `workdir`. When that Envoy dies, `detached`'s waiting exchanges are settled and
    `conncap`'s counts cleared (their access-log entries and closes never come)."""
    # Envoy inherits the raised descriptor limit; its connection cap stays below it, so
    # idle connections are refused by the cap, never by descriptors running out.
    descriptors = raise_descriptor_limit()
    cap = min(params.max_downstream_connections, downstream_connection_cap(descriptors))
    params = dataclasses.replace(params, max_downstream_connections=cap)
    config_path = workdir / "envoy.json"
    # The bootstrap holds the EPP's token: readable by this user only.
    config_path.unlink(missing_ok=True)
    config_path.touch(mode=0o600)
    config_path.write_text(render(build_bootstrap(params)))
    envoy = EnvoySupervisor(
        EnvoyOptions(
            binary=binary,
            config_path=config_path,
            log_path=workdir / "envoy.log",
            concurrency=concurrency,
            admin_url=f"http://127.0.0.1:{params.admin_port}",
        )
    )

    def died() -> None:  # a dead Envoy's access-log entries never come
        if detached is not None:
            settled = detached.give_up_all("envoy died")
            log.warning("envoy died: %d routed request(s) settled as unknown", settled)
        if conncap is not None:
            conncap.clear()

    envoy.on_death = died
    return envoy, params


async def start_supervised(envoy: EnvoySupervisor, params: BootstrapParams) -> None:
    """Start `envoy` and wait until it is ready (and, with the EPP's health check on, has
    seen the EPP healthy: a warning if not yet, serving anyway)."""
    await envoy.start()
    await envoy.wait_ready()
    if params.epp_health_interval_s > 0 and not await envoy.wait_healthy(EPP_CLUSTER):
        log.warning("envoy has not seen the endpoint picker healthy yet; serving anyway")
    log.info(
        "envoy listening http=%s:%d failure_mode=%s max_connections=%d",
        params.listen_address,
        params.listen_port,
        "FailOpen" if params.fail_open else "FailClose",
        params.max_downstream_connections,
    )
