"""Round 2, finding 5: FailOpen with the EPP down sent split names unrewritten, and the model
server answered 404 (`food-review`, split over `food-review-v1`/`-v2`). Now Envoy holds the
split's first target for each such name and rewrites the body's `model` on the FailOpen route.
Real Envoy with our bootstrap, no EPP listening, echo backends that report what they got."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from poolkeeper.envoy.endpoints_file import EndpointsFile
from poolkeeper.envoy.failopen import fail_open_rewrite
from poolkeeper.netutil import free_port
from tests.envoy.envoy_harness import Backend, rig_params, running_envoy

pytestmark = pytest.mark.integration

TABLE = (("food-review", "food-review-v1"), ("chat", "chat-2"))


async def test_split_names_are_rewritten_to_their_first_target_with_the_epp_down(
    tmp_path: Path,
) -> None:
    backends = [Backend("a"), Backend("b")]
    for b in backends:
        await b.start()
    endpoints = EndpointsFile(tmp_path / "endpoints.json")
    endpoints.write(b.hostport for b in backends)
    params = rig_params(
        backends, free_port(), endpoints.path, fail_open=True, fail_open_targets=TABLE
    )
    url = f"http://127.0.0.1:{params.listen_port}/v1/chat/completions"
    try:
        async with (
            running_envoy(params, tmp_path, epp_up=False),
            aiohttp.ClientSession() as session,
        ):
            cases: list[tuple[dict[str, object], str]] = [
                ({"model": "food-review", "messages": []}, "food-review-v1"),
                (
                    {"messages": [{"role": "user", "content": "x" * 5000}], "model": "chat"},
                    "chat-2",
                ),
                ({"model": "food-review-v2", "messages": []}, "food-review-v2"),  # a target
                ({"model": "other", "messages": []}, "other"),
            ]
            for body, expected in cases:
                async with session.post(url, data=json.dumps(body)) as resp:
                    reply = await resp.json(content_type=None)
                    assert resp.status == 200, reply
                    assert reply["model"] == expected
                    # The server read the whole rewritten body: its length was updated.
                    assert reply["received_bytes"] == len(json.dumps({**body, "model": expected}))
    finally:
        for b in backends:
            await b.stop()


def test_the_table_holds_only_plain_names() -> None:
    with pytest.raises(ValueError, match="unexpected characters"):
        fail_open_rewrite((('a"] = os.exit() --', "b"),))
