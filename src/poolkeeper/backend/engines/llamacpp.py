"""llama.cpp's HTTP server (`llama-server --metrics`), checked against a real build.

signal      family                           exact?
waiting     llamacpp:requests_deferred       exact: requests waiting for a free slot
running     llamacpp:requests_processing     exact: slots busy with a request
KV 0..1     -                                not exported: reads 0.0 (see below)
LoRA        -
block size  -
GPU blocks  -
base model  -                                no labels on the page

What the server is (docs/engines.md, "llama.cpp"): a fixed number of slots (`--parallel`), each
running one request; a request that finds every slot busy is deferred until one frees, so
`requests_deferred` is the exact queue and `requests_processing` the exact running count. The
page has no KV-cache fill: each slot owns its share of the context, so a server is full when
its slots are, which the queue already says (saturation counts waiting requests; a deferred
request means every slot is busy). KV usage therefore reads 0.0: the KV-utilisation scorer is
neutral between llama.cpp servers and saturation is decided by the queue alone.

The server answers every request under its own model name (its first `--alias`, else the model
file's name), whatever the request's `model` said: `names_responses_itself`, so the gateway gives
each response the client's name back.
"""

from __future__ import annotations

from typing import Final

from poolkeeper.backend.engines.mapping import EngineMapping, EngineType, specs

__all__ = ["ENGINE"]

ENGINE: Final = EngineType(
    name="llamacpp",
    title="llama.cpp",
    aliases=("llama.cpp", "llama-cpp", "llama-server"),
    mapping=EngineMapping(
        name="llamacpp",
        waiting=specs("llamacpp:requests_deferred"),
        running=specs("llamacpp:requests_processing"),
        kv_usage=(),
    ),
    names_responses_itself=True,
)
