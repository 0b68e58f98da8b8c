"""Suite-wide test settings.

Hypothesis: no per-example deadline and no "too slow" health check anywhere. Both are
wall-clock limits (200 ms an example, about a second to generate the first ones) that a loaded
machine fails without any bug; docs/testing.md: no test depends on wall-clock speed. Explicit
`@settings(...)` in a test module inherit this profile and may still set their own counts.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("poolkeeper", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("poolkeeper")


@pytest.fixture(autouse=True)
async def _client_streams_closed(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """Fail the test that leaves an `asyncio.open_connection` stream open.

    A writer never closed is only reported when the garbage collector reaches it: after its
    event loop is gone, in whichever test happens to run then (Python 3.11's
    `StreamWriter.__del__` warns "loop is closed", an unraisable error under
    `filterwarnings = error`), so a leak in one file failed an unrelated test in another now
    and then. Tracking the writers each test opens puts the failure where the leak is; this
    teardown runs on the test's loop, so it can still close them."""
    opened: list[asyncio.StreamWriter] = []
    real = asyncio.open_connection

    async def tracking(
        *args: Any, **kwargs: Any
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await real(*args, **kwargs)
        opened.append(writer)
        return reader, writer

    monkeypatch.setattr(asyncio, "open_connection", tracking)
    yield
    leaked = [w for w in opened if not w.transport.is_closing()]
    for writer in leaked:
        writer.transport.abort()
    await asyncio.sleep(0)  # let the aborts run their callbacks on this loop
    assert not leaked, f"{len(leaked)} stream(s) from asyncio.open_connection left open"
