"""One logical call, one record: the agent's ``Idempotency-Key``.

- ``LLM``'s OpenAI clients send an ``Idempotency-Key`` on every call and the same one on the SDK's own retries (the
  real ``openai`` SDK against a loopback server that answers 500 first and records the headers it got);
- the real proxy (SQLite store file) records a call made twice with one key once: the second's record (the answer
  the agent used) in the first's place, under the same call id; the finish counts it once; a call without a key and
  the attempt's other calls are untouched;
- a key that is empty or too long is refused with 400 naming ``Idempotency-Key``.
The many-proxies case (a proxy SIGKILLed after it committed the call) is tests/proxy/test_many_proxies.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lightning_sdk.agent import LLM
from tests.support.mock_openai import MockOpenAI
from tests.support.proxy import ProxyHandle
from tests.support.servers import run_server


def _answer(content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "policy",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
    }


def test_llm_clients_send_one_key_per_call_and_the_same_on_the_sdks_retries() -> None:
    seen: list[str | None] = []

    async def chat(request: Request) -> JSONResponse:
        seen.append(request.headers.get("idempotency-key"))
        if len(seen) in (1, 3):  # the first try of each call fails: the SDK retries it
            return JSONResponse({"error": {"message": "busy", "type": "server_error"}}, status_code=500)
        return JSONResponse(_answer(f"answer {len(seen)}"))

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    with run_server(app) as server:
        llm = LLM(base_url=server.url + "/v1", api_key="k")

        async def two_calls() -> list[str]:
            client = llm.async_openai_client(max_retries=1)
            try:
                out = []
                for _ in range(2):
                    r = await client.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": "q"}]
                    )
                    out.append(r.choices[0].message.content or "")
                return out
            finally:
                await client.close()

        assert asyncio.run(two_calls()) == ["answer 2", "answer 4"]
        sync = llm.openai_client(max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "q"}]
        )
        assert sync.choices[0].message.content == "answer 5"
    assert len(seen) == 5 and all(seen)
    assert seen[0] == seen[1] and seen[2] == seen[3]  # a retry carries its call's key
    assert len({seen[0], seen[2], seen[4]}) == 3  # each logical call its own


def test_a_call_made_again_with_its_key_is_recorded_once_in_its_place(px: ProxyHandle, mock: MockOpenAI) -> None:
    s = px.session({"q": 1})
    auth = {"Authorization": f"Bearer {s['token']}"}

    def call(content: str, key: str | None) -> httpx.Response:
        headers = {**auth, **({"Idempotency-Key": key} if key else {})}
        body = {"model": "policy", "messages": [{"role": "user", "content": content}]}
        r = px.http.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r

    first = call("first try", "key-1")
    plain = call("no key", None)
    again = call("second try", "key-1")  # the agent never got the first answer: it asked again
    other = call("another call", "key-2")
    assert again.headers["x-lightning-call-id"] == first.headers["x-lightning-call-id"]
    done = px.finish(s["token"]).json()
    assert done["calls"] == 3
    calls = px.rollout(s["rollout_id"])["attempts"][0]["calls"]
    assert [(c["call_id"], c["seq"]) for c in calls] == [
        (first.headers["x-lightning-call-id"], 0),
        (plain.headers["x-lightning-call-id"], 1),
        (other.headers["x-lightning-call-id"], 3),
    ]
    resent = calls[0]
    assert resent["request"]["messages"][0]["content"] == "second try"  # the answer the agent used
    assert resent["response"]["choices"][0]["message"] == again.json()["choices"][0]["message"]
    reply = mock.reply_for({"messages": [{"role": "user", "content": "second try"}]})
    prompt, completion, logprobs, _ = mock.expected_ids([{"role": "user", "content": "second try"}], reply)
    assert (resent["prompt_ids"], resent["completion_ids"], resent["logprobs"]) == (prompt, completion, logprobs)


def test_a_bad_idempotency_key_is_refused_with_its_param(px: ProxyHandle) -> None:
    s = px.session({"q": 1})
    for key in ("", "k" * 256):
        r = px.http.post(
            "/v1/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": "q"}]},
            headers={"Authorization": f"Bearer {s['token']}", "Idempotency-Key": key},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "Idempotency-Key", r.text
