"""`--metrics-endpoint-auth`: /metrics behind a TokenReview and a SubjectAccessReview, asked of
the API-server double as upstream's EPP asks a real one."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from poolkeeper.cli import serve as serve_cli, serve_setup
from poolkeeper.controller.kubernetes.client import KubeApi, load_config
from poolkeeper.controller.kubernetes.metricsauth import MetricsAuth
from poolkeeper.errors import ConfigError
from tests.kube.conftest import API_TIMEOUT_S, NS
from tests.kube.fakeapi import FakeApiServer

PROMETHEUS = "system:serviceaccount:monitoring:prometheus"
OTHER = "system:serviceaccount:default:someone"


def _text(body: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=body)

    return handler


@pytest.fixture
async def metrics_url(fake: FakeApiServer) -> AsyncIterator[str]:
    """A metrics server (/metrics and /healthz) behind the middleware, on 127.0.0.1."""
    fake.tokens["prom-token"] = {"username": PROMETHEUS, "groups": ["system:serviceaccounts"]}
    fake.tokens["other-token"] = {"username": OTHER}
    fake.may_get.add((PROMETHEUS, "/metrics"))
    api = KubeApi(load_config(server=fake.url), NS, timeout_s=API_TIMEOUT_S)
    app = web.Application(middlewares=[MetricsAuth(lambda: api).middleware])
    app.router.add_get("/metrics", _text("up 1\n"))
    app.router.add_get("/healthz", _text("ok\n"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await api.close()


async def _get(url: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        return resp.status, await resp.text()


async def test_an_allowed_token_reads_metrics(metrics_url: str, fake: FakeApiServer) -> None:
    assert await _get(f"{metrics_url}/metrics", "prom-token") == (200, "up 1\n")
    posted = [r for r in fake.requests if r.startswith("POST")]
    assert posted == [
        "POST /apis/authentication.k8s.io/v1/tokenreviews",
        "POST /apis/authorization.k8s.io/v1/subjectaccessreviews",
    ]


@pytest.mark.parametrize(
    ("token", "status"),
    [(None, 401), ("unknown-token", 401), ("other-token", 403)],
)
async def test_anonymous_unknown_and_unauthorized_scrapes_are_refused(
    metrics_url: str, token: str | None, status: int
) -> None:
    assert (await _get(f"{metrics_url}/metrics", token))[0] == status


async def test_probes_stay_open(metrics_url: str) -> None:
    assert await _get(f"{metrics_url}/healthz") == (200, "ok\n")


async def test_without_permission_to_review_a_scrape_gets_500(
    metrics_url: str, fake: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    fake.forbidden.add(("create", "tokenreviews"))  # upstream issue #2370's Role
    assert (await _get(f"{metrics_url}/metrics", "prom-token"))[0] == 500
    assert 'cannot create resource "tokenreviews"' in caplog.text


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_the_flag_needs_kubernetes_mode(fake: FakeApiServer) -> None:
    assert serve_setup._metrics_auth(_parse("-f", "x.yaml")) == ()
    with pytest.raises(ConfigError, match="--metrics-endpoint-auth needs --kubernetes"):
        serve_setup._metrics_auth(_parse("-f", "x.yaml", "--metrics-endpoint-auth"))
