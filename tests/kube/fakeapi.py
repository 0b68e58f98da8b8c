"""A small Kubernetes API server for tests: the list/watch/status/Lease protocol, with faults.

Why not kmock: kmock 0.8 (measured in shared/reference/ecosystem.md) keeps no
resourceVersion, never answers 410 Gone, has no optimistic concurrency (409) and ignores label
selectors. Those are exactly the behaviours the Kubernetes source must survive, so the tests
use this project-owned server instead (aiohttp, on 127.0.0.1, JSON over HTTP/1.1 as lightkube
speaks it).

What it speaks, like kube-apiserver:
- LIST  GET  /apis/G/V/namespaces/NS/PLURAL (and /api/v1/... for pods): items without
  apiVersion/kind, `metadata.resourceVersion` of the list (the cluster-wide version now).
  `resourceVersion=` on a list: "" or "0" serve the current state; a version newer than the
  server's gets 504 "Too large resource version"; `resourceVersionMatch=Exact` below the
  compaction point gets 410 Expired.
- WATCH the same with `?watch=true&resourceVersion=RV[&allowWatchBookmarks=true]`: JSON lines
  `{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`, every event after RV (no
  RV or "0": the current objects as ADDED first); a version older than the compaction point
  gets an ERROR event with a 410 Status; BOOKMARKs only to watches that allowed them;
  `timeoutSeconds` ends the stream.
- `labelSelector` and `fieldSelector` on lists and watches (`selectors.py`); on a watch, an
  object that stops matching arrives as DELETED and one that starts matching as ADDED, as the
  watch cache sends them.
- GET one, POST create (409 AlreadyExists), PUT replace (409 on a stale resourceVersion),
  PATCH merge to the object or its `/status` subresource (409 on a stale resourceVersion in
  the patch). Errors are `Status` objects. Every object gets uid, generation (bumped on spec
  changes), creationTimestamp and a cluster-wide, strictly increasing resourceVersion.
- Two versions of one group/plural share their objects (one CRD serving two versions).

Faults: `compact()` (next watches from older versions get 410), `drop_watches()` (streams cut
mid-chunk), `lose_next_delete()`, `conflicts` (the next N status writes get 409), `stop()` /
`start()` (the server is down: connections refused), `unserved` (versions answering 404),
`throttle(n, retry_after_s)` (API priority and fairness: the next N requests get 429
TooManyRequests with a `Retry-After` header), `forbid(verb, resource)` (RBAC: 403 Forbidden
with the API server's "cannot VERB resource ..." message), `rbac` (an allow-list of RBAC rules,
`rbac.py`: every request they do not cover gets that 403, recorded in `refused`),
`list_delay_s` (slow lists).

Not modelled (docs/kubernetes.md lists these too): pagination (`limit`/`continue`), server-side
apply and strategic merge patch, managedFields, schema validation and admission, graceful
deletion and finalizers, cluster-scoped resources, `sendInitialEvents` watch-lists, periodic
bookmarks (`bookmark()` sends one on demand), authentication, protobuf and HTTP/2.
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

from tests.kube.rbac import Rule, allows
from tests.kube.selectors import SelectorError, field_selector, label_selector

SERVED: dict[tuple[str, str, str], str] = {
    ("inference.networking.x-k8s.io", "v1alpha1", "inferencepools"): "InferencePool",
    ("inference.networking.x-k8s.io", "v1alpha2", "inferencepools"): "InferencePool",
    ("inference.networking.k8s.io", "v1", "inferencepools"): "InferencePool",
    ("inference.networking.x-k8s.io", "v1alpha1", "inferencemodels"): "InferenceModel",
    ("inference.networking.x-k8s.io", "v1alpha2", "inferencemodels"): "InferenceModel",
    ("llm-d.ai", "v1alpha2", "inferenceobjectives"): "InferenceObjective",
    ("llm-d.ai", "v1alpha2", "inferencemodelrewrites"): "InferenceModelRewrite",
    ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives"): "InferenceObjective",
    (
        "inference.networking.x-k8s.io",
        "v1alpha2",
        "inferencemodelrewrites",
    ): "InferenceModelRewrite",
    ("", "v1", "pods"): "Pod",
    ("coordination.k8s.io", "v1", "leases"): "Lease",
}


_REVIEWS = {
    "/apis/authentication.k8s.io/v1/tokenreviews": "tokenreviews",
    "/apis/authorization.k8s.io/v1/subjectaccessreviews": "subjectaccessreviews",
}


@dataclass
class Write:
    plural: str
    name: str
    field_manager: str | None
    subresource: str | None
    method: str


Event = tuple[str, dict[str, Any], dict[str, Any] | None]  # type, object, the object before


@dataclass
class _Watcher:
    store: tuple[str, str]
    namespace: str
    queue: asyncio.Queue[Event | None] = field(default_factory=asyncio.Queue)


def status(
    code: int,
    reason: str,
    message: str,
    *,
    details: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip
    if details:
        body["details"] = details
    return _json(body, status=code, headers=headers)


def _json(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """JSON as kube-apiserver sends it: `Content-Type: application/json`, no charset
    (lightkube only turns an error into its Status when the type is exactly that)."""
    return web.Response(
        body=json.dumps(body).encode(),
        status=status,
        headers={**(headers or {}), "Content-Type": "application/json"},
    )


def _verb(method: str, name: str | None, watch: bool) -> str:
    if method == "GET":
        return "get" if name else "watch" if watch else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


class FakeApiServer:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = {}
        self.rv = 100
        self.compacted = 0  # watches from a version below this get 410
        self.events: list[tuple[int, tuple[str, str], Event]] = []
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
        self.list_delay_s = 0.0  # fault: every list answers this late (a slow list)
        self.throttled = 0  # fault: the next N requests get 429
        self.retry_after_s = 1
        self.throttle_verbs: frozenset[str] | None = None  # None: every verb
        self.forbidden: set[tuple[str, str]] = set()  # (verb, resource[/subresource])
        self.rbac: list[Rule] | None = None  # None: everything allowed (but `forbidden`)
        self.refused: list[str] = []  # "verb group/resource ns" of every 403 answered
        self.user = "system:serviceaccount:default:poolkeeper-epp"
        # TokenReview / SubjectAccessReview (cluster-scoped, never stored): who a bearer token
        # is, and which (user, non-resource path) may be read with GET.
        self.tokens: dict[str, dict[str, Any]] = {}
        self.may_get: set[tuple[str, str]] = set()

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
        self._emit(store, ("ADDED" if old is None else "MODIFIED", data, old))
        return data

    def delete(self, api_version: str, plural: str, namespace: str, name: str) -> None:
        store = self.store_of(api_version, plural)
        obj = self.objects.get(store, {}).pop((namespace, name))
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._bump()
        if self._lose_delete:
            self._lose_delete -= 1
            return
        self._emit(store, ("DELETED", obj, None))

    def get(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any]:
        return self.objects[self.store_of(api_version, plural)][(namespace, name)]

    def _emit(self, store: tuple[str, str], event: Event) -> None:
        kind, obj, old = event
        rv = int(obj["metadata"]["resourceVersion"])
        self.events.append((rv, store, (kind, copy.deepcopy(obj), copy.deepcopy(old))))
        for w in self.watchers:
            if w.store == store and obj["metadata"]["namespace"] == w.namespace:
                w.queue.put_nowait(event)

    # --- faults --------------------------------------------------------------------------------

    def compact(self, upto: int | None = None) -> None:
        """Forget the event history: watches from a version below `upto` (default: the
        current one, so only a fresh list's version is still good) get 410 Gone."""
        self.compacted = self.rv if upto is None else upto
        self.events = [e for e in self.events if e[0] > self.compacted]

    def throttle(
        self, n: int = 1, retry_after_s: int = 1, verbs: frozenset[str] | None = None
    ) -> None:
        """API priority and fairness rejects the next `n` requests (of `verbs`, default any)
        with 429 and `Retry-After: retry_after_s`."""
        self.throttled, self.retry_after_s, self.throttle_verbs = n, retry_after_s, verbs

    def forbid(self, verb: str, resource: str) -> None:
        """RBAC refuses `verb` on `resource` (a plural, or `plural/status`) from now on."""
        self.forbidden.add((verb, resource))

    def drop_watches(self) -> None:
        for w in self.watchers:
            w.queue.put_nowait(None)

    def end_watches(self) -> None:
        """End every stream cleanly, as `timeoutSeconds` does (clients resume from a version)."""
        for w in self.watchers:
            w.queue.put_nowait(("END", {}, None))

    def lose_next_delete(self, n: int = 1) -> None:
        self._lose_delete += n

    def bookmark(self) -> None:
        for w in self.watchers:
            w.queue.put_nowait(("BOOKMARK", {"metadata": {"resourceVersion": str(self.rv)}}, None))

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

    def _refusal(
        self,
        request: web.Request,
        gvp: tuple[str, str, str],
        namespace: str,
        verb: str,
        sub: str | None,
    ) -> web.Response | None:
        """429 from priority and fairness, or 403 from RBAC, as the real server words them."""
        if self.throttled > 0 and (self.throttle_verbs is None or verb in self.throttle_verbs):
            self.throttled -= 1
            return status(429, "TooManyRequests", "Too many requests, please try again later.",
                          details={"retryAfterSeconds": self.retry_after_s},
                          headers={"Retry-After": str(self.retry_after_s)})  # fmt: skip
        resource = gvp[2] + (f"/{sub}" if sub else "")
        if (verb, resource) in self.forbidden or (
            self.rbac is not None and not allows(self.rbac, gvp[0], resource, verb, namespace)
        ):
            self.refused.append(f"{verb} {gvp[0]}/{resource} {namespace}")
            message = (
                f'{resource} is forbidden: User "{self.user}" cannot {verb} resource '
                f'"{resource}" in API group "{gvp[0]}" in the namespace "{namespace}"'
            )
            return status(403, "Forbidden", message,
                          details={"kind": gvp[2], "group": gvp[0]})  # fmt: skip
        return None

    async def _review(self, request: web.Request, resource: str) -> web.Response:
        """A TokenReview or SubjectAccessReview: the request's spec and the verdict as status."""
        group = request.path.split("/")[2]
        if ("create", resource) in self.forbidden or (
            self.rbac is not None and not allows(self.rbac, group, resource, "create", None)
        ):
            self.refused.append(f"create {group}/{resource}")
            message = (
                f'{resource}.{request.path.split("/")[2]} is forbidden: User "{self.user}" '
                f'cannot create resource "{resource}" in API group "{request.path.split("/")[2]}"'
                " at the cluster scope"
            )
            return status(403, "Forbidden", message)
        body = await request.json()
        spec = body.get("spec") or {}
        if resource == "tokenreviews":
            user = self.tokens.get(str(spec.get("token")))
            body["status"] = {"authenticated": True, "user": user} if user else {}
        else:
            path = (spec.get("nonResourceAttributes") or {}).get("path")
            verb = (spec.get("nonResourceAttributes") or {}).get("verb")
            body["status"] = {"allowed": verb == "get" and (spec.get("user"), path) in self.may_get}
        return _json(body, status=201)

    def _selected(self, request: web.Request, plural: str) -> Any:
        q = request.query
        labels = label_selector(q.get("labelSelector", ""))
        fields = field_selector(q.get("fieldSelector", ""), plural)
        return lambda obj: labels(obj) and fields(obj)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path_qs}")
        self.headers_seen.append(tuple(request.headers))
        review = _REVIEWS.get(request.path)
        if review is not None and request.method == "POST":
            return await self._review(request, review)
        route = self._route(request.path)
        if route is None or route[0] not in SERVED or route[0] in self.unserved:
            return status(404, "NotFound", f"the server could not find {request.path}")
        gvp, namespace, name, sub = route
        store = (gvp[0], gvp[2])
        objects = self.objects.setdefault(store, {})
        q = request.query
        watching = q.get("watch") in ("true", "1")
        refused = self._refusal(request, gvp, namespace, _verb(request.method, name, watching), sub)
        if refused is not None:
            return refused
        if request.method == "GET" and name is None:
            try:
                selected = self._selected(request, gvp[2])
            except SelectorError as exc:
                return status(400, "BadRequest", str(exc))
            if watching:
                return await self._watch(request, gvp, store, namespace, selected)
            return await self._list(request, gvp, objects, namespace, selected)
        if request.method == "POST" and name is None:
            body = await request.json()
            key = (namespace, body["metadata"]["name"])
            if key in objects:
                return status(409, "AlreadyExists", f"{gvp[2]} {key[1]} already exists")
            body["metadata"]["namespace"] = namespace
            created = self.put(dict(body, apiVersion=self._out(gvp, {})["apiVersion"]), gvp[2])
            self.writes.append(Write(gvp[2], key[1], q.get("fieldManager"), None, "POST"))
            return _json(self._out(gvp, created), status=201)
        obj = objects.get((namespace, name or ""))
        if obj is None:
            return status(404, "NotFound", f'{gvp[2]} "{name}" not found')
        if request.method == "GET":
            return _json(self._out(gvp, obj))
        body = await request.json()
        wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
        if sub == "status" and self.conflicts > 0:
            self.conflicts -= 1
            return status(409, "Conflict", "the object has been modified (injected)")
        if wanted_rv and wanted_rv != obj["metadata"]["resourceVersion"]:
            return status(409, "Conflict", f'Operation cannot be fulfilled on {gvp[2]} "{name}": '
                          "the object has been modified; please apply your changes to the "
                          "latest version and try again")  # fmt: skip
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
        return _json(self._out(gvp, updated))

    async def _list(self, request: web.Request, gvp: tuple[str, str, str],
                    objects: dict[tuple[str, str], dict[str, Any]], namespace: str,
                    selected: Any) -> web.Response:  # fmt: skip
        q = request.query
        wanted = q.get("resourceVersion") or ""
        if wanted not in ("", "0"):
            if not wanted.isdigit():
                return status(400, "BadRequest", f"invalid resource version {wanted!r}")
            if int(wanted) > self.rv:
                return status(504, "Timeout", f"Too large resource version: {wanted}, "
                              f"current: {self.rv}")  # fmt: skip
            if q.get("resourceVersionMatch") == "Exact" and int(wanted) < self.compacted:
                return status(410, "Expired", f"too old resource version: {wanted}")
        if self.list_delay_s:
            await asyncio.sleep(self.list_delay_s)
        # The version is read after the delay: what the list holds is the state at that version.
        items = [self._out(gvp, o, item=True) for (ns, _), o in sorted(objects.items())
                 if ns == namespace and selected(o)]  # fmt: skip
        listing = {"kind": SERVED[gvp] + "List", "apiVersion": gvp[1],
                   "metadata": {"resourceVersion": str(self.rv)}, "items": items}  # fmt: skip
        return _json(listing)

    async def _watch(self, request: web.Request, gvp: tuple[str, str, str],
                     store: tuple[str, str], namespace: str,
                     selected: Any) -> web.StreamResponse:  # fmt: skip
        self.watch_count += 1
        q = request.query
        since = int(q.get("resourceVersion") or 0)
        bookmarks = q.get("allowWatchBookmarks") == "true"
        watcher = _Watcher(store, namespace)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
            if kind not in ("ERROR", "BOOKMARK"):
                # Selectors, as the watch cache applies them: leaving the selection is a
                # DELETED, entering it an ADDED.
                now, before = selected(obj), old is not None and selected(old)
                if kind == "MODIFIED" and now != before:
                    kind = "ADDED" if now else "DELETED"
                elif not now:
                    return
            data = obj if kind in ("ERROR", "BOOKMARK") else self._out(gvp, obj)
            await response.write(json.dumps({"type": kind, "object": data}).encode() + b"\n")

        if self.empty_watches:
            await response.write_eof()
            return response
        if since and since < self.compacted:
            await send("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "message": f"too old resource version: {since}",
                                 "reason": "Expired", "code": 410}, None)  # fmt: skip
            await response.write_eof()
            return response
        if not since:
            for (ns, _), obj in sorted(self.objects.get(store, {}).items()):
                if ns == namespace:
                    await send("ADDED", obj, None)
        else:
            for rv, s, (kind, obj, old) in list(self.events):
                if s == store and rv > since and obj["metadata"]["namespace"] == namespace:
                    await send(kind, obj, old)
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
