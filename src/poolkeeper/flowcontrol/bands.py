"""The three flow-control bands by criticality (`spec.flowControl.bands`), and each one's defaults.

`BAND_DEFAULTS` is each band's own default document: a band the user configures is validated
from it with the user's keys on top (`Bands`), so `sheddable: {ttlMs: 3000}` keeps Sheddable's
own `queueDepthThreshold: 1`. One band's settings: `flowcontrol/bandconfig.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from pydantic import Field, model_validator
from pydantic.alias_generators import to_camel

from poolkeeper.api.criticality import Criticality
from poolkeeper.flowcontrol.bandconfig import BandConfig
from poolkeeper.schema import CamelModel

# Each band's own defaults, as a document. A band the user configures is validated from these
# with the user's keys on top, so `sheddable: {ttlMs: 3000}` keeps Sheddable's own
# `queueDepthThreshold: 1` instead of silently falling back to the generic band defaults.
BAND_DEFAULTS: Final[Mapping[str, Mapping[str, object]]] = MappingProxyType(
    {
        "critical": MappingProxyType(
            {"mode": "send", "saturationLimit": 2.0, "ttlMs": 60_000, "avoidPrefillTokens": 256}
        ),
        "standard": MappingProxyType(
            {
                "saturationLimit": 1.2,
                "maxRequests": 2000,
                "ttlMs": 30_000,
                "lifoAfterMs": 200,
                "overloadTtlMs": 300,
                # Away from a prompt just sent, as Critical, where 8 or more servers are
                # clear, not away from a cached prefix or to a slower server: on 64 servers
                # Critical's avoidance otherwise leaves Standard the busy ones (mixed
                # criticality: 1.02x / 1.06x round-robin's p90 at 0.9x / 1.1x).
                "avoidPrefillTokens": 256,
                "avoidPrefillUnlessCached": 256,
                "avoidPrefillSlowdown": 1.0,
                "avoidPrefillMinClear": 8,
            }
        ),
        "sheddable": MappingProxyType(
            {
                "queueDepthThreshold": 1,
                "lifoAfterMs": 200,
                "maxRequests": 1000,
                "ttlMs": 1_500,
                "placement": "headroom",
                # Its rule already sends only to a server with nothing waiting or sent since
                # the last scrape: no queue at the servers, so Critical requests start fast.
                "dispatch": "saturation",
                # Work meant to fill spare capacity: newest first whenever it is late (a
                # Sheddable population is not promised its share of a saturated pool).
                "onlyWhileGrowing": False,
            }
        ),
    }
)


# Keys that refine `avoidPrefillTokens` (each an error without it).
_AVOIDANCE_REFINEMENTS: Final = (
    "avoidPrefillUnlessCached",
    "avoidPrefillSlowdown",
    "avoidPrefillMinClear",
)


def _band(name: str) -> BandConfig:
    return BandConfig.model_validate(dict(BAND_DEFAULTS[name]))


class Bands(CamelModel, use_attribute_docstrings=True):
    """The three bands, by criticality. Keys set for a band override that band's defaults."""

    critical: BandConfig = Field(default_factory=lambda: _band("critical"))
    """Default `send`: Critical requests are never held nor shed, as before flow control,
    and go, where there is a choice, to a server not just sent a long prompt
    (`avoidPrefillTokens: 256`). With `queue` they wait ahead of every other band (and share
    fairly among themselves)."""
    standard: BandConfig = Field(default_factory=lambda: _band("standard"))
    """Default: queue while no endpoint can start the request (`dispatch: slot`) or is below
    1.2 (6 waiting requests); 30 s TTL; refused early when the queue ahead cannot drain within
    the TTL; for a flow whose requests keep growing (open-loop overload, `onlyWhileGrowing`),
    newest first after 200 ms and 300 ms once it has waited 3 s without a break; placed
    away from a server just sent a long prompt (`avoidPrefillTokens: 256`) while 8 or more
    are clear (`avoidPrefillMinClear`), unless that server caches 256 more of the prompt
    (`avoidPrefillUnlessCached`) or no clear one is as fast (`avoidPrefillSlowdown: 1`)."""
    sheddable: BandConfig = Field(default_factory=lambda: _band("sheddable"))
    """Default: queue while every endpoint has a request waiting (or sent since its last
    scrape) or KV at 80%: servers keep no queue of Sheddable work, so Critical requests sent
    to them start fast; 1.5 s TTL: answered quickly either way (docs/flowcontrol.md)."""

    @model_validator(mode="before")
    @classmethod
    def _over_band_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, defaults in BAND_DEFAULTS.items():
            given = data.get(name)
            if isinstance(given, dict):
                # Field names are accepted as well as aliases: name them as the defaults
                # do, so a user's `ttl_ms` replaces the default `ttlMs` instead of
                # standing beside it (and failing as a duplicate). Other keys pass as given.
                given = {to_camel(k) if isinstance(k, str) else k: v for k, v in given.items()}
                band = {**defaults, **given}
                if "avoidPrefillTokens" in given and given["avoidPrefillTokens"] is None:
                    # The avoidance off takes the refinements it defaults with along; one the
                    # user sets stays, and its error says it would be ignored.
                    for key in _AVOIDANCE_REFINEMENTS:
                        if key not in given:
                            band.pop(key, None)
                merged[name] = band
        return merged

    def of(self, criticality: Criticality) -> BandConfig:
        if criticality is Criticality.CRITICAL:
            return self.critical
        if criticality is Criticality.STANDARD:
            return self.standard
        return self.sheddable
