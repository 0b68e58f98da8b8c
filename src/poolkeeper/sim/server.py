"""Real-time simulator servers: one aiohttp app per simulated vLLM server, all in one event loop.

`SimCluster(specs, host, base_port)` builds one EngineModel per ServerSpec, serves each on its own
port (base_port + i; 0 = any free port) and drives them all from one RealtimeDriver. Endpoints:

    POST /v1/completions, /v1/chat/completions   (JSON or SSE; usage, finish_reason, [DONE])
    GET  /v1/models, /health, /metrics           (vLLM names, see sim/metrics_text.py)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    GET  /server_info, /get_server_info, /model_info, /get_model_info, /get_load
         (what sglang-router and vllm-router call when registering a worker)
    GET  /sim/stats   counters and model-time latency sums (for benchmarks)
    GET|POST /sim/faults   read or replace the standing faults (body: FaultSettings JSON)

Every response carries `x-sim-server: <name>` and `x-sim-server-port: <port>`; the JSON `model`
field is the model the request named. Faults: see sim/faults.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from poolkeeper.sim.config import FaultSettings, ServerSpec
from poolkeeper.sim.driver import RealtimeDriver, TokenWaiter
from poolkeeper.sim.engine import EngineModel, InvalidRequestError, SimRequest, UnknownModelError
from poolkeeper.sim.faults import (
    FAULT_HEADER,
    GARBAGE_METRICS,
    FaultConfig,
    FaultSpecError,
    RequestFaults,
    decide_faults,
)
from poolkeeper.sim.metrics_text import LoraInfoSeries, render_metrics
from poolkeeper.sim.openai_format import (
    BadRequestBody,
    ChunkWriter,
    error_body,
    full_response,
    parse_request,
    usage_dict,
)
from poolkeeper.sim.textgen import stream_seed, text_between

SERVER_HEADER = "x-sim-server"
PORT_HEADER = "x-sim-server-port"


def _json_error(message: str, status: int, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status=status, param=param), status=status)


@dataclass(slots=True)
class SimServer:
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

    @property
    def name(self) -> str:
        return self.spec.name

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
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
            return _json_error(str(exc), 400)
        if faults.status is not None:
            return _json_error(f"Injected fault: HTTP {faults.status}.", faults.status)
        if faults.latency_s:
            await asyncio.sleep(faults.latency_s)
        try:
            parsed = parse_request(await http.read(), chat=chat)
        except BadRequestBody as exc:
            return _json_error(str(exc), 400)
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
            return _json_error(str(exc), 404, "model")
        except InvalidRequestError as exc:
            return _json_error(str(exc), 400)
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
                usage=_usage(sim_request),
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
        if writer.chat:
            events += 1
            await response.write(writer.role().encode())
        sent = 0
        direct: _DirectStream | None = None
        while True:
            if cut_after is not None and events >= cut_after:
                _cut(http)
                return response
            produced = request.output_tokens
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
                interval = self.engine.config.stream_interval
                direct = _DirectStream(transport, waiter, writer, seed, sent, interval)
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
            tail = writer.usage(_usage(request))
        await response.write((tail + writer.done()).encode())
        await response.write_eof()
        return response

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
            return _json_error("Both 'lora_name' and 'lora_path' must be provided.", 400)
        if name in self.engine.adapters:
            return _json_error(f"The lora adapter '{name}' has already been loaded.", 400)
        self.engine.register_adapter(name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.engine.adapters:
            return _json_error(f"The lora adapter '{name}' cannot be found.", 404)
        self.engine.unregister_adapter(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # -- observability --------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        mode = self.faults.metrics
        header = request.headers.get(FAULT_HEADER)
        if header:
            try:
                mode = decide_faults(FaultConfig(), header, self.rng).metrics
            except FaultSpecError as exc:
                return _json_error(str(exc), 400)
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
            return _json_error(str(exc).replace("\n", " "), 400)
        self.faults = settings.to_fault_config()
        return web.json_response(settings.model_dump())


class _DirectStream:
    """Writes a stream's tokens from the driver, synchronously, as HTTP/1.1 chunks."""

    __slots__ = (
        "broken", "finished", "interval", "seed", "sent", "transport", "waiter", "writer"
    )  # fmt: skip

    def __init__(
        self,
        transport: asyncio.BaseTransport,
        waiter: TokenWaiter,
        writer: ChunkWriter,
        seed: int,
        sent: int,
        interval: int = 1,
    ) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.interval = interval
        self.transport: asyncio.WriteTransport = transport
        self.waiter = waiter
        self.writer = writer
        self.seed = seed
        self.sent = sent
        self.broken = False
        self.finished = False

    def push(self) -> None:
        if self.broken or self.finished:
            return
        if self.transport.is_closing():
            self.broken = True
            self.waiter.notify()
            return
        request = self.waiter.request
        produced = request.output_tokens
        done = request.done
        if not done and produced - self.sent < self.interval:
            return  # batch tokens per event (--stream-interval); the last one always goes
        text = ""
        if produced > self.sent:
            reason = request.finish_reason if done else None
            text = self.writer.text(text_between(self.seed, self.sent, produced), reason)
            self.sent = produced
        if done:
            if self.writer.include_usage:
                text += self.writer.usage(_usage(request))
            text += self.writer.done()
        if text:
            data = text.encode()
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        if done:
            self.finished = True
            self.waiter.notify()


def _fault_fields(faults: FaultConfig) -> dict[str, Any]:
    return {name: getattr(faults, name) for name in FaultConfig.__slots__}


def _usage(request: SimRequest) -> dict[str, Any]:
    return usage_dict(request.prompt_tokens, request.output_tokens, request.cached_tokens)


def _cut(http: web.Request) -> None:
    """Drop the connection mid-response (fault injection)."""
    transport = http.transport
    if transport is not None:
        transport.abort()


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


@dataclass(frozen=True, slots=True)
class Listening:
    name: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class SimCluster:
    """All simulated servers of one process: start them, find them, stop them."""

    def __init__(self, specs: list[ServerSpec], *, host: str = "127.0.0.1", base_port: int = 0):
        self.host = host
        self.base_port = base_port
        engines = [EngineModel(spec.engine, name=spec.name) for spec in specs]
        self.driver = RealtimeDriver(engines)
        self.servers = [
            SimServer(
                index=i,
                spec=spec,
                engine=engines[i],
                driver=self.driver,
                faults=spec.faults,
                rng=random.Random(f"faults:{spec.engine.seed}:{spec.name}"),
            )
            for i, spec in enumerate(specs)
        ]
        self._runners: list[web.AppRunner] = []
        self._driver_task: asyncio.Task[None] | None = None

    async def start(self) -> list[Listening]:
        self._driver_task = asyncio.create_task(self.driver.run(), name="sim-driver")
        out: list[Listening] = []
        try:
            for server in self.servers:
                port = self.base_port + server.index if self.base_port else 0
                sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((self.host, port))
                except OSError:
                    sock.close()
                    raise
                server.port = sock.getsockname()[1]
                runner = web.AppRunner(
                    server.app(), access_log=None, handle_signals=False, shutdown_timeout=1.0
                )
                try:
                    await runner.setup()
                    self._runners.append(runner)
                    await web.SockSite(runner, sock).start()
                except BaseException:
                    sock.close()
                    raise
                out.append(Listening(server.name, self.host, server.port))
        except BaseException:
            await self.stop()
            raise
        return out

    async def stop(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        self.driver.close()
        if self._driver_task is not None:
            await asyncio.gather(self._driver_task, return_exceptions=True)
            self._driver_task = None
