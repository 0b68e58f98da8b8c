"""ScrapingConfig: camelCase YAML, defaults, validation messages, engine resolution."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from poolkeeper.backend.config import ENGINE_TYPE_LABEL, ScrapingConfig


def test_defaults() -> None:
    config = ScrapingConfig()
    assert (config.interval_ms, config.timeout_ms, config.staleness_ms) == (50, 1000, 200)
    assert config.max_response_bytes == 4 * 1024 * 1024
    assert (config.path, config.scheme, config.default_engine) == ("/metrics", "http", "vllm")
    assert config.engine_label == ENGINE_TYPE_LABEL
    assert (config.interval_s, config.timeout_s, config.staleness_s) == (0.05, 1.0, 0.2)


def test_camel_case_keys_and_engine_alias() -> None:
    config = ScrapingConfig.model_validate(
        {"intervalMs": 20, "maxResponseBytes": 2048, "defaultEngine": "triton"}
    )
    assert config.interval_ms == 20
    assert config.max_response_bytes == 2048
    assert config.default_engine == "triton-trtllm"


@pytest.mark.parametrize(
    ("data", "where", "message"),
    [
        ({"intervalMS": 20}, "intervalMS", "Extra inputs are not permitted"),
        ({"intervalMs": 0}, "intervalMs", "greater than or equal to 5"),
        ({"path": "metrics"}, "path", "absolute URL path"),
        ({"scheme": "ftp"}, "scheme", "'http' or 'https'"),
        ({"defaultEngine": "tgi"}, "defaultEngine", "unknown engine type 'tgi'"),
    ],
)
def test_bad_values_name_the_field(data: dict[str, object], where: str, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        ScrapingConfig.model_validate(data)
    error = info.value.errors()[0]
    assert error["loc"] == (where,)
    assert message in str(info.value)


def test_engine_for_endpoint() -> None:
    config = ScrapingConfig(default_engine="sglang")
    assert config.engine_for({}) == "sglang"
    assert config.engine_for({ENGINE_TYPE_LABEL: "trtllm"}) == "trtllm-serve"
    assert config.engine_for({ENGINE_TYPE_LABEL: "sglang"}, explicit="vllm") == "vllm"
    with pytest.raises(ValueError, match="unknown engine type"):
        config.engine_for({ENGINE_TYPE_LABEL: "nope"})
