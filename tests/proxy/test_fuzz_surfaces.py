"""A hypothesis fuzz per API surface, over HTTP only (so it holds across rewrites of the proxy's internals):
``/v1/responses``, ``/v1/messages``, ``/v1/messages/count_tokens``, the session routes and the store routes of a real
proxy (uvicorn on loopback, a SQLite file) in passthrough in front of ``StrictUpstream`` (test_fuzz.py's gated
loopback upstream: a body vLLM would refuse gets 400 there, so any 5xx is the proxy's own).

Each surface gets its own stream of requests: bodies built from that API's fields (right types or not, huge and
negative numbers, nested garbage), raw bytes, chunked bodies (a generator body: ``Transfer-Encoding: chunked``),
header variants (the API's own auth form, wrong keys, ``anthropic-version``, odd content types). Every answer is
below 500 and every refusal is in that API's own error shape (Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` on the Messages routes, OpenAI's ``{"error": {"message", ...}}`` elsewhere). Afterwards, for each
attempt the fuzz used, the store holds no call it cannot explain: its calls without an error are at most the 200
answers that attempt's LLM requests got, and every other recorded call carries its error.

``slow`` sends ``N_SLOW`` requests per surface (600: the slow stage's 3-minute budget on two busy cores;
``FUZZ_SURFACE_N=3000`` for the acceptance count); the default suite ``N_QUICK`` (120).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sdk.proxy.passthrough import PassthroughBackend
from lightning_sdk.proxy.token_mode import RetokenizingBackend
from lightning_sdk.tokens import ChatRenderer
from tests.proxy.test_fuzz import HUGE, StrictUpstream, json_values
from tests.support.proxy import ADMIN_KEY, ProxyHandle, run_proxy
from tests.support.servers import run_server
from tests.support.tokenizers import tokenizer_dir

N_SLOW = int(os.environ.get("FUZZ_SURFACE_N", "600"))  # 3,000 per surface: FUZZ_SURFACE_N=3000 (~4 min each here)
N_QUICK = 120

ints = st.one_of(st.integers(-3, 300), st.sampled_from(HUGE))
texts = st.one_of(st.text(max_size=20), st.sampled_from(["", "hi", "x" * 3000]))


def _objects(fields: dict[str, st.SearchStrategy[Any]], must: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    return st.dictionaries(st.sampled_from(sorted(fields)), st.none(), max_size=7).flatmap(
        lambda d: st.fixed_dictionaries({k: fields[k] for k in {*d, *must}})
    )


def _sometimes(right: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the right kind of value (hypothesis draws small integers most), sometimes anything."""
    return st.integers(0, 7).flatmap(lambda i: json_values if i == 7 else right)


ROLE = _sometimes(st.sampled_from(["user", "user", "assistant", "system", "developer", "tool", "bogus"]))
BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.just("input_text"), "text": texts}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": texts, "name": texts, "input": json_values},
    ),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": texts, "content": json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "bogus"])}),
    json_values,
)
CONTENT = _sometimes(st.one_of(texts, st.lists(BLOCK, max_size=3)))
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": CONTENT}, optional={"type": _sometimes(st.just("message"))})
TOOLS = _sometimes(
    st.lists(
        st.fixed_dictionaries(
            {"name": texts},
            optional={"type": _sometimes(st.just("function")), "input_schema": json_values, "parameters": json_values},
        ),
        max_size=2,
    )
)

MESSAGES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": _sometimes(st.just("policy")),
    "messages": _sometimes(st.lists(MESSAGE, min_size=1, max_size=3)),
    "max_tokens": _sometimes(ints),
    "system": _sometimes(st.one_of(texts, st.lists(BLOCK, max_size=2))),
    "stream": _sometimes(st.booleans()),
    "temperature": _sometimes(st.floats(-2, 5, allow_nan=False)),
    "top_p": _sometimes(st.floats(-1, 2, allow_nan=False)),
    "top_k": _sometimes(ints),
    "stop_sequences": _sometimes(st.lists(texts, max_size=3)),
    "tools": TOOLS,
    "tool_choice": _sometimes(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none", "tool"])})),
    "metadata": json_values,
    "thinking": json_values,
}
COUNT_FIELDS = {k: MESSAGES_FIELDS[k] for k in ("model", "messages", "system", "tools", "tool_choice", "thinking")}
RESPONSES_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": _sometimes(st.just("policy")),
    "input": _sometimes(st.one_of(texts, st.lists(MESSAGE, min_size=1, max_size=3))),
    "instructions": _sometimes(texts),
    "max_output_tokens": _sometimes(ints),
    "temperature": _sometimes(st.floats(-2, 5, allow_nan=False)),
    "top_p": _sometimes(st.floats(-1, 2, allow_nan=False)),
    "stream": _sometimes(st.booleans()),
    "tools": TOOLS,
    "tool_choice": _sometimes(st.sampled_from(["auto", "none", "required"])),
    "store": _sometimes(st.booleans()),
    "previous_response_id": _sometimes(texts),
    "text": json_values,
    "reasoning": json_values,
    "metadata": json_values,
    "parallel_tool_calls": _sometimes(st.booleans()),
}
SESSION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "task": _sometimes(st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
    "group": _sometimes(texts),
    "split": _sometimes(st.sampled_from(["train", "eval", "eval-before", "", "bogus"])),
}
STORE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "tasks": _sometimes(st.lists(st.dictionaries(st.text(max_size=5), json_values, max_size=2), max_size=3)),
    "n": _sometimes(ints),
    "max_attempts": _sometimes(ints),
    "split": _sometimes(st.sampled_from(["train", "eval", ""])),
    "group_ids": json_values,
    "worker_id": _sometimes(texts),
    "lease_s": _sometimes(st.one_of(st.floats(allow_nan=False), ints)),
    "status": _sometimes(st.sampled_from(["succeeded", "failed", "released", "running", ""])),
    "error": json_values,
    "calls": json_values,
    "rewards": json_values,
    "key": json_values,
    "value": json_values,
}


