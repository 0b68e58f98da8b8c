"""The non-inference endpoints of a simulated server: models and adapters, health, metrics,
router registration calls, and the simulator's own /sim/stats and /sim/faults.

A mixin of SimServer (sim/server.py), which provides the attributes declared here.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from poolkeeper.sim.config import FaultSettings, ServerSpec
from poolkeeper.sim.driver import RealtimeDriver
from poolkeeper.sim.engine import EngineModel
from poolkeeper.sim.faults import (
    FAULT_HEADER,
    GARBAGE_METRICS,
    FaultConfig,
    FaultSpecError,
    decide_faults,
)
from poolkeeper.sim.metrics_text import LoraInfoSeries, render_metrics
from poolkeeper.sim.openai_format import error_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_error(message: str, status: int, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status=status, param=param), status=status)


@web.middleware
async def openai_http_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 4xx/5xx (no such path, a wrong method, a body over the size limit) in
    OpenAI's error shape, as vLLM's exception handler answers them: the gateway passes a model
    server's error to the client as it came, and a client expects JSON, not "404: Not Found"."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise  # a redirect, or a handler's own error already in OpenAI's shape
        response = json_error(_error_message(exc), exc.status)
        for name, value in exc.headers.items():  # Allow on a 405, and whatever else it set
            if name.lower() not in _BODY_HEADERS:
                response.headers.add(name, value)
        return response


# Describe the plain-text body the error came with; the JSON body replaces it.
_BODY_HEADERS = frozenset({"content-type", "content-length"})


def _error_message(exc: web.HTTPException) -> str:
    """The error's own detail ("Maximum request body size ... exceeded.") where it has one;
    its reason where the text is aiohttp's default "404: Not Found"."""
    text = (exc.text or "").strip()
    if not text or text == f"{exc.status}: {exc.reason}":
        return exc.reason
    return text


class AdminEndpoints:
    """Handlers for everything but inference; SimServer supplies the state."""

    spec: ServerSpec
    engine: EngineModel
    driver: RealtimeDriver
    faults: FaultConfig
    lora_series: LoraInfoSeries
    rng: random.Random
    started: int

    @property
    def name(self) -> str:
        return self.spec.name

    # -- models and adapters --------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        config = self.engine.config
        data: list[dict[str, Any]] = [
            {
                "id": config.model,
                "object": "model",
                "created": self.started,
                "owned_by": "vllm",
                "root": config.model,
                "parent": None,
                "max_model_len": config.effective_max_model_len,
            }
        ]
        for name, path in self.engine.adapters.items():
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": self.started,
                    "owned_by": "vllm",
                    "root": path,
                    "parent": config.model,
                    "max_model_len": config.effective_max_model_len,
                }
            )
        return web.json_response({"object": "list", "data": data})

    async def load_lora(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return json_error("Both 'lora_name' and 'lora_path' must be provided.", 400)
        if name in self.engine.adapters:
            return json_error(f"The lora adapter '{name}' has already been loaded.", 400)
        self.engine.register_adapter(name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.engine.adapters:
            return json_error(f"The lora adapter '{name}' cannot be found.", 404)
        self.engine.unregister_adapter(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # -- observability --------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        mode = self.faults.metrics
        header = request.headers.get(FAULT_HEADER) if self.faults.header_faults else None
        if header:
            try:
                mode = decide_faults(FaultConfig(header_faults=True), header, self.rng).metrics
            except FaultSpecError as exc:
                return json_error(str(exc), 400)
        if mode == "garbage":
            return web.Response(text=GARBAGE_METRICS, content_type="text/plain")
        if mode == "slow":
            await asyncio.sleep(self.faults.metrics_delay_s)
        stats = self.engine.stats()
        self.lora_series.record(stats, time.time())
        text = render_metrics(
            model=self.engine.config.model,
            stats=stats,
            counters=self.engine.counters,
            lora_series=self.lora_series,
            enable_prefix_caching=self.engine.config.enable_prefix_caching,
        )
        return web.Response(
            body=text.encode(), headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    async def server_info(self, request: web.Request) -> web.Response:
        config = self.engine.config
        return web.json_response(
            {
                "model_path": config.model,
                "tokenizer_path": config.model,
                "served_model_name": config.model,
                "max_num_seqs": config.max_num_seqs,
                "max_total_num_tokens": config.kv_capacity_tokens,
                "context_length": config.effective_max_model_len,
                "page_size": config.block_size,
                "version": "poolkeeper-sim",
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.config
        return web.json_response(
            {"model_path": config.model, "tokenizer_path": config.model, "is_generation": True}
        )

    async def get_load(self, request: web.Request) -> web.Response:
        stats = self.engine.stats()
        used = round(stats.kv_cache_usage * stats.num_gpu_blocks * stats.block_size)
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": stats.running + stats.waiting,
                    "num_waiting_reqs": stats.waiting,
                    "num_tokens": used,
                }
            ]
        )

    async def sim_stats(self, request: web.Request) -> web.Response:
        c = self.engine.counters
        stats = self.engine.stats()
        return web.json_response(
            {
                "name": self.name,
                "waiting": stats.waiting,
                "running": stats.running,
                "kv_cache_usage": stats.kv_cache_usage,
                "steps": c.steps,
                "busy_time": c.busy_time,
                "preemptions": c.preemptions,
                "lora_loads": c.lora_loads,
                "prefix_queries": c.prefix_queries,
                "prefix_hits": c.prefix_hits,
                "generation_tokens": c.generation_tokens,
                "finished": dict(c.finished),
                "ttft": {"count": c.ttft.count, "sum": c.ttft.sum},
                "itl": {"count": c.itl.count, "sum": c.itl.sum},
                "e2e": {"count": c.e2e.count, "sum": c.e2e.sum},
                "driver_lag_max": self.driver.lag_max,
                "driver_lag_sum": self.driver.lag_sum,
                "driver_steps": self.driver.steps_delivered,
                "driver_lag_mean": self.driver.lag_sum / max(1, self.driver.steps_delivered),
            }
        )

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(FaultSettings(**_fault_fields(self.faults)).model_dump())

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        try:
            settings = FaultSettings.model_validate(body)
        except ValidationError as exc:
            return json_error(str(exc).replace("\n", " "), 400)
        if "header_faults" not in settings.model_fields_set:  # a start-up choice: kept
            settings = settings.model_copy(update={"header_faults": self.faults.header_faults})
        self.faults = settings.to_fault_config()
        return web.json_response(settings.model_dump())


def _fault_fields(faults: FaultConfig) -> dict[str, Any]:
    return {name: getattr(faults, name) for name in FaultConfig.__slots__}


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read() or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise web.HTTPBadRequest(
            text=json.dumps(error_body("The request body is not valid JSON.", status=400)),
            content_type="application/json",
        ) from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(
            text=json.dumps(error_body("The request body must be a JSON object.", status=400)),
            content_type="application/json",
        )
    return body
