"""The Kubernetes API's errors, narrowed to the cases `KubeApi`'s callers act on.

`Gone` (410: re-list), `Conflict` (409: re-read and retry), `NotFound` (404), `Throttled` (429
from API priority and fairness: wait its `Retry-After`), `Forbidden` (403: RBAC refused; the
message is the API server's "cannot VERB resource ...", logged as is), `ApiUnavailable`
(anything else: back off). `narrow` turns what lightkube or the HTTP client raised into one of
them; `status_error` a watch stream's error status. `controller/kubernetes/client.py` raises
them.
"""

from __future__ import annotations

import contextlib
import json

import httpx2 as httpx
from lightkube import ApiError

__all__ = ["ApiUnavailable", "Conflict", "Forbidden", "Gone", "NotFound", "Throttled"]


class ApiUnavailable(Exception):
    """The API server could not be reached or answered with an unexpected error."""


class Gone(ApiUnavailable):
    """410: the resource version is too old (compacted); list again."""


class Conflict(ApiUnavailable):
    """409: the object changed since it was read."""


class NotFound(ApiUnavailable):
    """404: no such object, or the API server does not serve this resource."""


class Forbidden(ApiUnavailable):
    """403: RBAC refused the request; the message is the API server's own."""


class Throttled(ApiUnavailable):
    """429: API priority and fairness turned the request away; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


_BY_CODE: dict[int, type[ApiUnavailable]] = {
    410: Gone,
    409: Conflict,
    404: NotFound,
    403: Forbidden,
}


def _error(code: int, message: str, retry_after: str | None = None) -> ApiUnavailable:
    if code == 429:
        try:
            delay = max(0.0, float(retry_after or 1))
        except ValueError:  # an HTTP date: not sent by kube-apiserver; wait the default
            delay = 1.0
        return Throttled(f"{code}: {message}", delay)
    return _BY_CODE.get(code, ApiUnavailable)(f"{code}: {message}")


def narrow(exc: Exception) -> ApiUnavailable:
    if isinstance(exc, httpx.HTTPStatusError):
        response: httpx.Response | None = None
        with contextlib.suppress(RuntimeError, AttributeError):  # an ApiError from a watch
            response = exc.response
        status = exc.status if isinstance(exc, ApiError) else None
        message = (status.message if status is not None else None) or _message_of(response, exc)
        code = (status.code if status is not None else None) or (
            response.status_code if response is not None else 500
        )
        retry_after = response.headers.get("Retry-After") if response is not None else None
        return _error(code, message, retry_after)
    return ApiUnavailable(f"{type(exc).__name__}: {exc}")


def _message_of(response: httpx.Response | None, exc: Exception) -> str:
    """The Status message in the body (lightkube only parses a body whose Content-Type is
    exactly `application/json`; a proxy may add a charset), else the HTTP client's words."""
    if response is not None:
        with contextlib.suppress(Exception):
            message = response.json().get("message")
            if isinstance(message, str) and message:
                return message
    return str(exc)


def status_error(code: int, text: str, retry_after: str | None = None) -> ApiUnavailable:
    message = text
    with contextlib.suppress(ValueError, AttributeError):
        message = json.loads(text).get("message") or text
    return _error(code, message, retry_after)