@dataclass
class Surface:
    name: str
    routes: list[tuple[str, str]]  # (method, path template)
    fields: dict[str, st.SearchStrategy[Any]]
    auth: str  # "token" | "admin"
    anthropic: bool = False
    must: tuple[str, ...] = ()


def _store_routes(px: ProxyHandle) -> list[tuple[str, str]]:
    from starlette.routing import Mount, Route

    out: list[tuple[str, str]] = []
    for mount in px.app.starlette.routes:
        if isinstance(mount, Mount) and mount.path == "/lightning/v1/store":
            for r in mount.routes:
                if isinstance(r, Route):
                    out += [(m, mount.path + r.path) for m in sorted(r.methods or {"GET"}) if m != "HEAD"]
    assert out, "the proxy serves no store routes"
    return sorted(set(out))


SURFACES = {
    "responses": Surface("responses", [("POST", "/v1/responses")], RESPONSES_FIELDS, "token", must=("model", "input")),
    "messages": Surface(
        "messages", [("POST", "/v1/messages")], MESSAGES_FIELDS, "token", True, ("model", "messages", "max_tokens")
    ),
    "count_tokens": Surface(
        "count_tokens", [("POST", "/v1/messages/count_tokens")], COUNT_FIELDS, "token", True, ("model", "messages")
    ),
    "sessions": Surface(
        "sessions",
        [("POST", "/lightning/v1/sessions"), ("GET", "/lightning/v1/rollouts"), ("GET", "/lightning/v1/rollouts/{id}")],
        SESSION_FIELDS,
        "admin",
    ),
    "store": Surface("store", [], STORE_FIELDS, "admin"),
}


@dataclass
class Tally:
    sent: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    ok_llm: dict[str, int] = field(default_factory=dict)  # token -> 200 answers of an LLM route


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyHandle]:
    """Passthrough with the policy's tokenizer (``lightning-sdk proxy --tokenizer``: count_tokens answers)."""
    tmp = tmp_path_factory.mktemp("fuzz-surfaces")
    renderer = ChatRenderer.from_pretrained(tokenizer_dir("qwen3"))
    with contextlib.ExitStack() as stack:
        up = stack.enter_context(run_server(StrictUpstream().app))
        backend = RetokenizingBackend(PassthroughBackend(up.url + "/v1"), renderer)
        yield stack.enter_context(run_proxy(policy_backend=backend, store_path=tmp / "store.db"))


@st.composite
def requests(draw: st.DrawFn, surface: Surface) -> dict[str, Any]:
    method, path = draw(st.sampled_from(surface.routes))
    right = draw(st.integers(0, 9)) < 8  # hypothesis draws small numbers most: 0..7 is "right"
    if right:
        body: bytes | None = json.dumps(draw(_objects(surface.fields, surface.must))).encode()
    else:
        body = draw(
            st.one_of(
                st.none(),
                st.builds(lambda o: json.dumps(o).encode(), json_values),
                st.binary(max_size=48),
                st.sampled_from([b"{", b"[]", b"null", b"1e999", b'{"a":NaN}', b"\xff{}", b'{"model": "policy",']),
            )
        )
    return {
        "method": method if draw(st.integers(0, 19)) < 19 else draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])),
        "path": path,
        "param": draw(st.sampled_from(["real", "x", "..", "%00", str(2**64), "-1"])),
        "auth": draw(
            st.sampled_from(
                [surface.auth] * 6
                + ["x-api-key", "wrong", "none", "basic", "admin" if surface.auth == "token" else "token"]
            )
        ),
        "version": draw(st.sampled_from([None, "2023-06-01", "", "bogus"])),
        "content_type": draw(st.sampled_from(["application/json"] * 5 + ["text/plain", "", "application/json; x=;"])),
        "chunked": draw(st.integers(0, 4)) == 4,
        "chunk": draw(st.integers(1, 16)),
        "query": draw(
            st.dictionaries(st.sampled_from(["limit", "after", "status", "beta"]), ints.map(str), max_size=2)
        ),
        "body": body,
    }


