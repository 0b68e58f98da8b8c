"""Draining the Envoy `serve` runs (reliability finding 2; docs/reliability.md): its listeners
held, then closed at once, the connections accepted last settled, every open connection told
to close, and the accepted requests waited for up to the grace period. Reads Envoy's own
counters from its admin (`envoy_stats`). The runtime calls `drain_envoy` on stop, before it
stops the supervisor (`server/runtime.py`, `server/managed_envoy.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable

import aiohttp

from poolkeeper.envoy.listen_hold import hold_new_connections, waiting
from poolkeeper.envoy.process import EnvoySupervisor

log = logging.getLogger("poolkeeper.server")

_ACTIVE_STAT = "http.gateway.downstream_rq_active"
# Between closing the listeners and telling open connections to close (see drain_envoy):
# until no connection waits on its connection-cap check and no new check has started for
# SETTLE_QUIET_S, at most a check's timeout (each ends by then) plus SETTLE_SLACK_S.
SETTLE_QUIET_S = 0.05
SETTLE_SLACK_S = 0.25
_CHECKS_ACTIVE = "ext_authz.client_cap.active"  # envoy/conncap.py's stat_prefix
_CHECKS_TOTAL = "ext_authz.client_cap.total"
# At most this long for Envoy to accept what is queued on its held listeners (hold_listeners).
HOLD_MAX_S = 2.0


async def hold_listeners(envoy: EnvoySupervisor, port: int, within_s: float) -> None:
    """New connections to `port` dropped, then wait (up to `within_s`) until Envoy has accepted
    every connection queued on its listening sockets: closing them would reset those."""
    process = envoy.process
    if process is None or process.returncode is not None:
        return
    # In the loop, not a thread: a few reads of /proc, and every moment spent here serves
    # keep-alive clients one more request (a thread hop under CPU load took longer).
    held = hold_new_connections(process.pid, port)
    if held:
        log.info("listener held: %d socket(s) drop new connections", len(held))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while held and waiting(port, held) > 0:
        if loop.time() >= deadline:
            log.warning("connections still queued on the listener; closing it anyway")
            return
        await asyncio.sleep(0.005)


async def drain_envoy(
    envoy: EnvoySupervisor,
    port: int,
    grace_s: float,
    *,
    settle_max_s: float,
    epp_active: Callable[[], int],
) -> None:
    """Stop accepting new connections now; wait for the accepted requests, up to `grace_s`.

    First `/drain_listeners` without `graceful` closes the listening sockets at once (a
    graceful drain alone would keep accepting for Envoy's drain time). A moment later,
    `/drain_listeners?graceful` starts Envoy's drain sequence, which with the `immediate`
    strategy tells every open connection to close: idle keep-alive connections are closed,
    a request on its way on one is answered with `connection: close`, HTTP/2 gets GOAWAY
    (round 2, finding 4: keep-alive clients were served for the whole drain, and whatever
    they sent last was cut when it ended). Between the two, `settle` lets the connections
    accepted just before the stop get their requests parsed (past the connection-cap
    check): until then Envoy counts them as idle, and would close them under a request the
    client already sent. Before all that, the listening sockets are held
    (envoy/listen_hold.py): closing a socket resets the connections still queued on it, so new
    ones are dropped first and the queue accepted.

    `port`: Envoy's public listener; `settle_max_s`: how long a connection may wait on its
    connection-cap check; `epp_active()`: the EPP's open ext_proc streams."""
    admin = envoy.options.admin_url or ""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        await hold_listeners(envoy, port, min(HOLD_MAX_S, grace_s))
        for query in ("", "?graceful"):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.post(f"{admin}/drain_listeners{query}") as resp:
                    await resp.read()
            if not query:
                await settle(session, admin, min(settle_max_s, grace_s))
        while loop.time() < deadline:
            envoy_active = (await envoy_stats(session, admin, _ACTIVE_STAT))[_ACTIVE_STAT]
            if epp_active() == 0 and envoy_active == 0:
                return
            await asyncio.sleep(0.1)
    log.warning("drain grace over with requests in flight; stopping anyway")


async def envoy_stats(session: aiohttp.ClientSession, admin: str, *names: str) -> dict[str, int]:
    """Envoy's counters and gauges of these names (0 for each one unknown: Envoy gone, or a
    stat it does not have, such as the cap's when there is no cap)."""
    found = dict.fromkeys(names, 0)
    pattern = "^(" + "|".join(re.escape(name) for name in names) + ")$"
    try:
        async with session.get(f"{admin}/stats", params={"filter": pattern}) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return found  # Envoy is gone: nothing of its own left to wait for
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in found and value.strip().isdigit():
            found[name.strip()] = int(value.strip())
    return found


async def settle(session: aiohttp.ClientSession, admin: str, within_s: float) -> None:
    """With the listeners closed, wait (up to `within_s`) until the connections Envoy accepted
    last have had their first bytes checked, and so their requests parsed (Envoy parses as the
    check lets the bytes through): until then Envoy counts such a connection as idle, and the
    drain would close it under a request the client has already sent. Done when no
    connection-cap check is in flight and none has started for `SETTLE_QUIET_S` (a client's
    request may follow its connect by a moment); without the cap, after that moment."""
    loop = asyncio.get_running_loop()
    begun = loop.time()
    last: int | None = None
    quiet_since = begun
    while loop.time() < begun + within_s:
        stats = await envoy_stats(session, admin, _CHECKS_ACTIVE, _CHECKS_TOTAL)
        started = stats[_CHECKS_TOTAL]
        if started != last:
            last, quiet_since = started, loop.time()
        elif stats[_CHECKS_ACTIVE] == 0 and loop.time() - quiet_since >= SETTLE_QUIET_S:
            break
        await asyncio.sleep(0.01)
    log.info("listeners closed; connections accepted last settled in %.2fs", loop.time() - begun)
