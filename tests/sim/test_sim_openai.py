"""The simulator over real sockets, driven by the official openai client."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from openai.types.chat import ChatCompletionMessageParam

from poolkeeper.sim.admin import openai_http_errors
from poolkeeper.sim.cluster import Listening, SimCluster
from poolkeeper.sim.params import DEFAULT_MODEL
from poolkeeper.tokens import count_tokens

pytestmark = pytest.mark.integration

StartCluster = Callable[..., Awaitable[tuple[SimCluster, list[Listening]]]]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


async def test_completions_non_streaming(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1)
    async with client(where.url) as api:
        raw = await api.completions.with_raw_response.create(
            model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=7
        )
        completion = raw.parse()
    assert raw.headers["x-sim-server"] == "sim-0"
    assert raw.headers["x-sim-server-port"] == str(where.port)
    assert completion.model == DEFAULT_MODEL
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == count_tokens("The capital of France is")
    assert completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 7
    assert count_tokens(completion.choices[0].text) == 7


async def test_completions_streaming_with_usage(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1)
    async with client(where.url) as api:
        stream = await api.completions.create(
            model=DEFAULT_MODEL,
            prompt="Once upon a time",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


async def test_chat_non_streaming_and_streaming(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1, lora_adapters=["sql-lora"])
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    async with client(where.url) as api:
        chat = await api.chat.completions.create(
            model="sql-lora", messages=messages, max_completion_tokens=5
        )
        assert chat.model == "sql-lora"
        assert chat.choices[0].message.role == "assistant"
        assert count_tokens(chat.choices[0].message.content or "") == 5
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 5
        stream = await api.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert count_tokens(content) == 6
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]


async def test_repeated_prompt_reports_cached_tokens(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1)
    prompt = "A long shared system prompt. " * 40
    async with client(where.url) as api:
        first = await api.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=2)
        second = await api.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=2)
    assert first.usage is not None
    assert second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 256


async def test_unknown_model_gets_vllm_404(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1)
    async with client(where.url) as api:
        with pytest.raises(openai.NotFoundError) as info:
            await api.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert info.value.status_code == 404
    assert info.value.body == {
        "message": "The model `no-such-model` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_bad_bodies_get_400(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1, num_gpu_blocks=10)
    async with aiohttp.ClientSession() as http:
        for body, needle in (
            (b"not json", "not valid JSON"),
            (b'{"prompt": "x"}', "'model' is required"),
            (b'{"model": "%s", "prompt": "x", "max_tokens": 1000}' % DEFAULT_MODEL.encode(),
             "maximum context length"),
            (b'{"model": "%s", "prompt": 5}' % DEFAULT_MODEL.encode(), "'prompt' must be"),
        ):  # fmt: skip
            async with http.post(f"{where.url}/v1/completions", data=body) as response:
                assert response.status == 400
                payload = await response.json()
                assert needle in payload["error"]["message"]
                assert response.headers["x-sim-server"] == "sim-0"


async def test_unserved_paths_and_methods_get_openai_errors(sim_cluster: StartCluster) -> None:
    """A path or method the simulator does not serve (embeddings, responses, a trailing slash
    the gateway lets through) is answered in OpenAI's error shape, as vLLM's handler does, not
    aiohttp's text/plain "404: Not Found" (the gateway passes it to the client as it came)."""
    _, (where,) = await sim_cluster(1)
    async with client(where.url) as api:
        with pytest.raises(openai.NotFoundError) as info:
            await api.embeddings.create(model=DEFAULT_MODEL, input="x")
    assert info.value.body == {
        "message": "Not Found",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    async with aiohttp.ClientSession() as http:
        for method, path, status in (
            ("POST", "/v1/responses", 404),
            ("GET", "/v1/models/", 404),
            ("GET", "/v1/chat/completions", 405),
        ):
            async with http.request(method, f"{where.url}{path}") as response:
                assert response.status == status
                assert response.content_type == "application/json"
                payload = await response.json()
                assert payload["error"]["code"] == status
                assert response.headers["x-sim-server"] == "sim-0"
        async with http.get(f"{where.url}/v1/chat/completions") as response:
            assert response.headers["allow"] == "POST"


async def test_handlers_own_json_errors_keep_their_message(sim_cluster: StartCluster) -> None:
    """A handler's error already in OpenAI's shape (a body that is no JSON object) passes the
    error middleware as it was raised, not rebuilt from its reason ("Bad Request")."""
    _, (where,) = await sim_cluster(1)
    async with aiohttp.ClientSession() as http:
        for path, body, needle in (
            ("/v1/load_lora_adapter", b"{x", "not valid JSON"),
            ("/v1/unload_lora_adapter", b"[1]", "must be a JSON object"),
            ("/sim/faults", b"{x", "not valid JSON"),
        ):
            async with http.post(f"{where.url}{path}", data=body) as response:
                assert response.status == 400
                payload = await response.json()
                assert needle in payload["error"]["message"]
                assert payload["error"]["code"] == 400
                assert response.headers["x-sim-server"] == "sim-0"


async def test_error_middleware_keeps_the_detail_and_headers() -> None:
    """aiohttp's 413 says how large a body may be; a handler's plain-text error keeps its text
    and its headers (Retry-After here); only the default "429: Too Many Requests" text becomes
    the bare reason."""

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def busy(request: web.Request) -> web.Response:
        raise web.HTTPTooManyRequests(headers={"Retry-After": "3"})

    async def detailed(request: web.Request) -> web.Response:
        raise web.HTTPServiceUnavailable(text="draining", headers={"X-Why": "drain"})

    app = web.Application(client_max_size=16, middlewares=[openai_http_errors])
    app.router.add_post("/echo", echo)
    app.router.add_get("/busy", busy)
    app.router.add_get("/detailed", detailed)
    async with TestClient(TestServer(app)) as http:
        response = await http.post("/echo", data=b"x" * 64)
        assert response.status == 413
        assert response.content_type == "application/json"
        message = (await response.json())["error"]["message"]
        assert "Maximum request body size 16 exceeded" in message
        response = await http.get("/busy")
        assert response.status == 429
        assert (await response.json())["error"]["message"] == "Too Many Requests"
        assert response.headers["Retry-After"] == "3"
        response = await http.get("/detailed")
        assert (await response.json())["error"]["message"] == "draining"
        assert response.headers["X-Why"] == "drain"
        assert response.content_type == "application/json"


async def test_models_and_runtime_lora_loading(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1, lora_adapters=["a"])
    async with client(where.url) as api, aiohttp.ClientSession() as http:
        models = await api.models.list()
        assert [(m.id, getattr(m, "parent", None)) for m in models.data] == [
            (DEFAULT_MODEL, None),
            ("a", DEFAULT_MODEL),
        ]
        url = f"{where.url}/v1/load_lora_adapter"
        body = {"lora_name": "b", "lora_path": "/adapters/b"}
        async with http.post(url, json=body) as response:
            assert response.status == 200
        async with http.post(url, json=body) as response:
            assert response.status == 400
        completion = await api.completions.create(model="b", prompt="x", max_tokens=1)
        assert completion.model == "b"
        unload = f"{where.url}/v1/unload_lora_adapter"
        async with http.post(unload, json={"lora_name": "b"}) as response:
            assert response.status == 200
        async with http.post(unload, json={"lora_name": "b"}) as response:
            assert response.status == 404
        assert [m.id for m in (await api.models.list()).data] == [DEFAULT_MODEL, "a"]
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="b", prompt="x", max_tokens=1)


async def test_router_registration_endpoints(sim_cluster: StartCluster) -> None:
    _, (where,) = await sim_cluster(1, max_num_seqs=64)
    async with aiohttp.ClientSession() as http:
        for path in ("/server_info", "/get_server_info"):
            async with http.get(where.url + path) as response:
                info = await response.json()
                assert info["model_path"] == DEFAULT_MODEL
                assert info["max_num_seqs"] == 64
        for path in ("/model_info", "/get_model_info"):
            async with http.get(where.url + path) as response:
                assert (await response.json())["is_generation"] is True
        async with http.get(where.url + "/get_load") as response:
            assert (await response.json())[0]["num_reqs"] == 0
        async with http.get(where.url + "/health") as response:
            assert response.status == 200
        async with http.get(where.url + "/tokenize") as response:
            assert response.status == 404