def _send(px: ProxyHandle, surface: Surface, req: dict[str, Any], ids: dict[str, Any], tally: Tally) -> httpx.Response:
    token = ids["token"]
    headers: dict[str, str] = {}
    auth = req["auth"]
    if auth == "token":
        headers["x-api-key" if surface.anthropic else "Authorization"] = (
            token if surface.anthropic else f"Bearer {token}"
        )
    elif auth == "x-api-key":
        headers["x-api-key"] = token
    elif auth == "admin":
        headers["Authorization"] = f"Bearer {ADMIN_KEY}"
    elif auth == "wrong":
        headers["Authorization"] = "Bearer lsk-wrong"
    elif auth == "basic":
        headers["Authorization"] = "Basic dXNlcjpwYXNz"
    if req["version"] is not None:
        headers["anthropic-version"] = req["version"]
    if req["content_type"]:
        headers["Content-Type"] = req["content_type"]
    param = {"real": ids["rollout_id"], "x": "x"}.get(req["param"], req["param"])
    path = req["path"].replace("{id}", param).replace("{rollout_id}", param).replace("{attempt_id}", ids["attempt_id"])
    path = path.replace("{key}", "fuzz").replace("{name}", "fuzz")
    body = req["body"]
    content: Any = body
    if body is not None and req["chunked"]:
        size = req["chunk"]
        content = iter([body[i : i + size] for i in range(0, len(body), size)] or [b""])
    r = px.http.request(req["method"], path, params=req["query"], headers=headers, content=content, timeout=60.0)
    tally.sent += 1
    tally.by_status[r.status_code] = tally.by_status.get(r.status_code, 0) + 1
    if r.status_code == 200 and surface.name in ("responses", "messages") and auth in ("token", "x-api-key"):
        tally.ok_llm[token] = tally.ok_llm.get(token, 0) + 1
    return r


def _check(surface: Surface, r: httpx.Response) -> None:
    where = f"{surface.name} {r.request.method} {r.request.url} -> {r.status_code}: {r.text[:300]}"
    assert r.status_code < 500, where
    if r.status_code < 400:
        return
    assert r.headers.get("content-type", "").startswith("application/json"), where
    body = r.json()
    assert isinstance(body, dict), where
    if surface.anthropic and r.status_code != 405:
        assert body.get("type") == "error", where
        err = body.get("error")
        assert isinstance(err, dict) and isinstance(err.get("type"), str) and isinstance(err.get("message"), str), where
    else:
        err = body.get("error")
        assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], where


def _fuzz(px: ProxyHandle, surface: Surface, n: int) -> Tally:
    if surface.name == "store":
        surface = Surface("store", _store_routes(px), STORE_FIELDS, "admin")
    tally = Tally()
    sessions = [px.session({"q": f"fuzz {surface.name} {i}"}) for i in range(3)]

    @settings(max_examples=n, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(requests(surface), st.integers(0, len(sessions) - 1))
    def fuzz(req: dict[str, Any], which: int) -> None:
        s = sessions[which]
        ids = {"token": s["token"], "rollout_id": s["rollout_id"], "attempt_id": s["attempt_id"]}
        _check(surface, _send(px, surface, req, ids, tally))

    fuzz()
    assert tally.sent >= n
    print(f"fuzz {surface.name}: {tally.sent} requests, statuses {dict(sorted(tally.by_status.items()))}")
    # nothing recorded that the store cannot explain
    for s in sessions:
        calls = px.calls(s["rollout_id"])
        clean = [c for c in calls if c["error"] is None]
        assert len(clean) <= tally.ok_llm.get(s["token"], 0), (surface.name, len(clean), tally.ok_llm)
        assert all(isinstance(c["error"], str) and c["error"] for c in calls if c["error"] is not None)
    assert px.http.get("/lightning/v1/health").status_code == 200
    return tally


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SURFACES))
def test_fuzz_surface(proxy: ProxyHandle, name: str) -> None:
    """``N_SLOW`` generated requests on one surface: 0 × 5xx, refusals in the API's own shape."""
    _fuzz(proxy, SURFACES[name], N_SLOW)


@pytest.mark.parametrize("name", sorted(SURFACES))
def test_fuzz_surface_quick(proxy: ProxyHandle, name: str) -> None:
    """The same, ``N_QUICK`` requests per surface, in the default suite."""
    _fuzz(proxy, SURFACES[name], N_QUICK)
