"""FailOpen for split model names (reliability round 2, finding 5).

With the EPP down and every pool FailOpen, Envoy sends requests round robin over the pools'
endpoints with the body unchanged. A client-facing name that only names a split (e.g.
`food-review` over `food-review-v1`/`-v2`) is served by no model server: it answered 404. So
Envoy holds a static table, written into the bootstrap from the configuration at start:
each such name and its split's first target. On the FailOpen route only (the EPP routed
nothing), this Lua filter reads the body's `model` and rewrites a name in the table to its
target. Names added by a hot reload after start are not in the table (the next start has them).
"""

from __future__ import annotations

from string import Template
from typing import Any

from poolkeeper.envoy.params import T

FAILOPEN_FILTER = "poolkeeper.fail_open_rewrite"
LUA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
LUA_PER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute"

_LUA = Template("""
local TARGETS = { ${TABLE} }

function envoy_on_request(handle)
  local body = handle:body()
  if body == nil then return end
  local text = body:getBytes(0, body:length())
  local first, last = string.find(text, '"model"%s*:%s*"')
  if first == nil then return end
  local close = string.find(text, '"', last + 1, true)
  if close == nil then return end
  local target = TARGETS[string.sub(text, last + 1, close - 1)]
  if target == nil then return end
  local rewritten = string.sub(text, 1, last) .. target .. string.sub(text, close)
  body:setBytes(rewritten)
  handle:headers():replace("content-length", tostring(#rewritten))
end
""")


def _lua_string(value: str) -> str:
    """A Kubernetes object or model name as a Lua string literal."""
    if not all(c.isalnum() or c in "-._/:" for c in value):
        raise ValueError(f"model name {value!r}: unexpected characters for the FailOpen table")
    return f'"{value}"'


def fail_open_rewrite(table: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """The Lua filter rewriting split names to their first target (per route: FailOpen only)."""
    entries = ", ".join(f"[{_lua_string(name)}] = {_lua_string(to)}" for name, to in table)
    return {
        "name": FAILOPEN_FILTER,
        "typed_config": {
            T: LUA_TYPE,
            "default_source_code": {"inline_string": _LUA.substitute(TABLE=entries)},
        },
    }


def fail_open_rewrite_disabled() -> dict[str, Any]:
    return {T: LUA_PER_ROUTE_TYPE, "disabled": True}
