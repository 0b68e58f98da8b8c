"""Starting the Envoy the runtime runs: the per-client-address connection counter it asks
(on a loop of its own), the bootstrap parameters (the EPP's token, TLS, the endpoints file
kept in step with the pools), the supervisor and the wait until it is ready. What starting
leaves running is recorded on the runtime as it starts, so a failed start stops it again."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from poolkeeper.config.gateway import GatewayConfig
from poolkeeper.envoy.bootstrap import BootstrapParams
from poolkeeper.extproc.conncap import ConnectionCounter
from poolkeeper.extproc.conncap_service import build_conncap_server
from poolkeeper.server.envoy_bootstrap import bootstrap_params
from poolkeeper.server.envoy_drain import SETTLE_SLACK_S
from poolkeeper.server.managed_envoy import follow_endpoints, start_supervised, supervise
from poolkeeper.server.own_loop import OwnLoopServer
from poolkeeper.server.runtime_state import RuntimeState


class ManagedEnvoyStart(RuntimeState):
    """The runtime's start of the Envoy it runs (`GatewayRuntime` extends this)."""

    async def _start_conncap(
        self, config: GatewayConfig, params: BootstrapParams
    ) -> BootstrapParams:
        """The per-client-address connection counter for the Envoy about to start (loopback,
        the run's token), and the bootstrap parameters that make Envoy ask it."""
        limit = config.spec.edge.max_connections_per_client
        if limit <= 0:
            return params
        self.conncap = counter = ConnectionCounter(limit)
        token, timeout_s, listen = self._epp_token, params.conncap_timeout_s, params.listen_port
        # On a thread and loop of its own: Envoy lets a connection in uncounted when the
        # answer takes over `timeout_s`, and on this loop it waited behind the EPP's work.
        server = OwnLoopServer(
            lambda: build_conncap_server(counter, "127.0.0.1", token, timeout_s, listen),
            "conncap",
        )
        await server.start()
        self._grpc_servers.append(server)
        if self.metrics is not None:
            self.metrics.follow_client_connections(counter.exported)
        return dataclasses.replace(params, conncap_port=server.port)

    async def _start_envoy(self, config: GatewayConfig, binary: str) -> None:
        workdir = self.options.workdir
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="poolkeeper-")
            workdir = Path(self._tmp.name)
        workdir.mkdir(parents=True, exist_ok=True)
        endpoints_path, unsubscribe = follow_endpoints(workdir, self.datastore)
        self._unsubscribe.append(unsubscribe)
        params = bootstrap_params(
            config,
            self.datastore.snapshot(),
            endpoints_file=endpoints_path,
            managed=True,
            first_tokens_at_once=self.director is not None
            and self.director.wants_first_tokens_at_once,
        )
        params = dataclasses.replace(
            params, epp_token=self._epp_token, epp_tls=self.options.tls.secure_serving
        )
        params = await self._start_conncap(config, params)
        if params.conncap_port:
            self._settle_max_s = params.conncap_timeout_s + SETTLE_SLACK_S
        self.envoy, params = supervise(
            params,
            binary=binary,
            workdir=workdir,
            concurrency=self.options.envoy_concurrency,
            detached=self.detached,
            conncap=self.conncap,
        )
        await start_supervised(self.envoy, params)
