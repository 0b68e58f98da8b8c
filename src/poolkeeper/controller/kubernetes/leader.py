"""Leader election on a `coordination.k8s.io/v1` Lease: exactly one status writer at a time.

The rules are client-go's (what controller-runtime uses), with its default timings:
lease duration 15 s, renew deadline 10 s, retry period 2 s.

- Every replica tries every retry period. A Lease held by someone else is respected while the
  record has changed within the last lease duration, measured on *this* replica's monotonic
  clock from when it last saw the record change (never by comparing wall clocks).
- The holder renews every retry period. It counts itself leader only until `renew deadline`
  after the start of its last successful renewal, so it stops writing at least
  `lease duration - renew deadline` (5 s) before anyone else may take the Lease.
- Conflicts (409) mean someone else wrote first: this round is lost, nothing else happens.
- On shutdown the holder releases the Lease (empty holder, 1 s duration) so the next replica
  takes over within one retry period instead of a whole lease duration.
- Every write names the field manager (`poolkeeper-epp` by default: one managedFields entry
  however many pods come and go). A refused write (403) is logged at ERROR every time, with
  the API server's message: without the Lease no status is ever written.

`decide` is the pure rule; `LeaderElector.try_once` is one round against the API server, and
`run` repeats it. The clock is injected, so tests step through a handover without waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from poolkeeper.controller.kubernetes.api_errors import ApiUnavailable, Forbidden, NotFound
from poolkeeper.controller.kubernetes.client import KubeApi
from poolkeeper.controller.kubernetes.objects import LEASE

__all__ = ["LeaderElector", "LeaseTiming", "decide"]

log = logging.getLogger(__name__)

Action = Literal["create", "renew", "take", "wait"]


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("need 0 < retry period < renew deadline < lease duration")


def _fingerprint(spec: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        spec.get("holderIdentity"),
        spec.get("renewTime"),
        spec.get("leaseTransitions"),
        spec.get("leaseDurationSeconds"),
    )


def decide(
    spec: Mapping[str, Any] | None,
    me: str,
    now: float,
    observed_at: float,
    timing: LeaseTiming,
) -> Action:
    """What to do with the Lease spec as read (None: no Lease yet). `observed_at`: when this
    replica first saw the record in its current state (monotonic seconds)."""
    if spec is None:
        return "create"
    holder = spec.get("holderIdentity") or ""
    if holder == me:
        return "renew"
    duration = float(spec.get("leaseDurationSeconds") or timing.lease_duration_s)
    if holder and now < observed_at + duration:
        return "wait"
    return "take"


def _micro_time(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Holds (or waits for) the Lease `name`; `is_leader()` is true only while it is safe."""

    def __init__(
        self,
        api: KubeApi,
        name: str,
        identity: str,
        *,
        timing: LeaseTiming | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        field_manager: str = "poolkeeper-epp",
    ) -> None:
        self.api = api
        self.field_manager = field_manager
        self.name = name
        self.identity = identity
        self.timing = timing or LeaseTiming()
        self._clock = clock
        self._wall = wall
        self._observed: tuple[tuple[Any, ...], float] | None = None
        self._leading_until = float("-inf")
        self.transitions_seen = 0
        self.on_change: Callable[[bool], None] | None = None
        self._was_leader = False

    def is_leader(self) -> bool:
        return self._clock() < self._leading_until

    def _note(self) -> None:
        leader = self.is_leader()
        if leader != self._was_leader:
            self._was_leader = leader
            log.info("%s %s the Lease %s", self.identity, "holds" if leader else "lost", self.name)
            if self.on_change is not None:
                self.on_change(leader)

    async def try_once(self) -> bool:
        """One round: read the Lease, then create, renew or take it, or wait. True if leader."""
        started = self._clock()
        try:
            await self._round(started)
        except Forbidden as exc:
            log.error(
                "permission denied on the Lease %s (no status is written): %s", self.name, exc
            )
        except ApiUnavailable as exc:
            log.debug("lease %s: %s", self.name, exc)
        self._note()
        return self.is_leader()

    async def _round(self, started: float) -> None:
        try:
            lease: dict[str, Any] | None = await self.api.get(LEASE, self.name)
        except NotFound:
            lease = None
        spec: dict[str, Any] = dict((lease or {}).get("spec") or {})
        if lease is not None:
            fingerprint = _fingerprint(spec)
            if self._observed is None or self._observed[0] != fingerprint:
                self._observed = (fingerprint, started)
        observed_at = self._observed[1] if self._observed is not None else started
        action = decide(spec if lease is not None else None, self.identity, started,
                        observed_at, self.timing)  # fmt: skip
        if action == "wait":
            return
        now = _micro_time(self._wall())
        duration = round(self.timing.lease_duration_s) or 1
        new_spec = dict(spec)
        new_spec.update(holderIdentity=self.identity, leaseDurationSeconds=duration, renewTime=now)
        if action != "renew":
            new_spec["acquireTime"] = now
            if action == "take":
                new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            else:
                new_spec["leaseTransitions"] = 0
        if lease is None:
            body = {
                "apiVersion": LEASE.api_version,
                "kind": LEASE.kind,
                "metadata": {"name": self.name, "namespace": self.api.namespace},
                "spec": new_spec,
            }
            written = await self.api.create(LEASE, body, field_manager=self.field_manager)
        else:
            body = dict(lease)
            body["spec"] = new_spec
            # 409 if someone wrote first
            written = await self.api.replace(LEASE, body, field_manager=self.field_manager)
        self._observed = (_fingerprint(written.get("spec") or new_spec), started)
        self._leading_until = started + self.timing.renew_deadline_s

    async def run(self, sleep: Callable[[float], Any] = asyncio.sleep) -> None:
        """Try every retry period until cancelled; release the Lease when cancelled."""
        try:
            while True:
                await self.try_once()
                await sleep(self.timing.retry_period_s)
        finally:
            if self.is_leader():
                await self.release()

    async def release(self) -> None:
        """Give the Lease up now (shutdown), so another replica need not wait it out."""
        self._leading_until = float("-inf")
        self._note()
        try:
            lease = await self.api.get(LEASE, self.name)
            spec = dict(lease.get("spec") or {})
            if spec.get("holderIdentity") != self.identity:
                return
            spec.update(holderIdentity=None, leaseDurationSeconds=1)
            spec.pop("holderIdentity")
            await self.api.replace(LEASE, dict(lease, spec=spec), field_manager=self.field_manager)
        except Forbidden as exc:
            log.error("permission denied releasing the Lease %s: %s", self.name, exc)
        except ApiUnavailable as exc:
            log.warning("could not release the Lease %s: %s", self.name, exc)
        else:
            log.info("%s released the Lease %s", self.identity, self.name)
