"""The admission section of the gateway config (`spec.admission`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from poolkeeper.schema import CamelModel


class AdmissionConfig(CamelModel):
    """When to shed requests by criticality. Defaults follow GIE's saturation detector."""

    queue_depth_threshold: float = Field(
        default=5,
        gt=0,
        description="Waiting requests at which an endpoint counts as saturated (per-endpoint "
        "saturation 1.0). Default 5 (GIE SD_QUEUE_DEPTH_THRESHOLD).",
    )
    kv_cache_util_threshold: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="KV-cache utilisation (0..1) at which an endpoint counts as saturated. "
        "Default 0.8 (GIE SD_KV_CACHE_UTIL_THRESHOLD).",
    )
    sheddable_saturation_level: float = Field(
        default=1.0,
        gt=0,
        description="Pool saturation at or above which Sheddable requests are shed with 429. "
        "Default 1.0 (the average endpoint is at its thresholds).",
    )
    standard_overload_level: float | None = Field(
        default=8.0,
        gt=0,
        description="Pool saturation at or above which Standard requests are shed too. "
        "Default 8.0: the average endpoint holds eight times `queueDepthThreshold` waiting "
        "requests (KV alone tops out at 1/0.8 = 1.25, so only queues reach it): real "
        "overload, where shedding raises goodput instead of lowering it. null = never shed "
        "Standard.",
    )
    count_unseen: bool = Field(
        default=True,
        description="Add requests sent since the last scrape to the scraped queue and KV "
        "(router-side in-flight accounting). Default true.",
    )
    all_stale_policy: Literal["admit", "shed"] = Field(
        default="admit",
        description="What to do when no endpoint has fresh metrics: `admit` (fail open, "
        "default: a lagging scraper must not turn into 429s or stalls, llm-d #2408) or "
        "`shed` (treat as saturated, GIE v0.4-v1.5 behaviour).",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "metricsStalenessMs" in data:
            raise ValueError(
                "metricsStalenessMs moved to spec.scraping.stalenessMs, the one freshness "
                "setting that admission and the scheduler's filters share"
            )
        return data

    @model_validator(mode="after")
    def _ordered(self) -> AdmissionConfig:
        if (
            self.standard_overload_level is not None
            and self.standard_overload_level < self.sheddable_saturation_level
        ):
            raise ValueError(
                "standardOverloadLevel must be >= sheddableSaturationLevel "
                "(Standard is never shed before Sheddable)"
            )
        return self
