"""Real-time simulator servers: one aiohttp app per simulated vLLM server, all in one event loop.

`SimServer` is one server's app over its EngineModel; `sim/cluster.py` `SimCluster` starts one
per ServerSpec on its own port and drives them all from one RealtimeDriver. Endpoints:

    POST /v1/completions, /v1/chat/completions   (JSON or SSE; usage, finish_reason, [DONE])
    GET  /v1/models, /health, /metrics           (vLLM names, see sim/metrics_text.py)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    GET  /server_info, /get_server_info, /model_info, /get_model_info, /get_load
         (what sglang-router and vllm-router call when registering a worker)
    GET  /sim/stats   counters and model-time latency sums (for benchmarks)
    GET|POST /sim/faults   read or replace the standing faults (body: FaultSettings JSON)

With `SimCluster`'s `kv_events_port_offset`, each server also publishes its KV-cache events as
vLLM does (`sim/kvpublish.py`) on a ZMQ PUB socket at its HTTP port plus the offset.

Every response carries `x-sim-server: <name>` and `x-sim-server-port: <port>`; the JSON `model`
field is the model the request named. Faults: see sim/faults.py.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field

from aiohttp import web

from poolkeeper.sim.admin import AdminEndpoints, json_error, openai_http_errors
from poolkeeper.sim.config import ServerSpec
from poolkeeper.sim.direct_stream import DirectStream, event_boundary, usage_of
from poolkeeper.sim.driver import RealtimeDriver, TokenWaiter
from poolkeeper.sim.engine import EngineModel, InvalidRequestError, UnknownModelError
from poolkeeper.sim.faults import (
    FAULT_HEADER,
    FaultConfig,
    FaultSpecError,
    RequestFaults,
    decide_faults,
)
from poolkeeper.sim.metrics_text import LoraInfoSeries
from poolkeeper.sim.openai_format import (
    BadRequestBody,
    ChunkWriter,
    full_response,
    parse_request,
)
from poolkeeper.sim.textgen import stream_seed, text_between

SERVER_HEADER = "x-sim-server"
PORT_HEADER = "x-sim-server-port"


@dataclass(slots=True)
class SimServer(AdminEndpoints):
    """One simulated model server: its engine, faults and HTTP handlers."""

    index: int
    spec: ServerSpec
    engine: EngineModel
    driver: RealtimeDriver
    port: int = 0
    faults: FaultConfig = field(default_factory=FaultConfig)
    lora_series: LoraInfoSeries = field(default_factory=LoraInfoSeries)
    rng: random.Random = field(default_factory=random.Random)
    ids: itertools.count[int] = field(default_factory=itertools.count)
    started: int = field(default_factory=lambda: int(time.time()))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[openai_http_errors])
        app.on_response_prepare.append(self._stamp)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.post("/v1/load_lora_adapter", self.load_lora),
                web.post("/v1/unload_lora_adapter", self.unload_lora),
                web.get("/server_info", self.server_info),
                web.get("/get_server_info", self.server_info),
                web.get("/model_info", self.model_info),
                web.get("/get_model_info", self.model_info),
                web.get("/get_load", self.get_load),
                web.get("/sim/stats", self.sim_stats),
                web.get("/sim/faults", self.get_faults),
                web.post("/sim/faults", self.set_faults),
            ]
        )
        return app

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[SERVER_HEADER] = self.name
        response.headers[PORT_HEADER] = str(self.port)

    # -- inference ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=True)

    async def _infer(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            faults = decide_faults(self.faults, http.headers.get(FAULT_HEADER), self.rng)
        except FaultSpecError as exc:
            return json_error(str(exc), 400)
        if faults.status is not None:
            return json_error(f"Injected fault: HTTP {faults.status}.", faults.status)
        if faults.latency_s:
            await asyncio.sleep(faults.latency_s)
        try:
            parsed = parse_request(await http.read(), chat=chat)
        except BadRequestBody as exc:
            return json_error(str(exc), 400)
        engine = self.engine
        request_id = f"{self.name}-{next(self.ids)}"
        try:
            sim_request = engine.create_request(
                request_id,
                parsed.model,
                parsed.prompt,
                arrival=self.driver.now(),
                max_tokens=parsed.max_tokens,
                prompt_tokens=parsed.prompt_tokens,
            )
        except UnknownModelError as exc:
            return json_error(str(exc), 404, "model")
        except InvalidRequestError as exc:
            return json_error(str(exc), 400)
        waiter = TokenWaiter(sim_request, stream=parsed.stream)
        self.driver.submit(self.index, sim_request, waiter)
        response_id = ("chatcmpl-" if chat else "cmpl-") + request_id
        created = int(time.time())
        try:
            if faults.stall_s:
                await asyncio.sleep(faults.stall_s)
            if parsed.stream:
                writer = ChunkWriter(
                    chat=chat,
                    response_id=response_id,
                    created=created,
                    model=parsed.model,
                    include_usage=parsed.include_usage,
                )
                return await self._stream(http, waiter, writer, faults)
            while not sim_request.done:
                try:
                    async with asyncio.timeout(0.5):
                        await waiter.wait()
                except TimeoutError:
                    transport = http.transport
                    if transport is None or transport.is_closing():
                        # The client left (vLLM aborts such requests too); `finally` cancels.
                        return web.Response(status=499)
            if faults.cut_after is not None:
                _cut(http)
                return web.Response(status=500)
            seed = stream_seed(engine.config.seed, request_id)
            body = full_response(
                chat=chat,
                response_id=response_id,
                created=created,
                model=parsed.model,
                text=text_between(seed, 0, sim_request.output_tokens),
                finish_reason=sim_request.finish_reason,
                usage=usage_of(sim_request),
            )
            return web.json_response(body)
        finally:
            if not sim_request.done:
                self.driver.cancel(self.index, request_id)

    async def _stream(
        self,
        http: web.Request,
        waiter: TokenWaiter,
        writer: ChunkWriter,
        faults: RequestFaults,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(http)
        request = waiter.request
        seed = stream_seed(self.engine.config.seed, request.request_id)
        events = 0
        cut_after = faults.cut_after
        # Like vLLM, a chat stream's role chunk goes out with the first token, after prefill
        # (vLLM emits it on the engine's first output), so time to first chunk includes queueing
        # and prefill.
        role_pending = writer.chat
        sent = 0
        direct: DirectStream | None = None
        interval = self.engine.config.stream_interval
        while True:
            if cut_after is not None and events >= cut_after:
                _cut(http)
                return response
            produced = event_boundary(request.output_tokens, request.done, interval)
            if role_pending and (produced > sent or request.done):
                role_pending = False
                events += 1
                await response.write(writer.role().encode())
                continue
            if produced > sent:
                finished = request.done and produced == request.output_tokens
                reason = request.finish_reason if finished else None
                chunk = writer.text(text_between(seed, sent, produced), reason)
                sent = produced
                events += 1
                await response.write(chunk.encode())
                continue
            if request.done:
                break
            transport = http.transport
            if direct is None and events and cut_after is None and transport is not None:
                # Headers and the first event are out: from here on the driver writes each
                # step's tokens straight to the socket, framed as HTTP chunks.
                direct = DirectStream(transport, waiter, writer, seed, sent, interval)
                waiter.pusher = direct.push
            await waiter.wait()
            if direct is not None:
                while not (direct.broken or direct.finished):
                    await waiter.wait()  # only the pusher wakes us now
                if direct.broken:
                    return response  # the client went away; _infer cancels the request
                if direct.finished:
                    await response.write_eof()
                    return response
        tail = ""
        if writer.include_usage:
            tail = writer.usage(usage_of(request))
        await response.write((tail + writer.done()).encode())
        await response.write_eof()
        return response


def _cut(http: web.Request) -> None:
    """Drop the connection mid-response (fault injection)."""
    transport = http.transport
    if transport is not None:
        transport.abort()
