"""The real-engine checks run only when asked (`-m real_engine`, `make e2e-real`), and then
need the test-time packages: without them every such test fails with the install command."""

from __future__ import annotations

import pytest

from tests.realengine.llama import RealEngineMissing, model_path, server_binary


@pytest.fixture(scope="session")
def real_engine() -> None:
    try:
        server_binary()
        model_path()
    except RealEngineMissing as exc:
        pytest.fail(f"{exc} (or run `make e2e-real`, which installs both)")
