"""`--metrics-endpoint-auth`: who may read `/metrics`, asked of the API server as upstream's EPP
asks it (controller-runtime's `WithAuthenticationAndAuthorization`).

A scrape must carry `Authorization: Bearer <token>`. A TokenReview says whose token it is; a
SubjectAccessReview says whether that user (with its groups, uid and extra) may `get` the
non-resource path. No token or an unknown one: 401. Known but not allowed: 403. The API server
refusing or failing a review (the EPP's ServiceAccount lacks `create` on `tokenreviews` or
`subjectaccessreviews`, upstream issue #2370): 500, logged with the API server's message.
Only the paths named are guarded; the probes beside `/metrics` (`/healthz`, `/readyz`) stay
open, as the kubelet sends no token.

Verdicts are not cached: a scrape every 15-30 s costs two small API calls.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Protocol

from aiohttp import web
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.models.authorization_v1 import NonResourceAttributes, SubjectAccessReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.authorization_v1 import SubjectAccessReview

from poolkeeper.controller.kubernetes.api_errors import ApiUnavailable

__all__ = ["GUARDED_PATHS", "MetricsAuth", "ReviewApi"]

log = logging.getLogger(__name__)

GUARDED_PATHS = ("/metrics",)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ReviewApi(Protocol):
    async def review(self, review: Any) -> dict[str, Any]: ...


class MetricsAuth:
    """The authorizer and its aiohttp middleware (`middleware`)."""

    def __init__(
        self, api: ReviewApi | Callable[[], ReviewApi], paths: Collection[str] = GUARDED_PATHS
    ) -> None:
        # A factory is called at the first scrape, inside the serving event loop.
        self._api = api if not callable(api) else None
        self._factory = api if callable(api) else None
        self.paths = frozenset(paths)

    @property
    def api(self) -> ReviewApi:
        if self._api is None:
            assert self._factory is not None
            self._api = self._factory()
        return self._api

    async def verdict(self, authorization: str | None, path: str) -> tuple[int, str]:
        """(HTTP status, reason): 200 to serve, else the answer to send."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return 401, "Unauthorized"
        try:
            who = await self.api.review(TokenReview(spec=TokenReviewSpec(token=token)))
            if not who.get("authenticated"):
                return 401, "Unauthorized"
            user = who.get("user") or {}
            spec = SubjectAccessReviewSpec(
                user=user.get("username"),
                groups=user.get("groups"),
                uid=user.get("uid"),
                extra=user.get("extra"),
                nonResourceAttributes=NonResourceAttributes(path=path, verb="get"),
            )
            allowed = await self.api.review(SubjectAccessReview(spec=spec))
        except ApiUnavailable as exc:
            log.error("cannot authorize a metrics scrape: %s", exc)
            return 500, "Internal Server Error"
        if not allowed.get("allowed"):
            return 403, "Forbidden"
        return 200, "OK"

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in self.paths:
            return await handler(request)
        code, reason = await self.verdict(request.headers.get("Authorization"), request.path)
        if code != 200:
            return web.Response(status=code, text=reason + "\n")
        return await handler(request)
