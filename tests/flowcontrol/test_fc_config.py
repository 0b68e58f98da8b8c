"""spec.flowControl: a band the user sets keeps that band's own defaults for the keys not set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from poolkeeper.flowcontrol.config import (
    BAND_DEFAULTS,
    BandMode,
    FlowControlConfig,
    Placement,
    UnseenUntil,
)


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
    assert sheddable.unseen_waits_until is UnseenUntil.SCRAPE  # one per server per scrape
    assert config.bands.standard.unseen_waits_until is UnseenUntil.FIRST_BYTE
    assert config.bands.critical.unseen_waits_until is UnseenUntil.FIRST_BYTE
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


def test_until_when_an_unseen_request_waits_is_a_band_setting_with_a_precise_error() -> None:
    config = FlowControlConfig.model_validate(
        {"bands": {"sheddable": {"unseenWaitsUntil": "firstByte"}}}
    )
    assert config.bands.sheddable.unseen_waits_until is UnseenUntil.FIRST_BYTE
    assert config.bands.sheddable.queue_depth_threshold == 1  # the rest of Sheddable's own
    with pytest.raises(ValidationError, match=r"bands\.standard\.unseenWaitsUntil"):
        FlowControlConfig.model_validate({"bands": {"standard": {"unseenWaitsUntil": "never"}}})
