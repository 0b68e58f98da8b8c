"""The Grafana dashboard for the gateway's Prometheus metrics (`telemetry/metrics.py`), as a
dict: request rate, errors, latency percentiles, tokens, running requests, routing decision
time, and the pool gauges (KV cache, queue, ready pods). Pure; `manifests.py` writes it."""

from __future__ import annotations

from typing import Any


# (title, unit, PromQL expressions); every metric named here is one the gateway exports
# (a test checks that against a live /metrics page).
def _quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[5m])))"


_LATENCY = "inference_model_request_duration_seconds"
_DECISION = "inference_extension_scheduler_e2e_duration_seconds"

PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "Requests per second by model",
        "reqps",
        ("sum by (model_name) (rate(inference_model_request_total[1m]))",),
    ),
    (
        "Errors per second by code",
        "reqps",
        ("sum by (error_code) (rate(inference_model_request_error_total[1m]))",),
    ),
    ("Request latency p50 / p99", "s", (_quantile(0.5, _LATENCY), _quantile(0.99, _LATENCY))),
    (
        "Output tokens per second by model",
        "short",
        ("sum by (model_name) (rate(inference_model_output_tokens_sum[1m]))",),
    ),
    (
        "Input tokens per second by model",
        "short",
        ("sum by (model_name) (rate(inference_model_input_tokens_sum[1m]))",),
    ),
    (
        "Running requests by model",
        "short",
        ("sum by (model_name) (inference_model_running_requests)",),
    ),
    ("Routing decision p99", "s", (_quantile(0.99, _DECISION),)),
    ("Pool KV cache utilization", "percentunit", ("inference_pool_average_kv_cache_utilization",)),
    ("Pool queue size", "short", ("inference_pool_average_queue_size",)),
    ("Pool ready pods", "short", ("inference_pool_ready_pods",)),
)


def dashboard() -> dict[str, Any]:
    panels = []
    for index, (title, unit, exprs) in enumerate(PANELS):
        panels.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": "__auto"}
                    for i, expr in enumerate(exprs)
                ],
            }
        )
    return {
        "title": "poolkeeper gateway",
        "uid": "poolkeeper-gateway",
        "tags": ["poolkeeper", "inference"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                }
            ]
        },
        "panels": panels,
    }
