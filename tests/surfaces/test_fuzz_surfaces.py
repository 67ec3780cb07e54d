"""Property test of the two surface routes: whatever JSON an agent sends, the proxy answers 200 or a 4xx in the
route's own error shape — never a 5xx, a traceback or a dropped connection — and every call it opened is recorded.

Bodies are drawn from the fields both APIs define, with valid and invalid values mixed (wrong types, unknown block
and item types, junk), over loopback HTTP to the real proxy in passthrough in front of ``ScriptedUpstream`` (which
answers every request with a short text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.surfaces.conftest import passthrough_proxy, recorded_calls
from tests.surfaces.upstream import ScriptedReply

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=4), st.just([]), st.just({}))
text = st.text(max_size=12)


def _bodies(junk: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[str, Any]]:
    """Messages and Responses bodies whose values are drawn valid or from ``junk`` (``st.nothing()``: valid)."""
    anthropic_block = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(text, junk)}),
        st.fixed_dictionaries(
            {"type": st.just("tool_use"), "id": st.one_of(text, junk), "name": st.one_of(text, junk), "input": junk}
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("tool_result"),
                "tool_use_id": st.one_of(text, junk),
                "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}))),
                "is_error": st.booleans(),
            }
        ),
        st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text, "signature": st.one_of(text, junk)}),
        st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "weird"])}),
        junk,
    )
    anthropic_message = st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["user", "assistant", "system"]), junk),
            "content": st.one_of(text, st.lists(anthropic_block, max_size=3), junk),
        }
    )
    messages_body = st.fixed_dictionaries(
        {"model": st.one_of(st.just("policy"), junk)},
        optional={
            "messages": st.one_of(st.lists(anthropic_message, min_size=1, max_size=4), junk),
            "max_tokens": st.one_of(st.integers(-1, 20), junk),
            "system": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text})), junk),
            "tools": st.one_of(
                st.lists(
                    st.one_of(
                        st.fixed_dictionaries(
                            {"name": st.one_of(text, junk), "input_schema": st.just({"type": "object"})}
                        ),
                        st.fixed_dictionaries({"type": st.just("web_search_20250305"), "name": text}),
                        junk,
                    ),
                    max_size=3,
                ),
                junk,
            ),
            "tool_choice": st.one_of(
                st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "bad"]), "name": text}),
                junk,
            ),
            "stop_sequences": st.one_of(st.lists(text, max_size=2), junk),
            "temperature": st.one_of(st.floats(0, 1), junk),
            "stream": st.one_of(st.booleans(), junk),
        },
    )
    response_item = st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("message"),
                "role": st.one_of(st.sampled_from(["user", "assistant", "developer", "system"]), junk),
                "content": st.one_of(
                    text,
                    st.lists(st.fixed_dictionaries({"type": st.just("input_text"), "text": text}), max_size=2),
                    junk,
                ),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call"),
                "call_id": st.one_of(text, junk),
                "name": st.one_of(text, junk),
                "arguments": st.one_of(text, junk),
            }
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call_output"), "call_id": st.one_of(text, junk), "output": st.one_of(text, junk)}
        ),
        st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.one_of(st.just([]), junk)}),
        st.fixed_dictionaries({"type": st.sampled_from(["item_reference", "web_search_call", "bogus"])}),
        junk,
    )
    responses_body = st.fixed_dictionaries(
        {"model": st.one_of(st.just("policy"), junk)},
        optional={
            "input": st.one_of(text, st.lists(response_item, max_size=4), junk),
            "instructions": st.one_of(text, junk),
            "tools": st.one_of(
                st.lists(
                    st.one_of(
                        st.fixed_dictionaries({"type": st.just("function"), "name": st.one_of(text, junk)}),
                        st.fixed_dictionaries(
                            {"type": st.just("namespace"), "name": text, "tools": st.one_of(st.just([]), junk)}
                        ),
                        st.fixed_dictionaries({"type": st.sampled_from(["web_search", "custom", "file_search"])}),
                        junk,
                    ),
                    max_size=3,
                ),
                junk,
            ),
            "previous_response_id": st.one_of(text, junk),
            "max_output_tokens": st.one_of(st.integers(-1, 20), junk),
            "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), junk),
            "text": st.one_of(st.fixed_dictionaries({"format": junk}), junk),
            "stream": st.one_of(st.booleans(), junk),
        },
    )
    return st.one_of(
        st.tuples(st.just("/v1/messages"), messages_body), st.tuples(st.just("/v1/responses"), responses_body)
    )


def test_any_body_gets_200_or_a_4xx_in_the_route_shape(tmp_path: Path) -> None:
    with passthrough_proxy(tmp_path, [lambda body: ScriptedReply("ok")] * 10_000) as (px, _upstream):
        s = px.session()
        opened: list[str] = []
        statuses: list[int] = []

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(st.one_of(_bodies(st.nothing()), _bodies(JUNK)))
        def check(case: tuple[str, Any]) -> None:
            path, body = case
            r = httpx.post(px.url + path, json=body, headers={"x-api-key": s["token"]}, timeout=30)
            assert r.status_code < 500, (path, body, r.status_code, r.text)
            statuses.append(r.status_code)
            call_id = r.headers.get("x-lightning-call-id")
            if call_id:
                opened.append(call_id)
            if r.status_code != 200:
                err = r.json()
                if path == "/v1/messages":
                    assert err["type"] == "error" and isinstance(err["error"]["message"], str)
                else:
                    assert isinstance(err["error"]["message"], str)

        check()
        assert px.finish(s["token"]).status_code == 200
        recorded = recorded_calls(px, s["rollout_id"])
    assert sorted(c.call_id for c in recorded) == sorted(opened)  # every call the proxy opened is recorded
    assert statuses.count(200) >= 10 and statuses.count(400) >= 30  # both paths exercised
    assert sum(c.error is None for c in recorded) == statuses.count(200)
