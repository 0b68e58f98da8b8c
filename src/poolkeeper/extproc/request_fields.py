"""Readers of what Envoy sends the EPP: the request's headers (lower-cased, counted against the
client header limits without what Envoy added), whether any may be a routing or control header
(which a client must never set or pass on), and the proxy's metadata (the subset hint, the
endpoint that served, the response observer's exchange key).
"""

from __future__ import annotations

from collections.abc import Mapping

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from poolkeeper import observation
from poolkeeper.errors import HeadersTooLarge
from poolkeeper.extproc.routing_replies import DESTINATION_HEADER, LB_NAMESPACE

SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
# Headers a client must never be able to set: they steer routing or claim a served endpoint.
ROUTING_HEADER_PREFIX = DESTINATION_HEADER
# Client headers the EPP may read (when the GatewayConfig trusts them) but that must never reach
# a model server (upstream v1.x strips them too).
CONTROL_HEADERS = frozenset(
    {
        "x-gateway-inference-objective",
        "x-gateway-model-name-rewrite",
        "x-gateway-inference-fairness-id",
        "x-llm-d-inference-objective",
        "x-llm-d-model-name-rewrite",
        "x-llm-d-inference-fairness-id",
    }
)
# Every routing and control header starts with one of these (a test checks), after the
# newline `may_name_gateway_headers` joins names with.
_GATEWAY_START, _LLM_D_START = "\nx-gateway-", "\nx-llm-d-"


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased header names to values; Envoy fills `raw_value`, older ones `value`."""
    return request_header_map(headers)[0]


# What Envoy's connection manager adds to a request before any filter runs: not the client's.
# (Not `x-gateway-model-name`: serve's bootstrap does not strip a client's copies, so they count;
# the EPPs behind the BBR bootstrap hold no header limits, `poolkeeper bbr` holds them.)
ENVOY_ADDED_HEADERS = frozenset(
    {
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-request-id",
        "x-envoy-external-address",
        "x-envoy-internal",
    }
)


def request_header_map(headers: pb.HttpHeaders) -> tuple[dict[str, str], int, int]:
    """`header_map`, and in the same pass (count, bytes) of the headers the client sent: the
    request line's pseudo headers count in bytes only (a 63 KB URL is the client's too), the
    headers Envoy added not at all."""
    out: dict[str, str] = {}
    count = size = 0
    for hv in headers.headers.headers:
        raw = hv.raw_value
        value = raw.decode("utf-8", "replace") if raw else hv.value
        key = hv.key.lower()
        # Repeated headers are joined the way HTTP allows for list-valued fields.
        out[key] = f"{out[key]},{value}" if key in out else value
        if key[:1] == ":":
            size += len(key) + len(raw or value)
        elif key not in ENVOY_ADDED_HEADERS:
            count += 1
            size += len(key) + len(raw or value)
    return out, count, size


def may_name_gateway_headers(headers: Mapping[str, str]) -> bool:
    """Whether a header name may be a routing or control header (False: certainly none is):
    one C-level search of the names joined, not a check per header on every request."""
    joined = "\n" + "\n".join(headers)
    return _GATEWAY_START in joined or _LLM_D_START in joined


def header_limit_error(
    count: int, size: int, limits: tuple[int, int] | None
) -> HeadersTooLarge | None:
    """The 431 for a client's headers (`request_header_map`'s count and size) over `limits`
    (most headers, KiB), or None: one rule for the EPP and for BBR."""
    if limits is None or (count <= limits[0] and size <= limits[1] * 1024):
        return None
    return HeadersTooLarge(
        f"too many request headers or too large: at most {limits[0]} headers and {limits[1]} KiB"
    )


def subset_hint(request: pb.ProcessingRequest) -> tuple[str, ...] | None:
    """The endpoints listed in `envoy.lb.subset_hint`, or None when no hint was sent."""
    if not request.HasField("metadata_context"):
        return None
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_HINT_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_HINT_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return tuple(v.string_value for v in value.list_value.values if v.string_value)
    if kind == "string_value":
        return tuple(p.strip() for p in value.string_value.split(",") if p.strip())
    return ()


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """`envoy.lb/x-gateway-destination-endpoint-served` metadata sent on the response path."""
    if not request.HasField("metadata_context"):
        return None
    namespaces = request.metadata_context.filter_metadata
    if LB_NAMESPACE not in namespaces:
        return None
    fields = namespaces[LB_NAMESPACE].fields
    value: str = fields[SERVED_KEY].string_value if SERVED_KEY in fields else ""
    return value or None


def exchange_key(request: pb.ProcessingRequest) -> str | None:
    """The exchange key Envoy forwarded with a response (the response processor's streams)."""
    names = request.metadata_context.filter_metadata.get(observation.NAMESPACE)
    value = names.fields.get(observation.EXCHANGE) if names is not None else None
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return str(value.string_value)
