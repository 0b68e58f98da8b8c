"""The `admission`, `flowControl` and `edge` sections an EndpointPickerConfig means.

The saturation detector (`utilization-detector`) gives the admission thresholds; with the
feature gate `flowControl` off (upstream's default) admission sheds only negative priorities at
saturation (upstream's legacy admission); with it on, `flowControl.priorityBands` fold into
poolkeeper's three bands (> 0, 0, < 0), first come first served with upstream's TTL and bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from poolkeeper.config.endpointpicker.catalogue import (
    UPSTREAM_PLUGINS,
    Role,
    Use,
    UtilizationDetectorParams,
    missing_message,
)
from poolkeeper.config.endpointpicker.document import EndpointPickerConfig, FlowControl
from poolkeeper.config.endpointpicker.translation_work import (
    TranslationWork,
    duration_ms,
    one_of,
)
from poolkeeper.config.endpointpicker.values import parse_size


def detector_params(
    config: EndpointPickerConfig, work: TranslationWork
) -> UtilizationDetectorParams:
    flow = config.flow_control
    ref = flow.saturation_detector if flow is not None else None
    ref = ref or config.saturation_detector
    where = "flowControl.saturationDetector.pluginRef"
    name = one_of(Role.DETECTOR, work, ref.plugin_ref if ref else None, where)
    params = work.params.get(name) if name is not None else None
    return params if isinstance(params, UtilizationDetectorParams) else UtilizationDetectorParams()


def quantity(value: int | str | None, default: int, where: str, work: TranslationWork) -> int:
    if value is None:
        return default
    try:
        return value if isinstance(value, int) else parse_size(value)
    except ValueError as exc:
        work.problems.append(f"{where}: {exc}")
        return default


def flow_sections(
    config: EndpointPickerConfig, gates: Mapping[str, bool], work: TranslationWork
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(admission, flowControl, edge) sections."""
    detector = detector_params(config, work)
    admission: dict[str, Any] = {
        "queueDepthThreshold": detector.queue_depth_threshold,
        "kvCacheUtilThreshold": detector.kv_cache_util_threshold,
        # Upstream's legacy admission sheds only negative priorities, at saturation 1.0.
        "sheddableSaturationLevel": 1.0 + detector.headroom,
        "standardOverloadLevel": None,
    }
    flow = config.flow_control
    if not gates["flowControl"]:
        if flow is not None and flow.model_dump(exclude_none=True, exclude={"saturation_detector"}):
            work.notices.append("flowControl: ignored while the flowControl feature gate is off")
        return admission, {"enabled": False}, {}
    flow = flow if flow is not None else FlowControl()
    ttl = duration_ms(flow.default_request_ttl or "60s", "flowControl.defaultRequestTTL", work)
    ttl = ttl if ttl and ttl > 0 else 60_000
    for i, band in enumerate(flow.priority_bands):
        for key, ref, role in (
            ("fairnessPolicyRef", band.fairness_policy_ref, Role.FAIRNESS),
            ("orderingPolicyRef", band.ordering_policy_ref, Role.ORDERING),
        ):
            if ref is not None and ref not in work.raw and ref not in UPSTREAM_PLUGINS:
                work.problems.append(
                    f"flowControl.priorityBands[{i}].{key}: unknown plugin {ref!r}"
                )
            elif ref is not None:
                spec = work.specs.get(ref) or UPSTREAM_PLUGINS.get(ref)
                if spec is not None and spec.use is Use.MISSING:
                    work.problems.append(
                        f"flowControl.priorityBands[{i}].{key}: {missing_message(spec)}"
                    )
                elif spec is not None and spec.role is not role:
                    work.problems.append(f"flowControl.priorityBands[{i}].{key}: not a {role}")
    if flow.enable_eviction:
        work.problems.append("flowControl.enableEviction: in-flight eviction is not implemented")
    totals: dict[str, dict[str, int]] = {}
    for i, band in enumerate(flow.priority_bands):
        key = "critical" if band.priority > 0 else "standard" if band.priority == 0 else "sheddable"
        entry = totals.setdefault(key, {"maxRequests": 0, "maxBytes": 0})
        entry["maxRequests"] += band.max_requests or 5000
        where = f"flowControl.priorityBands[{i}].maxBytes"
        entry["maxBytes"] += quantity(band.max_bytes, 10**9, where, work)
    bands: dict[str, Any] = {}
    for key in ("critical", "standard", "sheddable"):
        limits = totals.get(key, {"maxRequests": 5000, "maxBytes": 10**9})
        bands[key] = {
            "mode": "queue",
            "saturationLimit": 1.0 + detector.headroom,
            "ttlMs": ttl,
            "maxRequests": min(limits["maxRequests"], 1_000_000),
            "maxBytes": limits["maxBytes"],
            "lifoAfterMs": None,
            "shortestFirst": False,  # upstream's order: first come first served
            "overloadTtlMs": None,
            "placement": "scheduler",
            "queueDepthThreshold": None,
        }
    work.notices.append(
        "flowControl: bands fold into poolkeeper's three (priority > 0, 0, < 0); flows share "
        "a band by virtual token counts rather than global-strict fairness"
    )
    edge = {"eppTimeoutS": ttl / 1000.0 + 5.0}
    # Upstream has no new-prefix hold: a translated config does what upstream's does.
    return admission, {"enabled": True, "bands": bands, "holdNewPrefixes": None}, edge
