"""The request path's upstream instruments (`pkg/epp/metrics/metrics.go@v0.5.1`) and their
buckets: the `inference_model_*` families, the scheduler's end-to-end latency, the build info,
and the flow-control queue and hold durations. `RequestInstruments` is `GatewayMetrics`'
base: it makes them, in registration order, and the observer hooks record into them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from poolkeeper import __version__
from poolkeeper.telemetry.children import Counter, Gauge, Histogram

DURATION_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20,
    30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
REQUEST_SIZE_BUCKETS = tuple(float(64 << i) for i in range(25))  # 64 B .. 1 GiB, x2 steps
# Upstream's response-size and input-token buckets say 32778 where 32768 was meant; kept so
# that bucket boundaries (and dashboards built on them) are identical.
RESPONSE_SIZE_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
)  # fmt: skip
INPUT_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
    262144, 524288, 1048576,
)  # fmt: skip
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
SCHEDULER_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


class RequestInstruments:
    def _model_instruments(self, r: CollectorRegistry) -> None:
        """The `inference_model_*` families, the scheduler's latency, the build info."""
        model_labels = ["model_name", "target_model_name"]
        self.request_total = Counter(
            "inference_model_request",
            "Counter of inference model requests broken out for each model and target model.",
            model_labels,
            registry=r,
        )
        self.request_error_total = Counter(
            "inference_model_request_error",
            "Counter of inference model requests errors broken out for each model and target "
            "model.",
            [*model_labels, "error_code"],
            registry=r,
        )
        self.request_duration = Histogram(
            "inference_model_request_duration_seconds",
            "Inference model response latency distribution in seconds for each model and target "
            "model.",
            model_labels,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.request_sizes = Histogram(
            "inference_model_request_sizes",
            "Inference model requests size distribution in bytes for each model and target model.",
            model_labels,
            buckets=REQUEST_SIZE_BUCKETS,
            registry=r,
        )
        self.response_sizes = Histogram(
            "inference_model_response_sizes",
            "Inference model responses size distribution in bytes for each model and target model.",
            model_labels,
            buckets=RESPONSE_SIZE_BUCKETS,
            registry=r,
        )
        self.input_tokens = Histogram(
            "inference_model_input_tokens",
            "Inference model input token count distribution for requests in each model.",
            model_labels,
            buckets=INPUT_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "inference_model_output_tokens",
            "Inference model output token count distribution for requests in each model.",
            model_labels,
            buckets=OUTPUT_TOKEN_BUCKETS,
            registry=r,
        )
        self.running_requests = Gauge(
            "inference_model_running_requests",
            "Inference model number of running requests in each model.",
            ["model_name"],
            registry=r,
        )
        self.ntpot = Histogram(
            "inference_model_normalized_time_per_output_token_seconds",
            "Inference model latency divided by number of output tokens in seconds for each "
            "model and target model.",
            model_labels,
            buckets=NTPOT_BUCKETS,
            registry=r,
        )
        self.scheduler_duration = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "End-to-end scheduling latency distribution in seconds.",
            buckets=SCHEDULER_BUCKETS,
            registry=r,
        )
        self.info = Gauge(
            "inference_extension_info",
            "General information of the current build of Inference Extension.",
            ["commit", "build_ref"],
            registry=r,
        )
        self.info.labels("", f"poolkeeper-{__version__}").set(1)

    def _flow_instruments(self, r: CollectorRegistry) -> None:
        """The flow-control queue and hold durations."""
        self.flow_queue_duration = Histogram(
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time requests spent in the flow-control queue, by outcome (Dispatched, "
            "RejectedCapacity, RejectedOther, EvictedTTL, EvictedContextCancelled).",
            [
                "fairness_id",
                "priority",
                "outcome",
                "inference_pool",
                "model_name",
                "target_model_name",
            ],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.flow_hold_duration = Histogram(
            "poolkeeper_flow_control_hold_duration_seconds",
            "Time requests were held in front of the flow-control queue by holdNewPrefixes, "
            "by how the hold ended (released, capped at maxHoldMs, cancelled); the count is "
            "the requests held.",
            ["inference_pool", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
