"""Values crossing the boundary between a front end (ext_proc) and the Director."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from poolkeeper.api.criticality import Criticality


@dataclass(slots=True)
class IncomingRequest:
    """A request as the proxy saw it. Header names are lower-case. Read-only by convention:
    not `frozen`, whose `__init__` costs 2-3x (an `object.__setattr__` per field), per request."""

    request_id: str
    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes = b""  # empty for header-only requests
    subset_hint: tuple[str, ...] | None = None  # envoy.lb.subset_hint endpoints, if sent


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage reported by the model server (OpenAI `usage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    # Counted by the gateway, not reported by the server (a stream without `usage`, seen only
    # by the response observer): good for fairness and speed, kept out of token metrics.
    estimated: bool = False

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RoutingDecision:
    """Where to send a request, and the (possibly rewritten) body to send.

    `endpoints` is ordered: the first is the pick, the rest are fallbacks (ip:port each).
    `body` is None when the body must pass unchanged (or there was none).
    `ticket` is the Director's own bookkeeping handle, given back in `Director.complete`.
    """

    request_id: str
    endpoints: tuple[str, ...]
    pool: str  # "namespace/name" of the InferencePool
    model_name: str = ""  # client-facing model ("" for header-only requests)
    target_model: str = ""
    criticality: Criticality = Criticality.STANDARD
    priority: int | None = None  # InferenceObjective priority (upstream v1.x), when one applies
    stream: bool = False
    prompt_tokens: int = 0
    body: bytes | None = None
    include_usage_injected: bool = False  # the Director added stream_options.include_usage
    ticket: object = field(default=None, repr=False)
    # A server it may go to answers under its own model name whatever the request said (an
    # engine with `names_responses_itself`: llama.cpp), so the response's model is given back
    # to the client's name even when the request was not renamed.
    server_names_model: bool = False

    @property
    def renames_response_model(self) -> bool:
        """Whether the response's model name must be given back to the client's."""
        return bool(self.model_name) and (
            self.server_names_model or model_renamed(self.target_model, self.model_name)
        )


def model_renamed(target: str, client: str) -> bool:
    """Whether the model server answers under another name than the one the client asked for
    (a split or rewrite to another target), so the response's model name must be given back.
    The one rule for it: the Director (may usage be injected) and ext_proc (rewrite, and
    whether the response must come back to the EPP) both ask here."""
    return bool(target) and bool(client) and target != client
