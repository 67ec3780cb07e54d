"""A hypothesis fuzz of every route the proxy serves: 0 × 5xx, the proxy still serving, earlier data intact.

Two real proxies (``create_app``, uvicorn on loopback, SQLite files) are fuzzed with one stream of requests:

* passthrough, in front of ``MockOpenAI`` (a loopback vLLM-style upstream) behind a strict gate that answers 400 to
  a request body vLLM would refuse (so the upstream stays well-behaved: any 5xx is the proxy's own);
* token mode, over the real ``EmbeddedEngine`` serving a small random Qwen3 (the project's tokenizer and template).

Routes are read from the apps themselves (starlette routes, mounts, the store API, the LLM fast paths and the
Responses/Messages surfaces), so a route added later is fuzzed too. Each request draws a route, a method (mostly
the route's own), path parameters (real ids, garbage, huge numbers), query parameters (huge/negative ints, text),
an auth form (admin key, a live attempt token, wrong case, no scheme, Basic, garbage), odd headers, and a body:
malformed JSON, JSON of the wrong type, or the route's own fields with wrong types and out-of-range numbers.

Every answer must be below 500, and a 4xx must be a JSON error object (the OpenAI shape). Before the fuzz a rollout
is recorded through each proxy (two calls, a reward, finish); after it, that rollout reads back identical, and a
fresh session's call is answered and recorded with exact ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy
from lightning_sdk.proxy.sampling import SplitSampling
from lightning_sdk.proxy.token_mode import TokenModeBackend, TokenModeConfig
from lightning_sdk.tokens import ChatRenderer
from tests.support.mock_openai import MockOpenAI, encode, render_prompt
from tests.support.proxy import ADMIN_KEY, ProxyHandle, run_proxy
from tests.support.servers import run_server
from tests.trainer.tiny import corpus

N_REQUESTS = 1200  # examples of the full fuzz; each sends one request (plus the route sweep and the checks)
# FUZZ_COLLECT=1: list every failing request at the end instead of stopping at the first (for triage)
COLLECT: list[str] | None = [] if os.environ.get("FUZZ_COLLECT") else None


class StrictUpstream(MockOpenAI):
    """``MockOpenAI`` behind a gate that answers 400 (as vLLM's request validation does) to bodies it would refuse."""

    def __init__(self) -> None:
        super().__init__(record_requests=False)
        chat = self.app.router.routes[0]
        assert isinstance(chat, Route) and chat.path == "/v1/chat/completions"
        inner = chat.endpoint

        async def gated(request: Request) -> Response:
            try:
                body = json.loads(await request.body())
                problem = _vllm_would_refuse(body)
            except ValueError:
                problem = "body is not JSON"
            if problem:
                err = {"message": problem, "type": "BadRequestError", "param": None, "code": 400}
                return JSONResponse({"error": err}, status_code=400)
            return await inner(request)

        self.app.router.routes[0] = Route("/v1/chat/completions", gated, methods=["POST"])


def _vllm_would_refuse(body: Any) -> str | None:
    if not isinstance(body, dict):
        return "body must be an object"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "each message needs a string role"
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            return "content must be a string or a list of parts"
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            return "content parts must be objects"
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            return "tool_calls must be a list"
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 20):
            return f"{key} must be a positive integer"
    return None


# -- the stacks ------------------------------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    px: ProxyHandle
    routes: list[tuple[str, str]]  # (method, path template)
    earlier_rollout: str
    earlier: dict[str, Any]
    ids: dict[str, list[str]]  # path-parameter name (and "token": running sessions' tokens) -> real values


