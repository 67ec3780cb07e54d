"""The pipeline's observer seam (``lightning_sdk.proxy.observe``): every request of an LLM route is seen once at its
start and once at its end (refusals too), with the recorded call, the mode, the status and the timings; rewards and
finishes are seen too; an observer that raises never fails a call; with no observer nothing is allocated for them.
Real proxy + the mock engine on loopback (passthrough), a real SQLite store file, the real ``openai`` and
``anthropic`` clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

import lightning_sdk.proxy._call as call_module
from lightning_sdk.proxy import ProxyConfig
from lightning_sdk.proxy.observe import CallEnd, CallObserver, CallStart, FinishEvent, RewardEvent
from tests.support.mock_openai import MockOpenAI
from tests.support.proxy import run_proxy
from tests.support.servers import RunningServer, run_server

_MSGS: Any = [{"role": "user", "content": "hi"}]


class Recording(CallObserver):
    def __init__(self) -> None:
        self.starts: list[CallStart] = []
        self.ends: list[CallEnd] = []
        self.rewards: list[RewardEvent] = []
        self.finishes: list[FinishEvent] = []

    def call_started(self, start: CallStart) -> None:
        self.starts.append(start)

    def call_ended(self, end: CallEnd) -> None:
        self.ends.append(end)

    def reward(self, event: RewardEvent) -> None:
        self.rewards.append(event)

    def finished(self, event: FinishEvent) -> None:
        self.finishes.append(event)


class Broken(CallObserver):
    def call_started(self, start: CallStart) -> None:
        raise RuntimeError("an observer bug")

    def call_ended(self, end: CallEnd) -> None:
        raise RuntimeError("an observer bug")


@pytest.fixture
def upstream() -> Iterator[RunningServer]:
    with run_server(MockOpenAI().app) as server:
        yield server


def test_every_call_is_observed_once_at_start_and_end(upstream: RunningServer, tmp_path: Path) -> None:
    seen = Recording()
    with run_proxy(upstream.url + "/v1", store_path=tmp_path / "s.db", observers=[Broken(), seen]) as px:
        s = px.session({"q": 1})
        client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="policy", messages=_MSGS, max_tokens=8)
        plain_id = raw.headers["x-lightning-call-id"]
        assert raw.parse().choices[0].message.content  # the broken observer did not fail the call
        chunks = list(client.chat.completions.create(model="policy", messages=_MSGS, max_tokens=8, stream=True))
        assert chunks
        claude = anthropic.Anthropic(base_url=px.url + f"/t/{s['token']}", api_key="unused", max_retries=0)
        message = claude.messages.create(model="policy", max_tokens=8, messages=_MSGS)
        assert message.content
        bad = httpx.post(px.url + "/v1/chat/completions", json={"model": "policy"}, headers=_bearer(s["token"]))
        assert bad.status_code == 400
        unknown = httpx.post(px.url + "/v1/chat/completions", json={"model": "policy", "messages": _MSGS})
        assert unknown.status_code == 401
        assert px.reward(s["token"], 0.75).status_code == 200
        assert px.finish(s["token"]).status_code == 200

    assert len(seen.starts) == len(seen.ends) == 5
    assert [e.start for e in seen.ends] == seen.starts  # each end pairs with its start, in order here
    plain, streamed, messages, refused, unauthorised = seen.ends
    assert (plain.surface, plain.route, plain.mode, plain.stream, plain.status) == (
        "chat.completions",
        "/v1/chat/completions",
        "passthrough",
        False,
        200,
    )
    assert plain.call is not None and plain.call.call_id == plain_id and plain.call.prompt_ids
    assert plain.call.token_source == "engine" and plain.call.finish_reason is not None
    assert plain.attempt_id == s["attempt_id"] and plain.rollout_id == s["rollout_id"] and plain.model == "policy"
    assert plain.error_type is None and plain.first_token_s is None and plain.duration_s > 0
    assert streamed.stream and streamed.status == 200 and streamed.call is not None
    assert streamed.first_token_s is not None and 0 < streamed.first_token_s <= streamed.duration_s
    assert (messages.surface, messages.route) == ("messages", "/t/{token}/v1/messages")
    assert messages.call is not None and messages.call.request["surface"]["api"] == "messages"
    assert (refused.status, refused.error_type, refused.call, refused.attempt_id) == (
        400,
        "invalid_request_error",
        None,
        None,
    )
    assert unauthorised.status == 401 and unauthorised.call is None and unauthorised.mode is None
    assert [(r.attempt_id, r.value, r.name) for r in seen.rewards] == [(s["attempt_id"], 0.75, "reward")]
    assert [(f.attempt_id, f.status, f.calls, f.calls_failed) for f in seen.finishes] == [
        (s["attempt_id"], "succeeded", 3, 0)
    ]


def test_a_failed_call_is_observed_with_its_error_and_recorded_call(tmp_path: Path) -> None:
    mock = MockOpenAI(fail_first=1, fail_status=400)
    seen = Recording()
    with (
        run_server(mock.app) as srv,
        run_proxy(srv.url + "/v1", store_path=tmp_path / "s.db", observers=[seen]) as px,
    ):
        s = px.session({"q": 1})
        r = httpx.post(
            px.url + "/v1/chat/completions", json={"model": "policy", "messages": _MSGS}, headers=_bearer(s["token"])
        )
        assert r.status_code == 400
    (end,) = seen.ends
    assert end.status == 400 and end.call is not None and end.call.error is not None
    assert end.call.checks["http_status"] == 400 and end.error_type == end.call.checks["error_code"]


def test_no_observer_allocates_nothing(upstream: RunningServer, tmp_path: Path, monkeypatch: Any) -> None:
    """Without observers (and the metrics off) the pipeline never builds an event: a ``CallStart`` that cannot be
    built does not matter."""

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an observer event was built with no observer")

    monkeypatch.setattr(call_module, "CallStart", never)
    monkeypatch.setattr(call_module, "CallEnd", never)
    off = ProxyConfig(metrics=False)  # the Prometheus call metrics are an observer too (proxy/_call_metrics.py)
    with run_proxy(upstream.url + "/v1", store_path=tmp_path / "s.db", config=off) as px:
        s = px.session({"q": 1})
        client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
        assert client.chat.completions.create(model="policy", messages=_MSGS, max_tokens=8).choices
        bad = httpx.post(px.url + "/v1/chat/completions", json={"model": "policy"}, headers=_bearer(s["token"]))
        assert bad.status_code == 400


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
