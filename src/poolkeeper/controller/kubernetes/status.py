"""The InferenceModel status writer: `Accepted` conditions through the status subresource.

- What to write is `api/status.py`'s (`compute_model_statuses` over the datastore's verdicts),
  with the model's own status as `previous`, so `lastTransitionTime` only moves when the
  condition's status does.
- `needs_write` (pure) compares what the object carries with what it should carry, ignoring
  timestamps: a write happens only when type, status, reason, message or observedGeneration
  differ. A resync over unchanged objects therefore writes nothing, and our own write coming
  back as a MODIFIED event finds nothing to do (no hot loop).
- Writes are merge patches carrying the `metadata.resourceVersion` read, so a concurrent
  change is refused with 409; the writer then re-reads the object and tries again, at most
  `attempts` times in all, and otherwise leaves it to the next event or resync.
- Only the leader writes (`allowed()` is asked right before every request).
- A write refused by RBAC (403) is logged at ERROR, every time, with the API server's message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from poolkeeper.api.model import InferenceModel, InferenceModelStatus
from poolkeeper.api.status import Verdict, compute_model_statuses
from poolkeeper.controller.kubernetes.api_errors import (
    ApiUnavailable,
    Conflict,
    Forbidden,
    NotFound,
)
from poolkeeper.controller.kubernetes.client import KubeApi
from poolkeeper.controller.kubernetes.objects import ResourceKind, parse_model

__all__ = ["StatusWriter", "needs_write"]

log = logging.getLogger(__name__)


def _essence(status: InferenceModelStatus | None) -> list[tuple[Any, ...]]:
    if status is None:
        return []
    return sorted(
        (c.type, c.status, c.reason, c.message, c.observed_generation) for c in status.conditions
    )


def needs_write(current: InferenceModelStatus | None, desired: InferenceModelStatus) -> bool:
    """True when the object's status differs from the desired one in anything but timestamps."""
    return _essence(current) != _essence(desired)


class StatusWriter:
    """Writes the models' statuses that differ; counts what it did (for tests and metrics)."""

    def __init__(
        self,
        api: KubeApi,
        *,
        field_manager: str,
        allowed: Callable[[], bool] = lambda: True,
        attempts: int = 3,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.api = api
        self.field_manager = field_manager
        self.allowed = allowed
        self.attempts = attempts
        self._now = now
        self.writes = 0
        self.conflicts = 0
        self.failures = 0

    def desired(self, model: InferenceModel, verdict: Verdict) -> InferenceModelStatus:
        return compute_model_statuses([model], {model.key: verdict}, now=self._now())[model.key]

    async def reconcile(
        self,
        kind: ResourceKind,
        models: Mapping[str, InferenceModel],
        verdicts: Mapping[str, Verdict],
    ) -> int:
        """Write every model whose status is out of date; returns the number of writes."""
        written = 0
        for key in sorted(models):
            verdict = verdicts.get(key)
            if verdict is None or not self.allowed():
                continue
            if await self._reconcile_one(kind, models[key], verdict):
                written += 1
        return written

    async def _reconcile_one(
        self, kind: ResourceKind, model: InferenceModel, verdict: Verdict
    ) -> bool:
        for attempt in range(1, self.attempts + 1):
            desired = self.desired(model, verdict)
            if not needs_write(model.status, desired):
                return False
            if not self.allowed():
                return False
            patch = {
                "metadata": {"resourceVersion": model.metadata.resource_version},
                "status": desired.to_dict(),
            }
            try:
                await self.api.patch_status(
                    kind, model.name, patch, field_manager=self.field_manager
                )
            except Conflict:
                self.conflicts += 1
                if attempt == self.attempts:
                    break
                try:
                    fresh, problems = parse_model(await self.api.get(kind, model.name))
                except NotFound:
                    return False
                except ApiUnavailable as exc:
                    log.warning("re-reading InferenceModel %s failed: %s", model.key, exc)
                    break
                if fresh is None:
                    log.warning("InferenceModel %s is invalid now: %s", model.key, problems)
                    return False
                model = fresh
                continue
            except NotFound:
                return False
            except Forbidden as exc:
                self.failures += 1
                log.error("permission denied writing InferenceModel %s status: %s", model.key, exc)
                return False
            except ApiUnavailable as exc:
                self.failures += 1
                log.warning("writing the status of InferenceModel %s failed: %s", model.key, exc)
                return False
            self.writes += 1
            condition = desired.conditions[0]
            log.info(
                "InferenceModel %s status written: %s=%s (%s)",
                model.key,
                condition.type,
                condition.status,
                condition.reason,
            )
            return True
        self.failures += 1
        log.warning(
            "InferenceModel %s: status still conflicting after %d attempts; left to the next "
            "change or resync",
            model.key,
            self.attempts,
        )
        return False
