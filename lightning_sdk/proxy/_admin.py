"""The ``/lightning/v1`` endpoints of the proxy: reward and finish (attempt token), sessions and rollouts (admin key).

Shapes (the contract)::

    POST /lightning/v1/reward    {"value": float, "name": str?, "call_id": str?}
                                 -> {"rollout_id", "attempt_id", "name", "value", "call_id" (when given)}
                                 (``call_id``: a per-call reward; the id is the ``X-Lightning-Call-Id`` header of that
                                 call's response; 400 ``param="call_id"`` when it is not a call of this attempt)
    POST /lightning/v1/finish    {"status": "succeeded"|"failed", "error": str?}
                                 -> {"rollout_id", "attempt_id", "status", "calls", "calls_failed",
                                     "calls_not_recorded", "rewards_not_recorded", "inflight": {"waited_s",
                                     "aborted"}, "error"?}   (after every call is committed: see Proxy.end_attempt)
    GET  /lightning/v1/calls     -> {"rollout_id", "attempt_id", "calls": [{"call_id", "seq", "request", "response",
                                     "prompt_ids", "completion_ids", ...}], "inflight": int}
                                 (the attempt's answered calls in ``seq`` order, once the requests of it in flight
                                 are done, waiting at most as long as ``finish`` would; a failed call is left out;
                                 for a reward function that gives per-call rewards: ``CommandAgent``'s ``calls``)
    POST /lightning/v1/sessions  {"task": {...}?, "group": str?, "split": str?}
                                 -> {"rollout_id", "attempt_id", "token", "base_url", "group", "split"}
                                 (split ``traced`` unless split and group are given: traced, never trained)
    GET  /lightning/v1/rollouts?status=&limit=100&after=CURSOR -> {"rollouts": [{"rollout_id", "status", "group", ...}],
                                                                  "next": CURSOR|null}
    GET  /lightning/v1/rollouts/{rollout_id} -> {"rollout_id", "group", "task", "status", "attempts": [{"attempt_id",
         "status", "error", "calls": [{"call_id", "model", "prompt_ids", "completion_ids", "logprobs",
         "policy_version", "token_source", "finish_reason", ...}]}], "rewards": [{"name", "value", "call_id", ...}]}

The admin key is sent as ``Authorization: Bearer <admin key>`` (like the store's HTTP API).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lightning_sdk.errors import ConfigError
from lightning_sdk.http_errors import bearer_token
from lightning_sdk.proxy._errors import ProxyHTTPError
from lightning_sdk.types import AttemptStatus, Call, Reward, Rollout, RolloutDetail, RolloutStatus

if TYPE_CHECKING:
    from lightning_sdk.proxy._service import Proxy

__all__ = ["TRACED_SPLIT", "admin_routes", "call_json", "rollout_detail_json", "rollout_json"]

TRACED_SPLIT = "traced"
"""The split of a hand-opened session that names no split and group: traced (exported), never trained."""

_JSON = "application/json"
_EVERY_SEQ = 1 << 62


def _ok(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type=_JSON)


def rollout_json(r: Rollout) -> dict[str, Any]:
    return {
        "rollout_id": r.rollout_id,
        "status": r.status.value,
        "group": r.group_id,
        "task": r.task,
        "split": r.split,
        "max_attempts": r.max_attempts,
        "attempts_used": r.attempts_used,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
    }


def call_json(c: Call) -> dict[str, Any]:
    return c.model_dump(mode="json")


def rollout_detail_json(d: RolloutDetail) -> dict[str, Any]:
    r = d.rollout
    out = rollout_json(r)
    out["attempts"] = [
        {
            "attempt_id": a.attempt.attempt_id,
            "index": a.attempt.index,
            "status": a.attempt.status.value,
            "error": a.attempt.error,
            "worker_id": a.attempt.worker_id,
            "started_at": a.attempt.started_at,
            "ended_at": a.attempt.ended_at,
            "calls": [call_json(c) for c in a.calls],
        }
        for a in d.attempts
    ]
    out["rewards"] = [
        {"name": w.name, "value": w.value, "call_id": w.call_id, "attempt_id": w.attempt_id, "created_at": w.created_at}
        for a in d.attempts
        for w in a.rewards
    ]
    return out


def admin_routes(proxy: Proxy, *, token_routes_only: bool = False) -> list[BaseRoute]:
    """The routes; ``token_routes_only`` gives just reward and finish (mounted again under ``/t/<token>``).

    A route raises the library's exceptions (``ProxyHTTPError`` for a refusal): the app's exception handler
    answers them (``proxy/_app.py``)."""

    def check_admin(request: Request) -> None:
        given = bearer_token(request.headers) or ""
        if not given or not hmac.compare_digest(given.encode(), proxy.admin_key.encode()):
            raise ProxyHTTPError(401, "missing or wrong admin key (send 'Authorization: Bearer <admin key>')")

    async def body_object(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw:
            return {}
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ProxyHTTPError(400, f"body: invalid JSON ({exc})", param="body") from exc
        if not isinstance(data, dict):
            raise ProxyHTTPError(400, "body: must be a JSON object", param="body")
        return data

    async def reward(request: Request) -> Response:
        data = await body_object(request)
        value = data.get("value")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ProxyHTTPError(400, "value: required, a number", param="value")
        name = data.get("name") or "reward"
        call_id = data.get("call_id")
        if not isinstance(name, str):
            raise ProxyHTTPError(400, "name: must be a string", param="name")
        if call_id is not None and not isinstance(call_id, str):
            raise ProxyHTTPError(400, "call_id: must be a string", param="call_id")
        if not math.isfinite(value):
            raise ProxyHTTPError(400, "value: must be a finite number", param="value")
        state = await proxy.attempts.resolve(proxy.token_of(request))
        state.enter()  # finish waits for this reward (no await since the check in resolve)
        try:
            a = state.attempt
            if call_id is not None and not await state.has_call(proxy.store, call_id):
                raise ProxyHTTPError(
                    400,
                    f"call_id: {call_id!r} is not a call of attempt {a.attempt_id} (use the X-Lightning-Call-Id "
                    "header of one of its chat/completions responses)",
                    param="call_id",
                )
            await proxy.add_reward(
                Reward(rollout_id=a.rollout_id, attempt_id=a.attempt_id, value=float(value), name=name, call_id=call_id)
            )
        finally:
            state.leave()
        out: dict[str, Any] = {
            "rollout_id": a.rollout_id,
            "attempt_id": a.attempt_id,
            "name": name,
            "value": float(value),
        }
        if call_id is not None:
            out["call_id"] = call_id
        return _ok(out)

    async def finish(request: Request) -> Response:
        data = await body_object(request)
        status = data.get("status")
        if status not in ("succeeded", "failed"):
            raise ProxyHTTPError(400, "status: required, 'succeeded' or 'failed'", param="status")
        error = data.get("error")
        if error is not None and not isinstance(error, str):
            raise ProxyHTTPError(400, "error: must be a string", param="error")
        state = await proxy.attempts.resolve(proxy.token_of(request))
        return _ok(await proxy.end_attempt(state, AttemptStatus(status), error))

    async def attempt_calls(request: Request) -> Response:
        state = await proxy.attempts.resolve(proxy.token_of(request))
        wait_s = proxy.config.finish_timeout_s
        # a call is in ``state`` once its request is over (it is recorded right after answering); after the wait,
        # what is done is answered and "inflight" says how many requests are not
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.idle.wait(), proxy.config.call_timeout_s if wait_s is None else wait_s)
        a = state.attempt
        calls = await state.earlier_calls(proxy.store, _EVERY_SEQ)  # loads the store's own when not held here
        return _ok(
            {
                "rollout_id": a.rollout_id,
                "attempt_id": a.attempt_id,
                "calls": [call_json(c) for c in calls],
                "inflight": state.inflight,
            }
        )

    async def sessions(request: Request) -> Response:
        check_admin(request)
        data = await body_object(request)
        task = data.get("task")
        group = data.get("group")
        if task is not None and not isinstance(task, dict):
            raise ProxyHTTPError(400, "task: must be a JSON object", param="task")
        if group is not None and not isinstance(group, str):
            raise ProxyHTTPError(400, "group: must be a string", param="group")
        split = data.get("split")
        if split is not None and (not isinstance(split, str) or not split):
            raise ProxyHTTPError(400, "split: must be a non-empty string", param="split")
        if split is not None and group is None:
            raise ProxyHTTPError(400, "split: a session joins a split only with a group (give both)", param="split")
        # a hand-opened session is traced, not trained, unless the request names its split and group
        claim = await proxy.store.open_session(task, group, split=split or TRACED_SPLIT)
        origin = proxy.config.public_url or f"{request.url.scheme}://{request.headers.get('host', request.url.netloc)}"
        token = claim.attempt.token
        return _ok(
            {
                "rollout_id": claim.rollout.rollout_id,
                "attempt_id": claim.attempt.attempt_id,
                "token": token,
                "base_url": f"{origin.rstrip('/')}/t/{token}/v1",
                "group": claim.rollout.group_id,
                "split": claim.rollout.split,
            }
        )

    async def list_rollouts(request: Request) -> Response:
        check_admin(request)
        q = request.query_params
        status: RolloutStatus | None = None
        if q.get("status"):
            try:
                status = RolloutStatus(q["status"])
            except ValueError as exc:
                valid = ", ".join(s.value for s in RolloutStatus)
                raise ProxyHTTPError(400, f"status: must be one of {valid}", param="status") from exc
        limit_text = q.get("limit", "100")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 1000:
            raise ProxyHTTPError(400, "limit: must be an integer from 1 to 1000", param="limit")
        try:
            rollouts, cursor = await proxy.store.list_rollouts(
                status=status, limit=int(limit_text), after=q.get("after")
            )
        except ConfigError as exc:  # the store's word for a cursor it did not issue
            raise ProxyHTTPError(400, f"after: {exc}", param="after") from exc
        return _ok({"rollouts": [rollout_json(r) for r in rollouts], "next": cursor})

    async def get_rollout(request: Request) -> Response:
        check_admin(request)
        detail = await proxy.store.get_rollout(request.path_params["rollout_id"])
        return _ok(rollout_detail_json(detail))

    token_routes: list[BaseRoute] = [
        Route("/lightning/v1/reward", reward, methods=["POST"]),
        Route("/lightning/v1/finish", finish, methods=["POST"]),
        Route("/lightning/v1/calls", attempt_calls, methods=["GET"]),
    ]
    if token_routes_only:
        return token_routes
    return [
        *token_routes,
        Route("/lightning/v1/sessions", sessions, methods=["POST"]),
        Route("/lightning/v1/rollouts", list_rollouts, methods=["GET"]),
        Route("/lightning/v1/rollouts/{rollout_id}", get_rollout, methods=["GET"]),
    ]
