"""A kubeconfig file for tests: one cluster (the API-server double's URL, or any), one user
and the context joining them, as `kubectl` and poolkeeper's loader read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_kubeconfig(
    path: Path, server: str, *, token: str | None = None, namespace: str | None = None
) -> Path:
    """A kubeconfig at `path` for the API server at `server`; the user sends `token` as its
    bearer token where given; the context names `namespace` where given. Returns `path`."""
    context: dict[str, Any] = {"cluster": "c", "user": "u"}
    if namespace is not None:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": token} if token is not None else {}}],
        "contexts": [{"name": "c", "context": context}],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(config))
    return path
