"""The response observer's wire contract, shared by both of its ends.

Envoy's side (`envoy/observer.py`: a Lua filter and the gRPC access log) writes these keys in
the stream's dynamic metadata; the EPP's side (`extproc/accesslog.py`) reads them. The EPP
itself sets `EXCHANGE` when it routes a request, and `RESPONSE_PATH` when it will process
the response too.

When the scheduler learns from first tokens, the Lua filter also reports each streamed 2xx
response's first body byte as it passes: a unary gRPC call `FIRST_BYTE_PATH` to the EPP's
port whose request is a `google.protobuf.StringValue` holding the exchange key, answered
with a `google.protobuf.Empty`.
"""

NAMESPACE = "poolkeeper"
EXCHANGE = "exchange"  # the EPP's key for the detached exchange (string)
RESPONSE_PATH = "response"  # VIA_EPP: the EPP processes this response (it rewrites it)
VIA_EPP = "epp"
# When the request went on to the model server comes from the access-log entry's own timing
# (start_time + time_to_first_upstream_tx_byte): no key for it.
FIRST_BYTE_AT = "first"  # ms (Envoy's clock) when the first response body byte passed
PROMPT_TOKENS = "prompt"  # the last OpenAI `usage` object's counts, when the response had one
COMPLETION_TOKENS = "completion"
CACHED_TOKENS = "cached"
EVENTS = "events"  # SSE `data:` events in the response; set once the whole body has passed
DONE_EVENTS = "done"  # of which `data: [DONE]`

FIRST_BYTE_SERVICE = "poolkeeper.observer.v1.ResponseObserver"
FIRST_BYTE_METHOD = "FirstByte"
FIRST_BYTE_PATH = f"/{FIRST_BYTE_SERVICE}/{FIRST_BYTE_METHOD}"