def _routes(app: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []

    def walk(routes: list[Any], prefix: str) -> None:
        for r in routes:
            if isinstance(r, Mount):
                walk(list(r.routes), prefix + r.path)
            elif isinstance(r, Route):
                out.extend((m, prefix + r.path) for m in sorted(r.methods or {"GET"}) if m != "HEAD")

    walk(list(app.starlette.routes), "")
    for path in app.llm:  # the LLM routes (POST): the app's routing table
        out += [("POST", path), ("POST", "/t/{token}" + path)]
    return sorted(set(out))


def _record_earlier(px: ProxyHandle) -> tuple[str, dict[str, Any]]:
    s = px.session({"q": "before the fuzz"})
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    for q in ("one", "two"):
        r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": q}], max_tokens=8)
        assert r.choices[0].message is not None
    assert px.reward(s["token"], 0.5).status_code == 200
    assert px.finish(s["token"]).status_code == 200
    detail = px.rollout(s["rollout_id"])
    assert detail["status"] == "succeeded" and len(detail["attempts"][0]["calls"]) == 2
    return s["rollout_id"], detail


def _target(name: str, px: ProxyHandle) -> Target:
    rollout_id, detail = _record_earlier(px)
    live = [px.session({"q": f"live {i}"}) for i in range(4)]  # a fuzzed /finish may end one of them
    attempt = detail["attempts"][0]
    ids = {
        "rollout_id": [rollout_id, live[0]["rollout_id"]],
        "attempt_id": [attempt["attempt_id"], live[0]["attempt_id"]],
        "token": [s["token"] for s in live],
        "key": ["fuzz/key", "a"],
    }
    return Target(name, px, _routes(px.app), rollout_id, detail, ids)


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Target]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    config = TinyPolicyConfig(
        vocab_size=400, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=4096
    )
    engine = EmbeddedEngine.from_pretrained(build_policy(tmp / "policy", corpus(), config), max_batch_size=8)
    short = TokenModeConfig(default_max_tokens=8, sampling=SplitSampling({"*": {"max_tokens": 8}}))  # random text
    backend = TokenModeBackend(engine, ChatRenderer(engine.tokenizer), config=short)
    upstream = StrictUpstream()
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(run_server(upstream.app))
        passthrough = stack.enter_context(run_proxy(up.url + "/v1", store_path=tmp / "passthrough.db"))
        token = stack.enter_context(run_proxy(policy_backend=backend, store_path=tmp / "token.db"))
        yield [_target("passthrough", passthrough), _target("token", token)]
    import asyncio

    asyncio.run(engine.close())


# -- the strategies --------------------------------------------------------------------------------------------------
HUGE = [2**31, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 10**30, -1, -(2**63) - 1, 0]
ints = st.one_of(st.integers(-5, 5), st.sampled_from(HUGE), st.integers())
scalars = st.one_of(
    st.none(), st.booleans(), ints, st.floats(allow_nan=False), st.text(max_size=20), st.sampled_from(["", "x" * 5000])
)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
)

# The fields each route family reads, with values of the right type or not.
ROLES = st.one_of(
    st.sampled_from(["user", "system", "assistant", "tool", "developer", "function", "bogus", ""]),
    st.sampled_from([["user"], {"role": "user"}, 1, 2**64, None, True, 1.5]),
    json_values,
)
message = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": st.one_of(st.text(max_size=30), json_values, st.just([{"type": "text", "text": "hi"}])),
        "tool_calls": json_values,
        "tool_call_id": json_values,
        "name": json_values,
    },
)
chat_fields = {
    "model": st.one_of(st.just("policy"), st.just("policy"), st.just("policy"), json_values),
    "messages": st.one_of(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=3), json_values),
    "max_tokens": ints,
    "max_completion_tokens": ints,
    "temperature": st.one_of(st.floats(allow_nan=False), ints, json_values),
    "top_p": st.one_of(st.floats(allow_nan=False), json_values),
    "seed": ints,
    "n": ints,
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": json_values,
    "tools": json_values,
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), json_values),
    "response_format": json_values,
    "logprobs": json_values,
    "top_logprobs": ints,
    "stop": json_values,
    "prompt": json_values,
    "input": json_values,  # Responses API
    "system": json_values,  # Messages API
}
lightning_fields = {
    "value": st.one_of(st.floats(allow_nan=False), ints, json_values),
    "name": json_values,
    "call_id": json_values,
    "status": st.one_of(st.sampled_from(["succeeded", "failed", "running", ""]), json_values),
    "error": json_values,
    "task": json_values,
    "group": json_values,
    "split": json_values,
}
store_fields = {
    k: st.one_of(ints, json_values)
    for k in (
        "n", "tasks", "group", "split", "max_attempts", "seq", "version", "limit", "step", "group_ids", "worker",
        "lease_s", "token", "calls", "rewards", "value", "status", "policy_version", "name", "base_url", "kind",
    )
}  # fmt: skip


