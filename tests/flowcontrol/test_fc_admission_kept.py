"""Admission's kept saturations (`AdmissionController`, `datastore/columns.py`) report as
the detector's plain pass: the same pool saturation, bit for bit, on an evolving pool (some
endpoints stale now and then, broken KV values, in-flight changes, endpoints joining and
leaving), so the same requests are shed."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import count

import pytest

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.admission import AdmissionConfig
from poolkeeper.flowcontrol.shedding import AdmissionController
from poolkeeper.scheduling.types import LLMRequest
from tests.scheduling.evolving_pool import endpoint_state, evolve


@pytest.mark.parametrize("count_unseen", [True, False])
def test_kept_saturations_report_as_the_plain_pass(count_unseen: bool) -> None:
    rng = random.Random(11)
    now = 1000.0
    ips = count(1)
    pool = [endpoint_state(rng, next(ips), now) for _ in range(90)]
    config = AdmissionConfig(count_unseen=count_unseen, sheddable_saturation_level=0.5)
    kept = AdmissionController(config)
    kept_path = 0
    for k in range(500):
        now += 0.001
        pool = evolve(rng, pool, now, ips)
        if k % 50 == 0:  # every endpoint fresh for a while (the kept path)
            pool = [replace(s, metrics=replace(s.metrics, updated_at=now)) for s in pool]
        req = LLMRequest(f"r{k}", "m", "m", criticality=Criticality.SHEDDABLE)
        got = kept.decide(req, pool, now=now)
        want = kept.detector.assess(pool, now)
        assert got.report == want, k
        assert repr(got.report.saturation) == repr(want.saturation)
        kept_path += want.stale == 0
    assert kept_path > 100  # (the kept path was taken, not only the detector's)
