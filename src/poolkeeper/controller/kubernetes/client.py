"""`KubeApi`: the few Kubernetes API calls the source, the status writer and the Lease need.

A thin adapter over lightkube's `AsyncClient` (configuration: in-cluster service account,
a kubeconfig file, or a bare server URL for tests; TLS, tokens and their refresh are
lightkube's). Objects travel as plain dicts, so the pure core never sees a client type, and
errors are narrowed to the cases the callers act on: `Gone` (410: re-list), `Conflict`
(409: re-read and retry), `NotFound` (404), `Throttled` (429 from API priority and fairness:
wait its `Retry-After`), `Forbidden` (403: RBAC refused; the message is the API server's
"cannot VERB resource ...", logged as is), `ApiUnavailable` (anything else: back off).

One watch request = one stream: `watch()` asks for bookmarks (`allowWatchBookmarks`, which
lightkube's public `watch()` does not expose, hence the one use of its request builder) and
yields every event, BOOKMARK included, so the caller always knows the version to resume from.

The errors are controller/kubernetes/api_errors.py's; `__all__` keeps this module their import
as well.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx2 as httpx
from lightkube import AsyncClient, KubeConfig
from lightkube.config.kubeconfig import SingleConfig
from lightkube.core.exceptions import ConfigError as LightkubeConfigError
from lightkube.core.generic_client import BasicRequest
from lightkube.core.resource_registry import resource_registry
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import PatchType

from poolkeeper.controller.kubernetes.api_errors import (
    ApiUnavailable,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    Throttled,
    narrow,
    status_error,
)
from poolkeeper.controller.kubernetes.objects import ResourceKind
from poolkeeper.errors import ConfigError

__all__ = ["ApiUnavailable", "Conflict", "Forbidden", "Gone", "KubeApi", "NotFound", "Throttled"]


def load_config(
    *, kubeconfig: Path | None = None, server: str | None = None, context: str | None = None
) -> SingleConfig:
    """In-cluster config, a kubeconfig file, or a bare server URL; ConfigError when unusable."""
    try:
        if server is not None:  # a bare URL, no credentials (tests, `kubectl proxy`)
            return KubeConfig.from_dict(
                {
                    "clusters": [{"name": "server", "cluster": {"server": server}}],
                    "users": [{"name": "anonymous", "user": {}}],
                    "contexts": [
                        {"name": "server", "context": {"cluster": "server", "user": "anonymous"}}
                    ],
                    "current-context": "server",
                }
            ).get()  # type: ignore[return-value]
        if kubeconfig is not None:
            if not kubeconfig.is_file():
                raise ConfigError(f"--kubeconfig {kubeconfig}: no such file")
            single = KubeConfig.from_file(kubeconfig).get(context_name=context)
        else:
            single = KubeConfig.from_env().get(context_name=context)
        if single is None:
            raise ConfigError("the Kubernetes configuration names no context to use")
        return single
    except ConfigError:
        raise
    except (LightkubeConfigError, OSError, ValueError, KeyError, TypeError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster or ~/.kube/config"
        raise ConfigError(f"cannot load the Kubernetes configuration ({where}): {exc}") from exc


class KubeApi:
    """List, watch, read, patch status and create/replace Leases in one namespace."""

    def __init__(self, config: SingleConfig, namespace: str, *, timeout_s: float = 10.0) -> None:
        self.namespace = namespace
        self.timeout_s = timeout_s
        self._client = AsyncClient(
            config, namespace=namespace, timeout=httpx.Timeout(timeout_s), trust_env=False
        )

    def _res(self, kind: ResourceKind) -> Any:
        return _resource_class(kind)

    def _in_ns(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        data = dict(obj)
        data["metadata"] = dict(data.get("metadata") or {}, namespace=self.namespace)
        return data

    async def close(self) -> None:
        await self._client.close()

    async def list(self, kind: ResourceKind) -> tuple[list[dict[str, Any]], str | None]:
        """Every object of `kind` in the namespace, and the list's resourceVersion."""
        try:
            async with asyncio.timeout(self.timeout_s):
                listing = self._client.list(self._res(kind), namespace=self.namespace)
                items = [_plain(obj, kind) async for obj in listing]
            version = getattr(listing, "_resourceVersion", None)
        except Exception as exc:
            raise narrow(exc) from exc
        return items, version

    async def watch(
        self, kind: ResourceKind, version: str | None, *, timeout_s: int = 300
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) events after `version`, BOOKMARKs included, until the stream ends."""
        generic = self._client._client
        br: BasicRequest = generic.prepare_request(
            "list",
            res=self._res(kind),
            namespace=self.namespace,
            watch=True,
            params={
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": timeout_s,
            },
        )
        request = generic._client.build_request(
            br.method, br.url, params=br.params, timeout=generic._watch_timeout
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await generic.send(request, stream=True)  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise narrow(exc) from exc
        # The server ends the stream after timeout_s; a silent, half-dead connection must not
        # hold the watch forever either.
        deadline = asyncio.get_running_loop().time() + timeout_s + self.timeout_s
        try:
            if response.status_code >= 400:
                await response.aread()
                raise status_error(
                    response.status_code, response.text, response.headers.get("Retry-After")
                )
            async with asyncio.timeout_at(deadline):
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        code = int(obj.get("code") or 500)
                        raise status_error(code, obj.get("message") or "")
                    yield str(event.get("type")), obj
        except ApiUnavailable:
            raise
        except Exception as exc:
            raise narrow(exc) from exc
        finally:
            await response.aclose()

    async def get(self, kind: ResourceKind, name: str) -> dict[str, Any]:
        try:
            obj = await self._client.get(self._res(kind), name, namespace=self.namespace)
        except Exception as exc:
            raise narrow(exc) from exc
        return _plain(obj, kind)

    async def patch_status(
        self, kind: ResourceKind, name: str, patch: Mapping[str, Any], *, field_manager: str
    ) -> dict[str, Any]:
        """Merge-patch the status subresource (a `metadata.resourceVersion` in the patch makes
        the API server refuse it with 409 when the object changed since)."""
        try:
            obj = await self._client.patch(
                self._res(kind).Status,
                name,
                dict(patch),
                namespace=self.namespace,
                patch_type=PatchType.MERGE,
                field_manager=field_manager,
            )
        except Exception as exc:
            raise narrow(exc) from exc
        return _plain(obj, kind)

    async def create(
        self, kind: ResourceKind, obj: Mapping[str, Any], *, field_manager: str | None = None
    ) -> dict[str, Any]:
        try:
            created = await self._client.create(
                self._res(kind).from_dict(self._in_ns(obj)), field_manager=field_manager
            )
        except Exception as exc:
            raise narrow(exc) from exc
        return _plain(created, kind)

    async def review(self, review: Any) -> dict[str, Any]:
        """Create a cluster-scoped review (lightkube's TokenReview or SubjectAccessReview
        resource: never stored, the verdict comes back) and return its status as a dict."""
        try:
            created = await self._client.create(review)
        except Exception as exc:
            raise narrow(exc) from exc
        status = getattr(created, "status", None)
        return dict(status.to_dict()) if status is not None else {}

    async def replace(
        self, kind: ResourceKind, obj: Mapping[str, Any], *, field_manager: str | None = None
    ) -> dict[str, Any]:
        """PUT the whole object (its `metadata.resourceVersion` guards against lost updates)."""
        try:
            replaced = await self._client.replace(
                self._res(kind).from_dict(self._in_ns(obj)), field_manager=field_manager
            )
        except Exception as exc:
            raise narrow(exc) from exc
        return _plain(replaced, kind)


_RESOURCES: dict[ResourceKind, Any] = {}


def _resource_class(kind: ResourceKind) -> Any:
    """lightkube's generic resource class for `kind`, made once per process: lightkube keeps a
    global registry, and for the core group its lookup misses what it registered ("/v1" vs
    "v1"), so a second `create_namespaced_resource` for Pods would be refused."""
    res = _RESOURCES.get(kind)
    if res is None:
        res = resource_registry.get(kind.api_version, kind.kind)
        if res is None:
            res = create_namespaced_resource(kind.group, kind.version, kind.kind, kind.plural)
        _RESOURCES[kind] = res
    return res


def _plain(obj: Any, kind: ResourceKind) -> dict[str, Any]:
    data: dict[str, Any] = dict(obj.to_dict()) if hasattr(obj, "to_dict") else dict(obj)
    data.setdefault("apiVersion", kind.api_version)
    data.setdefault("kind", kind.kind)
    return data
