"""The client's header limits, checked before the EPP is asked (reliability round 2, finding 3).

Envoy applies its header limits (`max_headers_count`, `max_request_headers_kb`) to the request
as the EPP's header mutation leaves it, and answers a mutation that crosses them as an ext_proc
failure: 503 "endpoint picker unavailable", the client's mistake blamed on the EPP. So the
codec's limits are the client's plus `HEADER_HEADROOM` headers and `HEADER_KB_HEADROOM` KiB, and
this Lua filter, first in the chain, answers a request over the client's own limits with 431 in
OpenAI's error shape before ext_proc runs. It counts what the client sent: the headers Envoy
adds before any filter (`x-forwarded-for`, `x-forwarded-proto`, `x-request-id`,
`x-envoy-external-address` or `x-envoy-internal`) are not counted; the request line is (its
pseudo headers in bytes, not in the count), so a 63 KB URL gets 431 too instead of crossing the
codec's limit with the EPP's mutation.
"""

from __future__ import annotations

import json
from string import Template
from typing import Any

from poolkeeper.envoy.params import T

GUARD_FILTER = "poolkeeper.header_guard"
LUA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"

TOO_LARGE_HEADERS = json.dumps(
    {
        "error": {
            "message": "too many request headers or too large: at most {count} headers and "
            "{kb} KiB",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_header_fields_too_large",
        }
    },
    separators=(",", ":"),
)

_LUA = Template("""
local ADDED = { ["x-forwarded-for"] = true, ["x-forwarded-proto"] = true,
  ["x-request-id"] = true, ["x-envoy-external-address"] = true, ["x-envoy-internal"] = true }

function envoy_on_request(handle)
  local count, bytes = 0, 0
  for name, value in pairs(handle:headers()) do
    if string.sub(name, 1, 1) == ":" then
      bytes = bytes + #name + #value
    elseif not ADDED[name] then
      count = count + 1
      bytes = bytes + #name + #value
    end
  end
  if count > ${COUNT} or bytes > ${BYTES} then
    handle:respond({[":status"] = "431", ["content-type"] = "application/json"}, [[${BODY}]])
  end
end
""")


def header_guard(*, max_headers: int, max_kb: int) -> dict[str, Any]:
    """The Lua filter refusing more than `max_headers` client headers or `max_kb` KiB of them."""
    body = TOO_LARGE_HEADERS.replace("{count}", str(max_headers)).replace("{kb}", str(max_kb))
    source = _LUA.substitute(COUNT=max_headers, BYTES=max_kb * 1024, BODY=body)
    return {
        "name": GUARD_FILTER,
        "typed_config": {T: LUA_TYPE, "default_source_code": {"inline_string": source}},
    }
