"""The response observer: what Envoy tells the EPP about a response the EPP no longer processes.

Why: the EPP answering every response chunk costs it CPU per generated token, and a stream
whose body goes through the EPP cannot outlive it (Envoy fails open only until a
FULL_DUPLEX body has been sent). So the EPP's ext_proc filter sees requests only; once a
request is routed the EPP ends its ext_proc stream (`extproc/state.py`) and learns the
outcome from Envoy:

- a small Lua filter (after ext_proc, on responses only: nothing of it runs on the request
  path) notes, in the stream's `poolkeeper` dynamic metadata (keys in
  `poolkeeper.observation`), the time of the first response body byte, the last OpenAI
  `usage` object's token counts and the number of SSE `data:` events; it reads the bytes as
  they pass and holds none back (when the request left for the model server is Envoy's own
  timing, in the access-log entry);
- Envoy's gRPC access-log service sends one entry per request that the EPP routed (a
  metadata filter on `poolkeeper.exchange`, the key the EPP set when routing) to the EPP's own
  gRPC port, on completion, client reset and upstream failure alike, with the status, the
  response flags, the serving host and that metadata (`extproc/accesslog.py` reads it);
- only when the scheduler learns from first tokens (`BootstrapParams.report_first_bytes`):
  the Lua filter also reports a 2xx event stream's first body byte as it passes, one
  asynchronous unary gRPC call to the EPP (`observation.FIRST_BYTE_PATH`), so that the EPP
  knows at once that the request's prefill is over, not only when the request has ended.

A response the EPP must rewrite (the client's model name given back, an injected usage chunk
removed) goes through a second ext_proc filter, `RESPONSE_PROCESSOR`, that sends responses
only. It is off on every route but one, chosen again once the EPP has routed the request and
set `poolkeeper.response` to "epp"; the EPP finds the request by its exchange key, forwarded
with the response. (A per-request processing-mode override is refused by Envoy with
FULL_DUPLEX bodies, and ending the one stream while Envoy may already be sending the response
body would lose the chunk in flight: so a separate filter, chosen by the route.)
"""

from __future__ import annotations

from string import Template
from typing import Any

from poolkeeper import observation as wire
from poolkeeper.envoy.params import EPP_CLUSTER, EPP_TOKEN_HEADER, EXT_PROC_PER_ROUTE_TYPE, T

LUA_FILTER = "envoy.filters.http.lua"
LUA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
LUA_PER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute"
ALS_TYPE = "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
ALS_LOG_NAME = "poolkeeper-observer"
RESPONSE_PROCESSOR = "poolkeeper.response_processor"

