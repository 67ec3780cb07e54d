"""The surface translations on their own (pure functions over JSON), and upstream failures seen through the clients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from lightning_sdk.proxy._errors import ProxyHTTPError
from lightning_sdk.proxy.surfaces import MessagesSurface, ResponsesSurface
from lightning_sdk.proxy.surfaces._chat import ChatDeltaReader, PriorReplies, Reply, opaque_ref, read_opaque_ref
from tests.surfaces.conftest import passthrough_proxy, recorded_calls


def test_messages_request_to_chat_form() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 50,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "source": {}}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},  # Claude Code sends these
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "is_error": True,
                        "content": [{"type": "text", "text": "denied"}],
                    },
                    {"type": "text", "text": "Try again."},
                ],
            },
        ],
        "tools": [
            {"name": "Bash", "input_schema": {"type": "object"}, "description": "Run"},
            {"type": "web_search_20250305", "name": "web_search"},
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": []},
    }
    surface = MessagesSurface()
    t = surface.translate(surface.parse(body), PriorReplies(()), "call-x1")
    assert t.chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look:\n[image]"},
        {"role": "system", "content": "# Environment"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: denied"},
        {"role": "user", "content": "Try again."},
    ]
    assert t.chat["tools"] == [
        {"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}, "description": "Run"}}
    ]
    assert t.chat["tool_choice"] == "required" and t.chat["parallel_tool_calls"] is False
    assert t.record["hidden_tools"] == ["web_search_20250305:web_search"]
    assert "thinking" not in t.chat and t.record["request"]["thinking"] == {"type": "adaptive"}
    named = surface.translate({**body, "tool_choice": {"type": "tool", "name": "Bash"}}, PriorReplies(()), "call-x2")
    assert named.chat["tool_choice"] == {"type": "function", "function": {"name": "Bash"}}
    with pytest.raises(ProxyHTTPError) as err:
        surface.parse({**body, "max_tokens": None})
    assert err.value.param == "max_tokens"


def test_responses_request_to_chat_form() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
            {"role": "user", "content": "Go."},
            {
                "type": "function_call",
                "id": "fc_9",
                "call_id": "c9",
                "name": "spawn",
                "namespace": "agents",
                "arguments": "{}",
            },
            {"type": "function_call_output", "call_id": "c9", "output": [{"type": "input_text", "text": "ok"}]},
        ],
        "tools": [
            {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn", "parameters": {}}]},
            {"type": "web_search"},
            {"type": "custom", "name": "apply_patch"},
        ],
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        "max_output_tokens": 64,
    }
    surface = ResponsesSurface()
    t = surface.translate(surface.parse(body), PriorReplies(()), "call-y1")
    assert [m["role"] for m in t.chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert t.chat["messages"][2]["tool_calls"][0]["function"]["name"] == "agents__spawn"
    assert t.chat["messages"][3]["content"] == "ok"
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["agents__spawn"]
    assert t.record["hidden_tools"] == ["web_search", "apply_patch"]
    assert t.chat["response_format"]["json_schema"]["name"] == "out" and t.chat["max_tokens"] == 64
    reply = Reply.from_chat(
        {
            "choices": [
                {
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c10", "type": "function", "function": {"name": "agents__spawn", "arguments": "{}"}}
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4},
        }
    )
    out = surface.reply_body(t, reply)
    assert out["output"] == [
        {
            "type": "function_call",
            "id": "fc_y1_0",
            "call_id": "c10",
            "name": "spawn",
            "arguments": "{}",
            "status": "completed",
            "namespace": "agents",
        }
    ]
    assert out["usage"]["total_tokens"] == 13 and out["status"] == "completed"
    with pytest.raises(ProxyHTTPError) as err:
        surface.translate({**body, "previous_response_id": "resp_unknown"}, PriorReplies(()), "call-y2")
    assert err.value.status == 400 and err.value.param == "previous_response_id"
    with pytest.raises(ProxyHTTPError) as err:
        surface.translate({**body, "input": [{"type": "local_shell_call"}]}, PriorReplies(()), "call-y3")
    assert err.value.param == "input[0].type"


def test_opaque_refs_and_stop_sequences_across_chunks() -> None:
    ref = opaque_ref("call-abc", "thinking")
    assert read_opaque_ref(ref) == "call-abc"
    assert read_opaque_ref("EqQBCkYIBxgCKkD...") is None and read_opaque_ref(None) is None
    reader = ChatDeltaReader(["STOP"])

    def chunk(text: str) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": {"content": text}}]}

    assert reader.feed(chunk("Hello S")) == [("text", "Hello ")]  # "S" may start the stop sequence: held back
    assert reader.feed(chunk("T")) == []
    assert reader.feed(chunk("OP and more")) == []  # the stop sequence and what follows are never shown
    assert reader.rest("Hello ") == []
    assert Reply.from_chat({"choices": [{"message": {"content": "Hello STOP x"}}]}, ["STOP"]).stop_sequence == "STOP"


def test_upstream_failure_reaches_the_clients_in_their_shapes(tmp_path: Path) -> None:
    with passthrough_proxy(tmp_path, []) as (px, _upstream):  # an empty script: the upstream answers 500
        s = px.session()
        claude = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        with pytest.raises(anthropic.InternalServerError) as err:
            claude.messages.create(model="policy", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 502 and err.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        client = openai.OpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
        with pytest.raises(openai.InternalServerError) as failed:
            client.responses.create(model="policy", input="hi", stream=True)
        assert failed.value.status_code == 502
        calls = recorded_calls(px, s["rollout_id"])
    assert len(calls) == 2 and all(c.error and "500" in c.error for c in calls)
    assert [c.request["surface"]["api"] for c in calls] == ["messages", "responses"]


MALFORMED: list[tuple[str, Any]] = [
    ("/v1/messages", []),
    ("/v1/messages", {"model": "policy", "max_tokens": 5}),
    ("/v1/messages", {"model": "policy", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}),
    ("/v1/messages", {"model": "policy", "max_tokens": 5, "messages": [{"role": "user", "content": 3}]}),
    ("/v1/messages", {"model": "policy", "max_tokens": 5, "system": 7, "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/messages", {"model": "policy", "max_tokens": 5, "messages": [{"role": "assistant", "content": [1]}]}),
    (
        "/v1/messages",
        {"model": "policy", "max_tokens": 5, "tool_choice": "any", "messages": [{"role": "user", "content": "x"}]},
    ),
    (
        "/v1/messages",
        {
            "model": "policy",
            "max_tokens": 5,
            "tools": [{"input_schema": {}}],
            "messages": [{"role": "user", "content": "x"}],
        },
    ),
    ("/v1/responses", {"model": "policy"}),
    ("/v1/responses", {"model": "policy", "input": [{"type": "message", "role": "user", "content": {"a": 1}}]}),
    ("/v1/responses", {"model": "policy", "input": [5]}),
    ("/v1/responses", {"model": "policy", "input": "x", "tools": [{"type": "function"}]}),
    ("/v1/responses", {"model": "policy", "input": "x", "max_output_tokens": 0}),
    ("/v1/responses", {"model": "policy", "input": [], "instructions": None}),
]


@pytest.mark.parametrize(("path", "body"), MALFORMED)
def test_malformed_requests_answer_400_in_the_route_shape(tmp_path: Path, path: str, body: Any) -> None:
    with passthrough_proxy(tmp_path, []) as (px, upstream):
        s = px.session()
        r = px.http.post(path, json=body, headers={"x-api-key": s["token"]})
    assert r.status_code == 400, r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    else:
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"]
    assert upstream.requests == []


def test_an_engine_context_refusal_reads_prompt_is_too_long_on_the_messages_route(tmp_path: Path) -> None:
    """vLLM refuses a prompt past its context with a 400 (its wording, read from vllm serving_engine): Anthropic
    clients get "prompt is too long" (what Claude Code acts on), OpenAI clients ``context_length_exceeded``."""
    from tests.surfaces.upstream import ScriptedReply

    vllm_400 = {
        "object": "error",
        "message": "This model's maximum context length is 1024 tokens. However, you requested 35000 tokens "
        "(34000 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    script = [ScriptedReply(error=(400, vllm_400)), ScriptedReply(error=(400, {"error": vllm_400}))]
    with passthrough_proxy(tmp_path, script) as (px, _upstream):
        s = px.session()
        claude = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(model="policy", max_tokens=1000, messages=[{"role": "user", "content": "hi"}])
        message = err.value.body["error"]["message"]  # type: ignore[index]
        assert message.startswith("prompt is too long: This model's maximum context length is 1024 tokens")
        client = openai.OpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="policy", input="hi")
        assert refused.value.code == "context_length_exceeded"
        calls = recorded_calls(px, s["rollout_id"])
    assert len(calls) == 2 and all(c.error and c.completion_ids == [] for c in calls)


def test_replies_cut_by_the_token_limit(tmp_path: Path) -> None:
    """A reply cut by ``max_tokens`` / ``max_output_tokens``: ``stop_reason: "max_tokens"`` on Messages, an
    ``incomplete`` response (``response.incomplete`` when streamed) on Responses; the ids are recorded as sampled."""
    from tests.surfaces.conftest import token_proxy

    with token_proxy(tmp_path, [30, 30, 30]) as (px, engine):  # random vocabulary tokens, longer than the limit
        s = px.session()
        claude = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        cut = claude.messages.create(model="policy", max_tokens=5, messages=[{"role": "user", "content": "Talk."}])
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 5
        client = openai.OpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
        r = client.responses.create(model="policy", input="Talk.", max_output_tokens=5)
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
        events = [
            e.type for e in client.responses.create(model="policy", input="Talk.", max_output_tokens=5, stream=True)
        ]
        assert events[-1] == "response.incomplete" and "response.completed" not in events
        calls = recorded_calls(px, s["rollout_id"])
    assert [c.finish_reason for c in calls] == ["length"] * 3
    assert [c.completion_ids for c in calls] == engine.sampled and all(len(ids) == 5 for ids in engine.sampled)


def test_records_cli_exports_surface_episodes_like_chat_ones(tmp_path: Path) -> None:
    """``lightning-sdk records`` over a store holding a Messages episode and a Responses episode (each a tool call
    and an answer): one record each, every sampled token trained, nothing retokenized (the fidelity report)."""
    import json
    import subprocess
    import sys

    from tests.surfaces.upstream import ScriptedReply

    script = [ScriptedReply(tool_calls=[("get", "{}")]), ScriptedReply("done")] * 2
    with passthrough_proxy(tmp_path, script) as (px, upstream):
        a = px.session({"q": "messages"})
        claude = anthropic.Anthropic(base_url=px.url, api_key=a["token"], max_retries=0)
        tools = [{"name": "get", "input_schema": {"type": "object"}}]
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
        first = claude.messages.create(model="policy", max_tokens=50, messages=msgs, tools=tools)  # type: ignore[arg-type]
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
        result = {"type": "tool_result", "tool_use_id": first.content[-1].id, "content": "x"}  # type: ignore[union-attr]
        msgs.append({"role": "user", "content": [result]})
        claude.messages.create(model="policy", max_tokens=50, messages=msgs, tools=tools)  # type: ignore[arg-type]
        b = px.session({"q": "responses"})
        client = openai.OpenAI(base_url=f"{px.url}/v1", api_key=b["token"], max_retries=0)
        fn = [{"type": "function", "name": "get", "parameters": {"type": "object", "properties": {}}}]
        r1 = client.responses.create(model="policy", input="go", tools=fn)  # type: ignore[arg-type]
        output = {"type": "function_call_output", "call_id": r1.output[0].call_id, "output": "x"}  # type: ignore[union-attr]
        client.responses.create(model="policy", previous_response_id=r1.id, input=[output], tools=fn)  # type: ignore[arg-type, list-item]
        for s in (a, b):
            assert px.reward(s["token"], 1.0).status_code == 200 and px.finish(s["token"]).status_code == 200
    out, report = tmp_path / "records.jsonl", tmp_path / "report.json"
    argv = [sys.executable, "-m", "lightning_sdk", "records", "--store", str(tmp_path / "store.db"), "--out", str(out)]
    proc = subprocess.run([*argv, "--report", str(report), "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["segment"] == 0 and r["split_reason"] is None for r in rows)
    n_completion = sum(len(completion) for _, completion, _ in upstream.sampled)
    for row in rows:
        assert row["input_ids"] in [p + c for p, c, _ in upstream.sampled[1::2]]  # the last call's prompt + reply
    summary = json.loads(report.read_text())["summary"]
    assert summary["calls"] == summary["trained_calls"] == 4 and summary["records"] == 2
    assert summary["tokens_trained"] == sum(sum(r["loss_mask"]) for r in rows) == n_completion
    assert summary["retokenized_calls"] == summary["text_only_calls"] == 0 and summary["split_reasons"] == {}


def test_finish_waits_for_a_surface_call_in_flight(tmp_path: Path) -> None:
    """The finish barrier covers the surfaces: a streamed Messages call still being served when the agent posts
    finish is recorded before finish answers; a call after finish gets 409 in Anthropic's shape."""
    import threading

    from tests.support.proxy import run_proxy
    from tests.support.servers import run_server
    from tests.surfaces.upstream import ScriptedReply, ScriptedUpstream

    upstream = ScriptedUpstream([ScriptedReply("slow answer")], delay_s=1.0)
    with run_server(upstream.app) as srv, run_proxy(srv.url + "/v1", store_path=tmp_path / "store.db") as px:
        s = px.session()
        claude = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        texts: list[str] = []

        def call() -> None:
            with claude.messages.stream(
                model="policy", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
            ) as st:
                texts.append(st.get_final_text())

        worker = threading.Thread(target=call)
        worker.start()
        while not upstream.requests:  # the call reached the engine: it is in flight
            threading.Event().wait(0.01)
        finished = px.finish(s["token"])
        worker.join()
        assert finished.status_code == 200 and finished.json()["calls"] == 1 and texts == ["slow answer"]
        detail = px.call(px.store.get_rollout(s["rollout_id"]))
        assert [c.error for c in detail.attempts[0].calls] == [None]  # committed before finish answered
        with pytest.raises(anthropic.ConflictError) as late:
            claude.messages.create(model="policy", max_tokens=5, messages=[{"role": "user", "content": "again"}])
        assert late.value.body["type"] == "error"  # type: ignore[index]


