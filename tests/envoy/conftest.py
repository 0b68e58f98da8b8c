"""The ext_proc tests behind real Envoy run on both transports (grpcio and the lean one)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["grpcio", "lean"])
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name
