"""The ext_proc filters towards the EPP: the request filter (`ext_proc_filter`, serve's and
the BBR bootstrap's), the response-only one of the response observer (`response_processor`),
and what both share (`ext_proc_config`: the EPP's gRPC service, fail-open, timeouts, the
FailClose marker status)."""

from __future__ import annotations

from typing import Any

from poolkeeper import observation
from poolkeeper.envoy.observer import RESPONSE_PROCESSOR
from poolkeeper.envoy.params import (
    EXT_PROC_ERROR_STATUS,
    EXT_PROC_FILTER,
    EXT_PROC_TYPE,
    BootstrapParams,
    T,
    duration,
    epp_grpc_service,
)


def ext_proc_filter(p: BootstrapParams) -> dict[str, Any]:
    """The EPP's ext_proc filter. With the response observer it sees requests only: responses
    that need the EPP go through `response_processor` (envoy/observer.py), the rest past it."""
    responses = "SKIP" if p.observe_responses else "SEND"
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            **ext_proc_config(p),
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_header_mode": responses,
                "response_body_mode": "NONE" if p.observe_responses else "FULL_DUPLEX_STREAMED",
                "response_trailer_mode": responses,
            },
            # The EPP names each routed request in `poolkeeper` metadata (the response
            # observer's keys; poolkeeper.observation).
            "metadata_options": {"receiving_namespaces": {"untyped": [observation.NAMESPACE]}},
        },
    }


def response_processor(p: BootstrapParams) -> dict[str, Any]:
    """With the response observer: a second ext_proc filter that sends the EPP only responses,
    and only on the route the EPP chose for the responses it rewrites (envoy/observer.py)."""
    return {
        "name": RESPONSE_PROCESSOR,
        "typed_config": {
            **ext_proc_config(p),
            "processing_mode": {
                "request_header_mode": "SKIP",
                "request_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "response_trailer_mode": "SEND",
            },
            # The exchange key tells the EPP which routed request this response belongs to.
            "metadata_options": {"forwarding_namespaces": {"untyped": [observation.NAMESPACE]}},
        },
    }


def ext_proc_config(p: BootstrapParams) -> dict[str, Any]:
    """What every ext_proc filter towards the EPP shares."""
    return {
        T: EXT_PROC_TYPE,
        "grpc_service": epp_grpc_service(p),
        "failure_mode_allow": p.fail_open,
        "allow_mode_override": False,
        "message_timeout": duration(p.message_timeout_s),
        # FailClose with the EPP unreachable: a marker status the local-reply mapper turns
        # into 503 "endpoint picker unavailable" with an OpenAI body.
        "status_on_error": {"code": EXT_PROC_ERROR_STATUS},
    }