def _objects(fields: dict[str, st.SearchStrategy[Any]], must: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    """Objects with some of ``fields`` (right or wrong types), always with the ``must`` ones."""
    return st.dictionaries(st.sampled_from(sorted(fields)), st.none(), max_size=6).flatmap(
        lambda d: st.fixed_dictionaries({k: fields[k] for k in {*d, *must}})
    )


FAMILY_BODIES: dict[str, st.SearchStrategy[Any]] = {
    "llm": st.one_of(_objects(chat_fields, ("model", "messages")), _objects(chat_fields, ("model",))),
    "attempt": _objects(lightning_fields),
    "admin": _objects(lightning_fields),
    "store": _objects(store_fields),
    "open": _objects({**chat_fields, **lightning_fields}),
}
generic_bodies = st.one_of(
    st.none(),  # no body
    st.builds(lambda o: json.dumps(o).encode(), json_values),  # valid JSON of any type
    st.binary(max_size=64),  # not JSON (or not UTF-8)
    st.sampled_from([b"{", b'{"messages": [', b"[1,2,3]", b'"x"', b"null", b"1e999", b'{"a":NaN}', b"\xff\xfe{}"]),
    st.sampled_from([b'{"messages": [{"role": ["user"], "content": "hi"}]}', b'{"value": 1e400}']),
)
AUTH = ["admin", "admin-lower", "admin-upper", "admin-noscheme", "token", "token-in-key", "basic", "wrong", "none"]
RIGHT_AUTH = {"llm": "token", "attempt": "token", "admin": "admin", "store": "admin", "open": "token"}


def family(path: str) -> str:
    if path.startswith("/lightning/v1/store"):
        return "store"
    if any(p in path for p in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")):
        return "llm"
    if path.endswith(("/reward", "/finish")):
        return "attempt"
    if path.startswith("/lightning/v1/sessions") or path.startswith("/lightning/v1/rollouts"):
        return "admin"
    return "open"


def _json(o: Any) -> bytes:
    return json.dumps(o).encode()


@st.composite
def requests(draw: st.DrawFn, routes: list[tuple[str, str]]) -> dict[str, Any]:
    fam = draw(st.sampled_from(["llm"] * 8 + ["store"] * 5 + ["admin"] * 3 + ["attempt"] * 2 + ["open"] * 2))
    choices = [i for i, (_, path) in enumerate(routes) if family(path) == fam] or list(range(len(routes)))
    route_i = draw(st.sampled_from(choices))
    fam = family(routes[route_i][1])
    right = draw(st.integers(0, 9)) < 7  # mostly the route's own credential and fields: get past auth and parsing
    return {
        "target": draw(st.integers(0, 1)),
        "route_i": route_i,
        "method_roll": draw(st.integers(0, 14)),
        "other_method": draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"])),
        "param_choice": draw(st.integers(0, 9)),
        "param_text": draw(st.text(min_size=0, max_size=12)),
        "query": draw(
            st.dictionaries(
                st.sampled_from(["limit", "after", "status", "split", "x", "stream"]),
                st.one_of(ints.map(str), st.text(max_size=10)),
                max_size=3,
            )
        ),
        "auth": RIGHT_AUTH[fam] if right else draw(st.sampled_from(AUTH)),
        "content_type": draw(
            st.sampled_from(["application/json"] * 4 + ["text/plain", "application/x-www-form-urlencoded", "", "a/;;"])
        ),
        "odd_header": draw(
            st.sampled_from(
                [None] * 4
                + [
                    ("Content-Encoding", "gzip"),
                    ("X-Lightning-Call-Id", "nope"),
                    ("Accept", "text/event-stream"),
                    ("Authorization2", "Bearer x"),
                    ("X-Api-Key", "sk-x"),
                    ("X-Lightning-Attempt", "a\tb"),
                ]
            )
        ),
        "body": draw(FAMILY_BODIES[fam].map(_json) if right else generic_bodies),
    }


def _fill(path: str, params: dict[str, list[str]], choice: int, text: str) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        real = params.get(name) or ["x"]
        options = [*real, urllib.parse.quote(text, safe="") or "x", str(2**64), "-1", "..", "%00"]
        return options[choice % len(options)]

    return re.sub(r"\{(\w+)(?::\w+)?\}", sub, path)


def _headers(target: Target, req: dict[str, Any]) -> dict[str, str]:
    tokens = target.ids["token"]
    token = tokens[req["param_choice"] % len(tokens)]
    auth = {
        "admin": f"Bearer {ADMIN_KEY}",
        "admin-lower": f"bearer {ADMIN_KEY}",
        "admin-upper": f"BEARER {ADMIN_KEY}",
        "admin-noscheme": ADMIN_KEY,
        "token": f"Bearer {token}",
        "token-in-key": f"Bearer  {token}",
        "basic": "Basic dXNlcjpwYXNz",
        "wrong": "Bearer lsk-wrong",
        "none": None,
    }[req["auth"]]
    headers: dict[str, str] = {}
    if auth is not None:
        headers["Authorization"] = auth
    if req["content_type"]:
        headers["Content-Type"] = req["content_type"]
    if req["odd_header"] is not None:
        headers[req["odd_header"][0]] = req["odd_header"][1]
    return headers


@dataclass
class Tally:
    sent: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    routes: set[tuple[str, str]] = field(default_factory=set)


def _send(target: Target, req: dict[str, Any], tally: Tally) -> httpx.Response:
    method, template = target.routes[req["route_i"]]
    if req["method_roll"] == 0:
        method = req["other_method"]
    path = _fill(template, target.ids, req["param_choice"], req["param_text"])
    r = target.px.http.request(
        method, path, params=req["query"], headers=_headers(target, req), content=req["body"], timeout=60.0
    )
    tally.sent += 1
    tally.by_status[r.status_code] = tally.by_status.get(r.status_code, 0) + 1
    tally.routes.add((target.name, template))
    return r


def _check(r: httpx.Response, method: str, url: str) -> None:
    where = f"{method} {url} -> {r.status_code}: {r.text[:300]}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        assert r.headers.get("content-type", "").startswith("application/json"), where
        body = r.json()
        assert isinstance(body, dict) and "error" in body, where
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "[DONE]" in r.text or '"error"' in r.text or "event:" in r.text, where


@pytest.mark.slow
def test_fuzz_every_route(targets: list[Target]) -> None:
    """The acceptance fuzz: every route once, then 1,200 random requests (about 80 s on 2 busy cores: ``slow``)."""
    _fuzz(targets, N_REQUESTS)


def test_fuzz_every_route_quick(targets: list[Target]) -> None:
    """The same fuzz, shorter, in the default suite: every route once, then 250 random requests."""
    _fuzz(targets, 250)


def _fuzz(targets: list[Target], n_requests: int) -> None:
    tally = Tally()
    routes = targets[0].routes
    assert all(t.routes == routes for t in targets)

    @settings(
        max_examples=n_requests,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests(routes))
    def fuzz(req: dict[str, Any]) -> None:
        target = targets[req["target"]]
        r = _send(target, req, tally)
        if COLLECT is not None:
            try:
                _check(r, r.request.method, str(r.request.url))
            except AssertionError as exc:
                COLLECT.append(f"{target.name} {exc}"[:400])
            return
        _check(r, r.request.method, str(r.request.url))

    # every route at least once, with its own credential and a body of the wrong shape, before the random stream
    for target in targets:
        for i, (method, path) in enumerate(routes):
            fam = family(path)
            req = {"target": 0, "route_i": i, "method_roll": 1, "other_method": method, "param_choice": 0}
            req |= {"param_text": "", "query": {}, "auth": RIGHT_AUTH[fam], "content_type": "application/json"}
            req |= {"odd_header": None, "body": b'{"messages": 1, "value": "x", "n": -1}' if method != "GET" else None}
            r = _send(target, req, tally)
            _check(r, method, str(r.request.url))
    fuzz()
    if COLLECT is not None:
        print("\n".join(sorted(set(COLLECT))))
    every = {(t.name, path) for t in targets for _, path in t.routes}
    assert tally.sent >= n_requests + len(every), tally
    assert tally.routes == every, sorted(every - tally.routes)
    print(f"fuzz: {tally.sent} requests, statuses {dict(sorted(tally.by_status.items()))}")

    for target in targets:
        # earlier data intact
        assert target.px.rollout(target.earlier_rollout) == target.earlier, f"{target.name}: earlier rollout changed"
        # still serving: a new session's call is answered and recorded with exact ids
        s = target.px.session({"q": "after the fuzz"})
        client = openai.OpenAI(base_url=target.px.url + "/v1", api_key=s["token"], max_retries=0)
        messages = [{"role": "user", "content": "still there?"}]
        resp = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)  # type: ignore[arg-type]
        assert resp.choices[0].finish_reason in ("stop", "length")
        done = target.px.finish(s["token"])
        assert done.status_code == 200 and done.json()["calls"] == 1, done.text
        call = target.px.calls(s["rollout_id"])[0]
        assert call["error"] is None and call["completion_ids"] and len(call["logprobs"]) == len(call["completion_ids"])
        if target.name == "passthrough":
            assert call["prompt_ids"] == encode(render_prompt(messages))
        health = target.px.http.get("/lightning/v1/health")
        assert health.status_code == 200, health.text
