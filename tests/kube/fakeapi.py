"""A small Kubernetes API server for tests: the list/watch/status/Lease protocol, with faults.

Why not kmock: kmock 0.8 (measured in shared/reference/ecosystem.md) keeps no
resourceVersion, never answers 410 Gone, has no optimistic concurrency (409) and ignores label
selectors. Those are exactly the behaviours the Kubernetes source must survive, so the tests
use this project-owned server instead (aiohttp, on 127.0.0.1).

What it speaks, like kube-apiserver:
- LIST  GET  /apis/G/V/namespaces/NS/PLURAL (and /api/v1/... for pods): items without
  apiVersion/kind, `metadata.resourceVersion` of the list.
- WATCH the same with `?watch=true&resourceVersion=RV[&allowWatchBookmarks=true]`: JSON lines
  `{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`; a version older than the
  compaction point gets an ERROR event with a 410 Status; `timeoutSeconds` ends the stream.
- GET one, POST create (409 AlreadyExists), PUT replace (409 on a stale resourceVersion),
  PATCH merge to the object or its `/status` subresource (409 on a stale resourceVersion in
  the patch). Errors are `Status` objects. Every object gets uid, generation (bumped on spec
  changes), creationTimestamp and a cluster-wide increasing resourceVersion.
- Two versions of one group/plural share their objects (one CRD serving two versions).

Faults: `compact()` (next watches from older versions get 410), `drop_watches()` (streams cut
mid-chunk), `lose_next_delete()`, `conflicts` (the next N status writes get 409), `stop()` /
`start()` (the server is down: connections refused), `unserved` (versions answering 404).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

SERVED: dict[tuple[str, str, str], str] = {
    ("inference.networking.x-k8s.io", "v1alpha1", "inferencepools"): "InferencePool",
    ("inference.networking.x-k8s.io", "v1alpha2", "inferencepools"): "InferencePool",
    ("inference.networking.k8s.io", "v1", "inferencepools"): "InferencePool",
    ("inference.networking.x-k8s.io", "v1alpha1", "inferencemodels"): "InferenceModel",
    ("inference.networking.x-k8s.io", "v1alpha2", "inferencemodels"): "InferenceModel",
    ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives"): "InferenceObjective",
    (
        "inference.networking.x-k8s.io",
        "v1alpha2",
        "inferencemodelrewrites",
    ): "InferenceModelRewrite",
    ("", "v1", "pods"): "Pod",
    ("coordination.k8s.io", "v1", "leases"): "Lease",
}


@dataclass
class Write:
    plural: str
    name: str
    field_manager: str | None
    subresource: str | None
    method: str


@dataclass
class _Watcher:
    store: tuple[str, str]
    namespace: str
    queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = field(default_factory=asyncio.Queue)


def status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip
    return web.json_response(body, status=code)


class FakeApiServer:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = {}
        self.rv = 100
        self.compacted = 0  # watches from a version below this get 410
        self.events: list[tuple[int, tuple[str, str], str, dict[str, Any]]] = []
        self.watchers: list[_Watcher] = []
        self.writes: list[Write] = []
        self.requests: list[str] = []
        self.headers_seen: list[tuple[str, ...]] = []
        self.conflicts = 0
        self.unserved: set[tuple[str, str, str]] = set()
        self._lose_delete = 0
        self._uids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.watch_count = 0
        self.empty_watches = False  # fault: every watch ends at once, without an event

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen on 127.0.0.1 (the same port again after `stop`).

        The port is taken below the kernel's ephemeral range on purpose: a client retrying a
        closed ephemeral port can connect to itself (TCP simultaneous open) and then wait
        forever for an answer, which happened here while the server was down."""
        if not self.port:
            self.port = _port_below_ephemeral()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()

    async def stop(self) -> None:
        """The API server goes away: streams are cut, new connections refused."""
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- state changes (what kubectl / the kubelet would do) -----------------------------------

    @staticmethod
    def store_of(api_version: str, plural: str) -> tuple[str, str]:
        group = api_version.rpartition("/")[0]
        return (group, plural)

    def _bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    def put(self, obj: Mapping[str, Any], plural: str) -> dict[str, Any]:
        """Create or replace (server side: no version check); emits ADDED or MODIFIED."""
        store = self.store_of(str(obj["apiVersion"]), plural)
        data = copy.deepcopy(dict(obj))
        meta = data.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        old = self.objects.setdefault(store, {}).get(key)
        if old is None:
            stamp = f"2026-01-01T00:{self.rv // 60 % 60:02d}:{self.rv % 60:02d}Z"
            meta.update(uid=f"uid-{next(self._uids)}", generation=1, creationTimestamp=stamp)
        else:
            for k in ("uid", "creationTimestamp", "generation"):
                meta[k] = old["metadata"][k]
            if data.get("spec") != old.get("spec"):
                meta["generation"] = old["metadata"]["generation"] + 1
            if "status" not in data and "status" in old:
                data["status"] = old["status"]
        meta["resourceVersion"] = self._bump()
        self.objects[store][key] = data
        self._emit(store, "ADDED" if old is None else "MODIFIED", data)
        return data

    def delete(self, api_version: str, plural: str, namespace: str, name: str) -> None:
        store = self.store_of(api_version, plural)
        obj = self.objects.get(store, {}).pop((namespace, name))
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._bump()
        if self._lose_delete:
            self._lose_delete -= 1
            return
        self._emit(store, "DELETED", obj)

    def get(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any]:
        return self.objects[self.store_of(api_version, plural)][(namespace, name)]

    def _emit(self, store: tuple[str, str], kind: str, obj: dict[str, Any]) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self.events.append((rv, store, kind, copy.deepcopy(obj)))
        for w in self.watchers:
            if w.store == store and obj["metadata"]["namespace"] == w.namespace:
                w.queue.put_nowait((kind, obj))

    # --- faults --------------------------------------------------------------------------------

    def compact(self, upto: int | None = None) -> None:
        """Forget the event history: watches from a version below `upto` (default: the
        current one, so only a fresh list's version is still good) get 410 Gone."""
        self.compacted = self.rv if upto is None else upto
        self.events = [e for e in self.events if e[0] > self.compacted]

    def drop_watches(self) -> None:
        for w in self.watchers:
            w.queue.put_nowait(None)

    def end_watches(self) -> None:
        """End every stream cleanly, as `timeoutSeconds` does (clients resume from a version)."""
        for w in self.watchers:
            w.queue.put_nowait(("END", {}))

    def lose_next_delete(self, n: int = 1) -> None:
        self._lose_delete += n

    def bookmark(self) -> None:
        for w in self.watchers:
            w.queue.put_nowait(("BOOKMARK", {"metadata": {"resourceVersion": str(self.rv)}}))

    # --- HTTP ----------------------------------------------------------------------------------

    def _route(self, path: str) -> tuple[tuple[str, str, str], str, str | None, str | None] | None:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        if len(rest) < 3 or rest[0] != "namespaces":
            return None
        namespace, plural = rest[1], rest[2]
        name = rest[3] if len(rest) > 3 else None
        sub = rest[4] if len(rest) > 4 else None
        return (group, version, plural), namespace, name, sub

    def _out(
        self, gvp: tuple[str, str, str], obj: dict[str, Any], *, item: bool = False
    ) -> dict[str, Any]:
        data = copy.deepcopy(obj)
        group, version, _ = gvp
        if item:
            data.pop("apiVersion", None)
            data.pop("kind", None)
        else:
            data["apiVersion"] = f"{group}/{version}" if group else version
            data["kind"] = SERVED[gvp]
        return data

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path_qs}")
        self.headers_seen.append(tuple(request.headers))
        route = self._route(request.path)
        if route is None or route[0] not in SERVED or route[0] in self.unserved:
            return status(404, "NotFound", f"the server could not find {request.path}")
        gvp, namespace, name, sub = route
        store = (gvp[0], gvp[2])
        objects = self.objects.setdefault(store, {})
        q = request.query
        if request.method == "GET" and name is None:
            if q.get("watch") in ("true", "1"):
                return await self._watch(request, gvp, store, namespace)
            items = [self._out(gvp, o, item=True) for (ns, _), o in sorted(objects.items())
                     if ns == namespace]  # fmt: skip
            listing = {"kind": SERVED[gvp] + "List", "apiVersion": gvp[1],
                       "metadata": {"resourceVersion": str(self.rv)}, "items": items}  # fmt: skip
            return web.json_response(listing)
        if request.method == "POST" and name is None:
            body = await request.json()
            key = (namespace, body["metadata"]["name"])
            if key in objects:
                return status(409, "AlreadyExists", f"{gvp[2]} {key[1]} already exists")
            body["metadata"]["namespace"] = namespace
            created = self.put(dict(body, apiVersion=self._out(gvp, {})["apiVersion"]), gvp[2])
            self.writes.append(Write(gvp[2], key[1], q.get("fieldManager"), None, "POST"))
            return web.json_response(self._out(gvp, created), status=201)
        obj = objects.get((namespace, name or ""))
        if obj is None:
            return status(404, "NotFound", f'{gvp[2]} "{name}" not found')
        if request.method == "GET":
            return web.json_response(self._out(gvp, obj))
        body = await request.json()
        wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
        if sub == "status" and self.conflicts > 0:
            self.conflicts -= 1
            return status(409, "Conflict", "the object has been modified (injected)")
        if wanted_rv and wanted_rv != obj["metadata"]["resourceVersion"]:
            return status(409, "Conflict", "the object has been modified; please apply your "
                          "changes to the latest version and try again")  # fmt: skip
        self.writes.append(Write(gvp[2], name or "", q.get("fieldManager"), sub, request.method))
        if request.method == "PUT":
            new = dict(body)
            if sub != "status":
                new.pop("status", None)
                if "status" in obj:
                    new["status"] = obj["status"]
        elif request.method == "PATCH":
            new = merge_patch(obj, body)
            if sub == "status":
                new["spec"] = obj.get("spec")
        else:
            return status(405, "MethodNotAllowed", request.method)
        new["apiVersion"] = obj.get("apiVersion", self._out(gvp, {})["apiVersion"])
        updated = self.put(new, gvp[2])
        return web.json_response(self._out(gvp, updated))

    async def _watch(self, request: web.Request, gvp: tuple[str, str, str],
                     store: tuple[str, str], namespace: str) -> web.StreamResponse:  # fmt: skip
        self.watch_count += 1
        q = request.query
        since = int(q.get("resourceVersion") or 0)
        bookmarks = q.get("allowWatchBookmarks") == "true"
        watcher = _Watcher(store, namespace)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            data = obj if kind in ("ERROR", "BOOKMARK") else self._out(gvp, obj)
            await response.write(json.dumps({"type": kind, "object": data}).encode() + b"\n")

        if self.empty_watches:
            await response.write_eof()
            return response
        if since and since < self.compacted:
            await send("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "message": f"too old resource version: {since}",
                                 "reason": "Expired", "code": 410})  # fmt: skip
            await response.write_eof()
            return response
        if not since:
            for (ns, _), obj in sorted(self.objects.get(store, {}).items()):
                if ns == namespace:
                    await send("ADDED", obj)
        else:
            for rv, s, kind, obj in list(self.events):
                if s == store and rv > since and obj["metadata"]["namespace"] == namespace:
                    await send(kind, obj)
        self.watchers.append(watcher)
        timeout = float(q.get("timeoutSeconds") or 300)
        try:
            while True:
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), timeout)
                except TimeoutError:
                    break
                if item is None:  # dropped: cut the stream without its final chunk
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                if item[0] == "END":
                    break
                if item[0] == "BOOKMARK" and not bookmarks:
                    continue
                await send(*item)
        finally:
            self.watchers.remove(watcher)
        await response.write_eof()
        return response


def _port_below_ephemeral() -> int:
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise OSError("no free port in 20000-32000 on 127.0.0.1")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out
