"""Proxies for the surface tests: token mode over the real Qwen3 template, and passthrough over a scripted upstream.

Token mode: the real proxy app, a real SQLite store file, the real Qwen3 tokenizer and chat template, and
``ScriptedEngine`` (tests/tokens/test_token_mode.py) in place of a GPU engine — it samples the template's own
rendering of a scripted reply, so the parsers and the bridge run on what a real Qwen3 model would emit. Passthrough:
the real proxy in front of ``ScriptedUpstream`` (a vLLM-style loopback server, tests/surfaces/upstream.py).
Everything runs over loopback HTTP with the real ``openai`` / ``anthropic`` clients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_sdk.proxy.token_mode import TokenModeBackend
from lightning_sdk.records.segments import merge_attempt
from lightning_sdk.types import Call
from tests.support.proxy import ProxyHandle, run_proxy
from tests.support.servers import run_server
from tests.surfaces.upstream import ScriptedReply, ScriptedUpstream
from tests.tokens.conversations import renderer_for
from tests.tokens.test_token_mode import Plan, ScriptedEngine


@contextlib.contextmanager
def token_proxy(tmp_path: Path, plans: list[Plan]) -> Iterator[tuple[ProxyHandle, ScriptedEngine]]:
    renderer = renderer_for("qwen3")
    engine = ScriptedEngine(renderer, plans)
    backend = TokenModeBackend(engine, renderer)  # type: ignore[arg-type]
    with run_proxy(policy_backend=backend, store_path=tmp_path / "store.db") as px:
        yield px, engine


@contextlib.contextmanager
def passthrough_proxy(tmp_path: Path, script: list[Any]) -> Iterator[tuple[ProxyHandle, ScriptedUpstream]]:
    upstream = ScriptedUpstream(script)
    with run_server(upstream.app) as srv, run_proxy(srv.url + "/v1", store_path=tmp_path / "store.db") as px:
        yield px, upstream


def recorded_calls(px: ProxyHandle, rollout_id: str) -> list[Call]:
    """The attempt's calls as stored (after the recorder drained), in seq order."""
    px.drain()
    detail = px.call(px.store.get_rollout(rollout_id))
    return sorted(detail.attempts[0].calls, key=lambda c: c.seq)


def one_segment(calls: list[Call]) -> bool:
    """Whether the calls merge into one segment that trains every completion (lightning_sdk.records)."""
    result = merge_attempt(calls)
    return len(result.segments) == 1 and len(result.segments[0].spans) == len(calls)


__all__ = ["ScriptedReply", "one_segment", "passthrough_proxy", "recorded_calls", "token_proxy"]
