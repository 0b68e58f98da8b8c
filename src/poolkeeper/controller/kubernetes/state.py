"""`ClusterState`: the objects the Kubernetes source has seen, and what they mean for the
datastore (pure: no I/O; the source's watch loops fill the caches).

One `ObjectCache` per set of objects: the x-k8s and the k8s.io InferencePools, the
InferenceModels, the InferenceObjectives and InferenceModelRewrites of each group (llm-d.ai, and
the x-k8s group read only as a fallback) and the Pods. The views
parse each object with the API types (invalid ones are left out and logged once per change of
their problems), keep only the named pools and what references them (`--pool`), and turn Ready
Pods into endpoint specs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from poolkeeper.api.model import InferenceModel
from poolkeeper.api.objective import InferenceObjective
from poolkeeper.api.pool import AnyInferencePool
from poolkeeper.api.rewrite import InferenceModelRewrite
from poolkeeper.api.versions import fallback_applies, is_fallback
from poolkeeper.controller.kubernetes.objects import (
    MODEL_KINDS,
    POD,
    POLICY_KINDS,
    POOL_KINDS,
    ObjectCache,
    parse_model,
    parse_object,
    parse_pool,
    pod_endpoint,
)
from poolkeeper.controller.kubernetes.standalone import EndpointSelector
from poolkeeper.datastore.models import ModelResource
from poolkeeper.datastore.snapshot import EndpointSpec

__all__ = ["ClusterState"]

log = logging.getLogger(__name__)


class ClusterState:
    """The caches of one namespace and their datastore view."""

    def __init__(
        self,
        pool_names: Sequence[str],
        engine_for: Callable[[Mapping[str, str]], str],
        pool_group: str = "",
        standalone: EndpointSelector | None = None,
    ) -> None:
        """`pool_group`: read only that group's InferencePools (upstream's `--pool-group`),
        and InferenceModels only with the x-k8s group (the k8s.io generation has none):
        the chart of an upstream EPP grants exactly these, so nothing else is listed (a
        list it does not grant is a 403). Empty: every generation. `standalone`: upstream's
        `--endpoint-selector` mode, Pods only (controller/kubernetes/standalone.py)."""
        self.wanted = frozenset(pool_names)  # empty: every pool
        self.engine_for = engine_for
        self.pool_caches = [
            ObjectCache(kinds[0], kinds)
            for kinds in POOL_KINDS
            if not pool_group or kinds[0].group == pool_group
        ]
        self.models_cache = ObjectCache(MODEL_KINDS[0], MODEL_KINDS)
        self.reads_models = not pool_group or pool_group == MODEL_KINDS[0].group
        self.policy_caches = [ObjectCache(kinds[0], kinds) for kinds in POLICY_KINDS]
        self.standalone = standalone
        if standalone is not None:
            self.pool_caches, self.policy_caches, self.reads_models = [], [], False
        self.pods_cache = ObjectCache(POD, (POD,))
        self._problems: dict[str, tuple[str, ...]] = {}  # object -> problems logged
        self._legacy_logged: dict[str, str] = {}  # fallback-group object -> verdict logged

    def caches(self) -> list[ObjectCache]:
        models = [self.models_cache] if self.reads_models else []
        return [*self.pool_caches, *models, *self.policy_caches, self.pods_cache]

    def _ours(self, pool_name: str) -> bool:
        return not self.wanted or pool_name in self.wanted

    def _report(self, key: str, problems: list[str]) -> None:
        if tuple(problems) != self._problems.get(key, ()):
            for problem in problems:
                log.error("ignoring invalid object: %s", problem)
        if problems:
            self._problems[key] = tuple(problems)
        else:
            self._problems.pop(key, None)

    def pools(self) -> list[AnyInferencePool]:
        out: list[AnyInferencePool] = []
        if self.standalone is not None:
            pool, problems = parse_pool(self.standalone.pool_object())
            self._report("--endpoint-selector", problems)
            out.extend([pool] if pool is not None else [])
        for cache in self.pool_caches:
            for key, obj in sorted(cache.objects.items()):
                pool, problems = parse_pool(obj)
                self._report(f"{cache.kind}/{key}", problems)
                if pool is not None and self._ours(pool.name):
                    out.append(pool)
        return out

    def models(self) -> list[InferenceModel]:
        """With named pools, models of other pools belong to another EPP: not ours to judge."""
        cache = self.models_cache
        out: list[InferenceModel] = []
        for key, obj in sorted(cache.objects.items()):
            model, problems = parse_model(obj)
            self._report(f"{cache.kind}/{key}", problems)
            if model is not None and self._ours(model.spec.pool_ref.name):
                out.append(model)
        return out

    def policies(self) -> list[ModelResource]:
        """InferenceObjectives and InferenceModelRewrites (of the named pools, if any).

        The x-k8s group of these kinds is upstream's read-only fallback: its objects count only
        while the kind's llm-d.ai CRD is not installed (each logged once as deprecated), and are
        ignored with a warning once it is (`poolkeeper.api.versions.fallback_applies`)."""
        out: list[ModelResource] = []
        for cache in self.policy_caches:
            kind = cache.kind.kind
            installed = [
                c.kind.group for c in self.policy_caches if c.installed and c.kind.kind == kind
            ]
            counts = fallback_applies(cache.kind.kind, cache.kind.group, installed) is not False
            for key, obj in sorted(cache.objects.items()):
                if not self._legacy(cache, key, counts=counts):
                    continue
                parsed, problems = parse_object(obj)
                self._report(f"{cache.kind}/{key}", problems)
                if isinstance(parsed, InferenceObjective | InferenceModelRewrite) and self._ours(
                    parsed.spec.pool_ref.name
                ):
                    out.append(parsed)
        return out

    def _legacy(self, cache: ObjectCache, key: str, *, counts: bool) -> bool:
        """Whether an object of `cache` counts; logs a fallback-group object once per verdict."""
        if not is_fallback(cache.kind.kind, cache.kind.group):
            return True
        ref = f"{cache.kind.kind} {key} ({cache.kind.api_version})"
        verdict = "read" if counts else "ignored"
        if self._legacy_logged.get(ref) != verdict:
            self._legacy_logged[ref] = verdict
            if counts:
                log.warning("DEPRECATION: %s is in the legacy group; move it to llm-d.ai", ref)
            else:
                log.warning("ignoring %s: the llm-d.ai CRD of this kind is installed", ref)
        return counts

    def endpoints(self) -> list[EndpointSpec]:
        specs = (
            pod_endpoint(pod, self.engine_for) for _, pod in sorted(self.pods_cache.objects.items())
        )
        if self.standalone is not None:
            specs = (self.standalone.select(s) for s in specs if s is not None)
        return [s for s in specs if s is not None]
