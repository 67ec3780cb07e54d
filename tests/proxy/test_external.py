"""Model routing: a model name that is not the policy goes to an external provider through LiteLLM (here the
loopback mock plays the provider). The call is traced with text and usage, never as policy tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from lightning_sdk.proxy import ExternalRoute
from lightning_sdk.proxy._external import count_tokens
from tests.support.mock_openai import MockOpenAI
from tests.support.proxy import ProxyHandle, run_proxy
from tests.support.servers import RunningServer, run_server

JUDGE_SAYS = "The answer is correct."

# LiteLLM starts a logging worker bound to the proxy thread's event loop; at teardown that loop is closed under it.
pytestmark = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier:UserWarning"),
]


@pytest.fixture
def provider() -> MockOpenAI:
    return MockOpenAI(reply=JUDGE_SAYS, api_key="sk-provider", models=["judge-model"])


@pytest.fixture
def routed(upstream: RunningServer, provider: MockOpenAI, tmp_path: Path) -> Iterator[ProxyHandle]:
    with run_server(provider.app) as prov:
        route = ExternalRoute(
            name="judge", target="openai/judge-model", api_base=prov.url + "/v1", api_key="sk-provider"
        )
        with run_proxy(upstream.url + "/v1", store_path=tmp_path / "s.db", external=[route]) as px:
            yield px


def test_external_model_is_traced_but_not_the_policy(
    routed: ProxyHandle, provider: MockOpenAI, mock: MockOpenAI
) -> None:
    s = routed.session()
    client = openai.OpenAI(base_url=routed.url + "/v1", api_key=s["token"], max_retries=0)
    messages = [{"role": "user", "content": "Is 2 + 2 = 4? Answer briefly."}]

    policy = client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
    judged = client.chat.completions.create(model="judge", messages=messages)  # type: ignore[arg-type]

    assert policy.choices[0].message.content == "Hello from the mock upstream."
    assert judged.choices[0].message.content == JUDGE_SAYS
    assert judged.model == "judge"
    assert provider.requests[-1]["model"] == "judge-model"
    assert "return_token_ids" not in provider.requests[-1]  # only the policy engine is asked for ids
    assert provider.headers[-1]["authorization"] == "Bearer sk-provider"
    assert len(mock.requests) == 1  # the policy engine saw only the policy call

    policy_call, judge_call = routed.calls(s["rollout_id"])
    assert policy_call["is_policy"] is True and policy_call["token_source"] == "engine"
    assert judge_call["is_policy"] is False and judge_call["token_source"] == "external"
    assert judge_call["prompt_ids"] == [] and judge_call["completion_ids"] == [] and judge_call["logprobs"] == []
    assert judge_call["response"]["choices"][0]["message"]["content"] == JUDGE_SAYS
    assert judge_call["usage"]["completion_tokens"] == len(JUDGE_SAYS) + 1  # the provider's own count (mock bytes)
    assert judge_call["checks"]["usage_source"] == "provider"
    assert judge_call["model"] == "judge"


def test_external_usage_counted_with_tiktoken_when_the_provider_gives_none(
    routed: ProxyHandle, provider: MockOpenAI
) -> None:
    provider.include_usage = False
    s = routed.session()
    client = openai.OpenAI(base_url=routed.url + "/v1", api_key=s["token"], max_retries=0)
    client.chat.completions.create(model="judge", messages=[{"role": "user", "content": "grade this"}])
    stream = client.chat.completions.create(
        model="judge", messages=[{"role": "user", "content": "grade this"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == JUDGE_SAYS

    plain, streamed = routed.calls(s["rollout_id"])
    for call in (plain, streamed):
        assert call["token_source"] == "external" and call["is_policy"] is False
        assert call["response"]["choices"][0]["message"]["content"] == JUDGE_SAYS
        assert call["usage"]["completion_tokens"] == count_tokens(JUDGE_SAYS) == 5  # cl100k_base, offline
    assert plain["checks"] == {"usage_source": "tiktoken", "encoding": "cl100k_base"}
    assert plain["usage"]["prompt_tokens"] == count_tokens("user: grade this")
    # for streams LiteLLM counts usage itself when the provider sends none: the proxy keeps that count
    assert streamed["usage"]["prompt_tokens"] > 0


def test_models_lists_policy_and_external_names(routed: ProxyHandle) -> None:
    names = [m["id"] for m in routed.http.get("/v1/models").json()["data"]]
    assert names == ["policy", "judge"]
