"""Envoy's own 5xx replies made OpenAI-shaped: the local-reply mapper's filters (upstream
connection failures by response flag, an unreachable EPP by its marker status, requests whose
target is not a path) and their JSON error bodies."""

from __future__ import annotations

from typing import Any

from poolkeeper.envoy.params import (
    EXT_PROC_ERROR_STATUS,
    UPSTREAM_FAILURE_FLAGS,
)
from poolkeeper.envoy.routes import _openai_error


def local_reply_config() -> dict[str, Any]:
    """OpenAI error bodies for Envoy's own 5xx replies (the EPP's replies already have one).

    Envoy's local replies carry no body. Upstream connection failures are recognised by their
    response flags. An unreachable EPP (FailClose) is recognised by its status: ext_proc's
    `status_on_error` is set to 502, a status the EPP itself never sends, and is answered as
    503 "endpoint picker unavailable". (Dynamic metadata on ImmediateResponses is not applied
    before the local reply, so it cannot tell the two apart.)
    """

    def reply(message: str, type_: str, code: str) -> dict[str, Any]:
        return {
            "text_format_source": {"inline_string": _openai_error(message, type_, code)},
            "content_type": "application/json",
        }

    return {
        "mappers": [
            {
                # The stream idled before the EPP answered (or the server went silent).
                "filter": {"response_flag_filter": {"flags": ["SI"]}},
                "status_code": 504,
                "body_format_override": reply(
                    "no progress on the request in time (endpoint picker or model server)",
                    "timeout_error",
                    "stream_idle_timeout",
                ),
            },
            {
                # No response headers within the first-byte (per-try) timeout.
                "filter": {"response_flag_filter": {"flags": ["UT"]}},
                "status_code": 504,
                "body_format_override": reply(
                    "the model server did not start answering in time",
                    "timeout_error",
                    "upstream_timeout",
                ),
            },
            {
                "filter": {"response_flag_filter": {"flags": list(UPSTREAM_FAILURE_FLAGS)}},
                "body_format_override": reply(
                    "the model server could not be reached",
                    "service_unavailable_error",
                    "upstream_unavailable",
                ),
            },
            {
                "filter": {
                    "status_code_filter": {
                        "comparison": {
                            "op": "EQ",
                            "value": {
                                "default_value": EXT_PROC_ERROR_STATUS,
                                "runtime_key": "poolkeeper.ext_proc_error_status",
                            },
                        }
                    }
                },
                "status_code": 503,
                "body_format_override": reply(
                    "the endpoint picker is unavailable and the pool is FailClose",
                    "service_unavailable_error",
                    "endpoint_picker_unavailable",
                ),
            },
            {
                # A request target no route can match; `OPTIONS *` (and any target that is
                # not a path) never reaches the routes: the connection manager answers it an
                # empty 404 itself (details `absolute_path`, no response flag).
                "filter": {
                    "or_filter": {
                        "filters": [
                            {"response_flag_filter": {"flags": ["NR"]}},
                            {
                                "and_filter": {
                                    "filters": [
                                        {"status_code_filter": _status_is(404)},
                                        _not_a_path_filter(),
                                    ]
                                }
                            },
                        ]
                    }
                },
                "body_format_override": reply(
                    "no such inference API path on this gateway",
                    "invalid_request_error",
                    "not_found",
                ),
            },
            {
                # The connection manager's own 400s, sent before any filter runs and empty: an
                # HTTP/1.1 request without Host, a target with a fragment or an encoded NUL
                # (`path_normalization_failed`). Recognised by the request, so the EPP's 400s
                # (whose messages say what was wrong with the body) keep their own bodies.
                "filter": _status_and_any(
                    400,
                    _header_filter(":authority", absent=True),
                    _header_filter(":path", regex=_REFUSED_TARGET),
                ),
                "body_format_override": reply(
                    # Which of the three it was, in Envoy's words (`missing_host_header`,
                    # `http1.codec_error`, `path_normalization_failed`, ...).
                    "malformed request (%RESPONSE_CODE_DETAILS%): a Host header is required, "
                    "and the target may have no fragment or encoded NUL",
                    "invalid_request_error",
                    "malformed_request",
                ),
            },
            {
                # The request's headers (request_headers_timeout) or the whole request
                # (request_timeout) did not arrive in time: Envoy's own 408 was text/plain.
                # The EPP and its ImmediateResponses never answer 408.
                "filter": {"status_code_filter": _status_is(408)},
                "body_format_override": reply(
                    "the request was not received in time",
                    "invalid_request_error",
                    "request_timeout",
                ),
            },
            {
                # Envoy refuses upgrades it is not configured for (WebSocket, CONNECT) with an
                # empty 403 before any filter runs; recognised by the request asking for one.
                "filter": _status_and_any(
                    403,
                    _header_filter("upgrade", present=True),
                    _header_filter(":method", exact="CONNECT"),
                ),
                "body_format_override": reply(
                    "protocol upgrades and CONNECT are not supported on this gateway",
                    "invalid_request_error",
                    "upgrade_not_supported",
                ),
            },
        ]
    }


def _status_is(status: int) -> dict[str, Any]:
    return {
        "comparison": {
            "op": "EQ",
            "value": {"default_value": status, "runtime_key": f"poolkeeper.status_{status}"},
        }
    }


def _status_and_any(status: int, *filters: dict[str, Any]) -> dict[str, Any]:
    """A reply of `status` to a request that matches any of `filters`."""
    either = {"or_filter": {"filters": list(filters)}}
    return {"and_filter": {"filters": [{"status_code_filter": _status_is(status)}, either]}}


def _header_filter(
    name: str, *, present: bool = False, absent: bool = False, exact: str = "", regex: str = ""
) -> dict[str, Any]:
    matcher: dict[str, Any] = {"name": name}
    if present or absent:
        matcher["present_match"] = present
    elif regex:
        matcher["string_match"] = {"safe_regex": {"regex": regex}}
    else:
        matcher["string_match"] = {"exact": exact}
    return {"header_filter": {"header": matcher}}


# A target Envoy refuses before routing: a fragment anywhere, an encoded NUL before the query.
_REFUSED_TARGET = r"[^?]*%00.*|.*#.*"


def _not_a_path_filter() -> dict[str, Any]:
    """The request's target is not a path (`*`, or an absolute form Envoy did not rewrite)."""
    matcher = {"name": ":path", "string_match": {"prefix": "/"}, "invert_match": True}
    return {"header_filter": {"header": matcher}}