def test_a_turn_known_only_by_its_encrypted_content_gets_the_recorded_reply_back() -> None:
    """Codex with ``store: false`` sends an earlier reasoning item back as its opaque ``encrypted_content`` (the
    summary may be dropped, the function call re-serialised): the proxy resolves the reference to the call it
    recorded and puts that call's reply (reasoning, arguments exactly as sampled) back into the conversation."""
    from lightning_sdk.types import Call

    sampled = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Check the disk first.",
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "sh", "arguments": '{"cmd":"df"}'}}],
    }
    shown = Reply.from_chat({"choices": [{"message": sampled}]}).shown()
    call = Call(
        call_id="call-rec1",
        attempt_id="at",
        rollout_id="ro",
        model="policy",
        request={"messages": [{"role": "user", "content": "disk?"}], "surface": {"api": "responses", "shown": shown}},
        response={"choices": [{"index": 0, "message": sampled, "finish_reason": "tool_calls"}]},
        prompt_ids=[1, 2],
        completion_ids=[3, 4],
        logprobs=[-0.1, -0.2],
    )
    body = {
        "model": "policy",
        "input": [
            {"type": "message", "role": "user", "content": "disk?"},
            {"type": "reasoning", "summary": [], "encrypted_content": opaque_ref("call-rec1", "reasoning")},
            {"type": "function_call", "call_id": "call_a", "name": "sh", "arguments": '{"cmd": "df"}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "90% used"},
        ],
    }
    t = ResponsesSurface().translate(body, PriorReplies([call]), "call-new")
    assert t.chat["messages"][1] == sampled  # the recorded reply, not the re-serialised one without reasoning
    edited = dict(body, input=[*body["input"][:2], {**body["input"][2], "arguments": '{"cmd": "rm -rf /"}'}])
    t2 = ResponsesSurface().translate(edited, PriorReplies([call]), "call-new2")
    assert t2.chat["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"cmd": "rm -rf /"}'  # kept as sent
    assert "reasoning_content" not in t2.chat["messages"][1]
