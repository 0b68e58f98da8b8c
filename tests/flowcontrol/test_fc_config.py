"""spec.flowControl: a band the user sets keeps that band's own defaults for the keys not set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from poolkeeper.flowcontrol.bandconfig import BandMode, Placement
from poolkeeper.flowcontrol.bands import BAND_DEFAULTS
from poolkeeper.flowcontrol.config import FlowControlConfig


def test_partial_band_settings_keep_the_bands_own_defaults() -> None:
    config = FlowControlConfig.model_validate(
        {"bands": {"sheddable": {"ttlMs": 3000}, "critical": {"mode": "queue"}}}
    )
    sheddable = config.bands.sheddable
    assert sheddable.ttl_ms == 3000
    assert sheddable.queue_depth_threshold == 1  # Sheddable's own, not the generic None
    assert sheddable.max_requests == 1000
    assert sheddable.placement is Placement.HEADROOM  # fills spare capacity only
    assert config.bands.standard.placement is Placement.SCHEDULER  # keeps prefix affinity
    critical = config.bands.critical
    assert critical.mode is BandMode.QUEUE
    assert (critical.saturation_limit, critical.ttl_ms) == (2.0, 60_000)
    assert config.bands.standard == FlowControlConfig().bands.standard


def test_defaults_come_from_one_table() -> None:
    bands = FlowControlConfig().bands
    for name, defaults in BAND_DEFAULTS.items():
        band = getattr(bands, name)
        dumped = band.model_dump(by_alias=True, mode="json")
        assert {k: dumped[k] for k in defaults} == dict(defaults)


def test_a_bad_band_value_names_its_path() -> None:
    with pytest.raises(ValidationError, match=r"bands\.sheddable\.ttlMs"):
        FlowControlConfig.model_validate({"bands": {"sheddable": {"ttlMs": 0}}})