# Lua patterns, not regular expressions: `%b{}` is a balanced {...}. A `"usage"` key can only
# be structural JSON (inside a JSON string its quotes are escaped); the last object seen wins
# (the final usage chunk of a stream). vLLM-style streams carry `"usage":null` in every event.
#
# Why the per-chunk work allocates almost nothing: this runs on Envoy's one worker for every
# streamed event of every response. Concatenating each chunk with the last 512 bytes and
# counting markers with `gsub` (a new string per call) cost Envoy +6-10 CPU-s per 30 s of live
# heavy-tail at 37.5 req/s on 2 cores (twice round-robin Envoy's CPU) and the EPP path 1.1-4.6x
# round-robin's p90 TTFT (docs/notes/2026-12-08-epp-path-gap.md). Markers are now counted with plain
# finds in the chunk, plus the one that crosses from the stream's last CARRY bytes into it; a
# usage object is read from its key on, and only a key whose `{...}` has not ended yet keeps its
# text (`pending`, at most PENDING_MAX bytes: a split usage object larger than that is not read;
# real ones are 100-300 bytes) for the next chunk.
#
# The first-byte report (REPORT true) is a gRPC request written by hand: a 5-byte frame
# header (uncompressed, big-endian length) around a StringValue (field 1, length-delimited),
# sent asynchronously (Envoy neither waits for nor surfaces the answer), so the response to
# the client is never held up by it. Only for 2xx event streams: the Director learns first
# tokens of streamed requests only, and an error body is not a first token.
_LUA = Template(r"""
local NS = "${NS}"
local REPORT = ${REPORT}

local function varint(n)
  local out = ""
  while n >= 128 do
    out = out .. string.char(n % 128 + 128)
    n = math.floor(n / 128)
  end
  return out .. string.char(n)
end

local function report_first_byte(handle)
  local names = handle:streamInfo():dynamicMetadata():get(NS)
  local key = names and names["${EXCHANGE}"]
  if type(key) ~= "string" then return end
  local message = "\10" .. varint(#key) .. key
  local n = #message
  local frame = "\0" .. string.char(math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
    math.floor(n / 256) % 256, n % 256) .. message
  handle:httpCall("${CLUSTER}", {
    [":method"] = "POST", [":path"] = "${PATH}", [":authority"] = "${CLUSTER}",
    ["content-type"] = "application/grpc", ["te"] = "trailers",${TOKEN}
  }, frame, ${TIMEOUT_MS}, true)
end

local function number(text, key)
  local value = string.match(text, '"' .. key .. '"%s*:%s*(%d+)')
  if value then return tonumber(value) end
  return nil
end

-- The stream's last CARRY bytes are kept: enough to hold all but one byte of the longest
-- marker ('"usage"'), so a marker split between chunks is found where it ends.
local CARRY = 6
local PENDING_MAX = 4096

-- How often `marker` occurs in `s` (a plain search; no marker can overlap itself).
local function count(s, marker)
  local n, at = 0, 1
  while true do
    local i = string.find(s, marker, at, true)
    if i == nil then return n end
    n, at = n + 1, i + #marker
  end
end

-- Where `marker` starts in `edge` (the `carried` bytes before this chunk, then its first ones)
-- when it starts before the chunk and ends in it; nil otherwise (a marker wholly in the chunk
-- is `count`'s, one wholly before it was found with an earlier chunk).
local function crossing(edge, carried, marker)
  local i = string.find(edge, marker, math.max(1, carried - #marker + 2), true)
  if i ~= nil and i <= carried then return i end
  return nil
end

local function set_usage(handle, usage)
  local prompt = number(usage, "prompt_tokens")
  local completion = number(usage, "completion_tokens")
  if prompt or completion then
    local md = handle:streamInfo():dynamicMetadata()
    md:set(NS, "${PROMPT}", prompt or 0)
    md:set(NS, "${COMPLETION}", completion or 0)
    local cached = number(usage, "cached_tokens")
    if cached then md:set(NS, "${CACHED}", cached) end
  end
end

-- Reads every complete usage object in `text` into the metadata. Returns `text` from a
-- "usage" key whose object has not ended yet (or whose value has not begun), else nil.
local function read_usage(handle, text)
  local at = 1
  while true do
    local k = string.find(text, '"usage"', at, true)
    if k == nil then return nil end
    local _, e, usage = string.find(text, '^%s*:%s*(%b{})', k + 7)
    if usage ~= nil then
      set_usage(handle, usage)
      at = e + 1
    else
      local _, v = string.find(text, '^%s*:?%s*', k + 7)
      local following = string.byte(text, v + 1)
      if following == nil or following == 123 then  -- nothing yet, or an unfinished '{'
        if #text - k >= PENDING_MAX then return nil end
        return string.sub(text, k)
      end
      at = v + 1  -- null (every event of a vLLM stream) or another value: no counts
    end
  end
end

function envoy_on_response(handle)
  -- Envoy's Lua objects are valid only until the script yields (each body chunk), so the
  -- metadata handle is fetched anew after each.
  local report = false
  if REPORT then
    local status = handle:headers():get(":status") or ""
    local kind = handle:headers():get("content-type") or ""
    report = string.sub(status, 1, 1) == "2" and string.find(kind, "text/event-stream", 1, true)
  end
  local seen_first = false
  local events, done = 0, 0
  local carry, pending = "", nil
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    if size > 0 then
      if not seen_first then
        seen_first = true
        handle:streamInfo():dynamicMetadata():set(NS, "${FIRST}", handle:timestamp())
        if report then report_first_byte(handle) end
      end
      local bytes = chunk:getBytes(0, size)
      local edge, carried = carry .. string.sub(bytes, 1, CARRY), #carry
      events = events + count(bytes, "data:") + (crossing(edge, carried, "data:") and 1 or 0)
      done = done + count(bytes, "[DONE]") + (crossing(edge, carried, "[DONE]") and 1 or 0)
      local text = bytes
      if pending ~= nil then
        text = pending .. bytes
      else
        local k = crossing(edge, carried, '"usage"')
        if k ~= nil then text = string.sub(carry, k) .. bytes end
      end
      pending = read_usage(handle, text)
      carry = string.sub(size >= CARRY and bytes or edge, -CARRY)
    end
  end
  local md = handle:streamInfo():dynamicMetadata()
  md:set(NS, "${EVENTS}", events)
  md:set(NS, "${DONE}", done)
end
""")

