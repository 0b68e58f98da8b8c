"""Every ext_proc test that serves runs on both transports (grpcio and the lean one)."""

from __future__ import annotations

import pytest

from tests.extproc.extproc_fakes import TRANSPORTS


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name