# The first-byte report's deadline: Envoy drops the call after this (the EPP answers at once).
REPORT_TIMEOUT_MS = 1000


def lua_source(*, report_first_bytes: bool, token: str | None = None) -> str:
    """The observer's Lua script; `report_first_bytes`: with the first-byte report, which
    carries the EPP's `token` (URL-safe characters only: safe in a Lua string)."""
    if token is not None and not token.replace("-", "").replace("_", "").isalnum():
        raise ValueError("the EPP token must be URL-safe base64")
    return _LUA.substitute(
        TOKEN="" if token is None else f' ["{EPP_TOKEN_HEADER}"] = "{token}",',
        NS=wire.NAMESPACE,
        REPORT="true" if report_first_bytes else "false",
        EXCHANGE=wire.EXCHANGE,
        CLUSTER=EPP_CLUSTER,
        PATH=wire.FIRST_BYTE_PATH,
        TIMEOUT_MS=REPORT_TIMEOUT_MS,
        FIRST=wire.FIRST_BYTE_AT,
        PROMPT=wire.PROMPT_TOKENS,
        COMPLETION=wire.COMPLETION_TOKENS,
        CACHED=wire.CACHED_TOKENS,
        EVENTS=wire.EVENTS,
        DONE=wire.DONE_EVENTS,
    )


def lua_filter(*, report_first_bytes: bool = False, token: str | None = None) -> dict[str, Any]:
    source = lua_source(report_first_bytes=report_first_bytes, token=token)
    return {
        "name": LUA_FILTER,
        "typed_config": {T: LUA_TYPE, "default_source_code": {"inline_string": source}},
    }


def via_epp_matcher() -> dict[str, Any]:
    """Route match: the EPP asked to process this request's response."""
    return {
        "filter": wire.NAMESPACE,
        "path": [{"key": wire.RESPONSE_PATH}],
        "value": {"string_match": {"exact": wire.VIA_EPP}},
    }


def response_processor_enabled() -> dict[str, Any]:
    return {T: EXT_PROC_PER_ROUTE_TYPE, "overrides": {}}


def response_processor_disabled() -> dict[str, Any]:
    return {T: EXT_PROC_PER_ROUTE_TYPE, "disabled": True}


def lua_disabled() -> dict[str, Any]:
    """Per-route: no observation on routes Envoy answers itself."""
    return {LUA_FILTER: {T: LUA_PER_ROUTE_TYPE, "disabled": True}}


def access_log(flush_interval_s: float, grpc_service: dict[str, Any]) -> dict[str, Any]:
    """One gRPC access-log entry per EPP-routed request, to the EPP's port, batched for at most
    `flush_interval_s` (or 16 KiB): one message per batch, whatever the response's length."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {
            "metadata_filter": {
                "matcher": {
                    "filter": wire.NAMESPACE,
                    "path": [{"key": wire.EXCHANGE}],
                    "value": {"present_match": True},
                },
                "match_if_key_not_found": False,
            }
        },
        "typed_config": {
            T: ALS_TYPE,
            "common_config": {
                "log_name": ALS_LOG_NAME,
                "transport_api_version": "V3",
                "grpc_service": grpc_service,
                "buffer_flush_interval": f"{flush_interval_s:g}s",
                "buffer_size_bytes": 16384,
            },
        },
    }
