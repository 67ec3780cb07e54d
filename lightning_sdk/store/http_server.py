"""The store over HTTP: Starlette routes that serve any ``Store`` to ``HTTPStore`` clients.

Mount them where the daemon or proxy serves the store (the contract's place is ``/lightning/v1/store``)::

    app = Starlette(routes=[Mount("/lightning/v1/store", routes=store_routes(store, admin_key))])

Every route needs ``Authorization: Bearer <admin key>`` (401 otherwise). Errors use the OpenAI shape
``{"error": {"message", "type", "code"}}``: 400 for a malformed body or argument (the message names the field),
404 ``NotFoundError``, 409 ``InvalidTransitionError``, 503 ``StoreUnavailableError``, 500 anything else. Routes
(paths relative to the mount; bodies are the models of ``_wire``):

====== ================================ ===================================== ==========================
method path                             request                               response
====== ================================ ===================================== ==========================
POST   /enqueue                         EnqueueRequest                        GroupsBody
POST   /sessions                        OpenSessionRequest                    ClaimBody
POST   /claim                           ClaimRequest                          ClaimBody
GET    /attempts/{attempt_id}           -                                     AttemptBody
POST   /attempts/{attempt_id}/heartbeat HeartbeatRequest                      AttemptBody
POST   /attempts/{attempt_id}/finish    FinishRequest                         AttemptBody
POST   /leases/expire                   -                                     AttemptsBody
POST   /tokens/lookup                   TokenRequest                          MaybeAttemptBody
POST   /calls                           CallsBody                             OkBody
POST   /rewards                         RewardsBody                           OkBody
GET    /rollouts?status=&limit=&after=  -                                     RolloutPageBody
GET    /rollouts/{rollout_id}           -                                     RolloutDetailBody
GET    /rollout-details?limit=&after=   -                                     RolloutDetailPageBody
POST   /rollouts/{rollout_id}/cancel    -                                     RolloutBody
GET    /group-details?split&limit&after -                                     GroupDetailPageBody
GET    /counts                          -                                     CountsBody
GET    /groups/finished?limit=&split=   -                                     FinishedGroupsBody
POST   /groups/consume                  ConsumeRequest                        ConsumeBody
POST   /versions                        PolicyVersion                         OkBody
GET    /versions/current                -                                     VersionBody
PUT    /resources                       Resource                              OkBody
GET    /resources                       -                                     ResourcesBody
PUT    /meta/{key}                      MetaBody                              OkBody
GET    /meta/{key}                      -                                     MetaBody
====== ================================ ===================================== ==========================
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from lightning_sdk.errors import AuthError, ConfigError, LightningSDKError
from lightning_sdk.http_errors import bearer_token, error_headers
from lightning_sdk.store import _wire as w
from lightning_sdk.store.base import Store
from lightning_sdk.types import Attempt, AttemptStatus, PolicyVersion, Resource, RolloutStatus

__all__ = ["store_routes"]

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request], Awaitable[BaseModel]]
FinishFn = Callable[[str, AttemptStatus, str | None], Awaitable[Attempt]]
MAX_QUERY_LIMIT = 10_000
_OUT_OF_RANGE = "an integer in the request is out of range (the store keeps signed 64-bit integers)"


def _json(model: BaseModel, status: int = 200) -> Response:
    response = Response(w.dump(model), status_code=status, media_type="application/json")
    if status >= 400:
        response.raw_headers.extend(error_headers(status))
    return response


async def _body(request: Request, model: type[M]) -> M:
    """Parse the request body as ``model``; ``ConfigError`` naming the first bad field."""
    raw = await request.body()
    try:
        data = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"request body is not valid JSON: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise ConfigError(f"invalid field {field!r}: {first['msg']} ({exc.error_count()} error(s))") from exc


def _int_param(request: Request, name: str, default: int, *, low: int = 1, high: int = MAX_QUERY_LIMIT) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"invalid query parameter {name!r}: {raw!r} is not an integer") from None
    if not low <= value <= high:
        raise ConfigError(f"invalid query parameter {name!r}: {value} is not in [{low}, {high}]")
    return value


def store_routes(store: Store, admin_key: str, *, finish_attempt: FinishFn | None = None) -> list[BaseRoute]:
    """The store's HTTP routes over ``store``, guarded by ``admin_key`` (see the module docstring for the table).

    ``finish_attempt`` replaces ``store.finish_attempt`` behind ``POST /attempts/{id}/finish`` (the proxy passes its own
    barrier, so a store-side finish invalidates the attempt's token at once and waits for its calls in flight).
    """
    if not admin_key:
        raise ConfigError("store_routes: an admin key is required")
    expected = admin_key.encode()
    end_attempt: FinishFn = finish_attempt or store.finish_attempt

    def endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                given = (bearer_token(request.headers) or "").encode()
                if not hmac.compare_digest(given, expected):
                    raise AuthError("missing or wrong admin key (send 'Authorization: Bearer <admin key>')")
                try:
                    return _json(await handler(request))
                except OverflowError as exc:  # sqlite refuses ints beyond 64 bits: the request's fault
                    raise ConfigError(_OUT_OF_RANGE) from exc
            except LightningSDKError as exc:
                status, body = w.error_for(exc)
                if status >= 500:
                    logger.warning("store route %s %s failed: %s", request.method, request.url.path, exc)
                return _json(body, status)
            except Exception as exc:
                logger.exception("store route %s %s crashed", request.method, request.url.path)
                status, body = w.error_for(LightningSDKError(f"internal error: {type(exc).__name__}: {exc}"))
                return _json(body, status)

        return run

    # -- handlers ---------------------------------------------------------------------------------------------------
    async def enqueue(request: Request) -> BaseModel:
        b = await _body(request, w.EnqueueRequest)
        if b.max_attempts > 1000:
            raise ConfigError(f"invalid field 'max_attempts': {b.max_attempts} is over the limit of 1000")
        if len(b.tasks) * b.n > w.MAX_ENQUEUE_ROLLOUTS:
            raise ConfigError(
                f"invalid field 'n': {len(b.tasks)} tasks x n={b.n} rollouts is over the limit of "
                f"{w.MAX_ENQUEUE_ROLLOUTS} per request (send several requests)"
            )
        groups = await store.enqueue(b.tasks, n=b.n, max_attempts=b.max_attempts, split=b.split, group_ids=b.group_ids)
        return w.GroupsBody(groups=groups)

    async def sessions(request: Request) -> BaseModel:
        b = await _body(request, w.OpenSessionRequest)
        return w.ClaimBody(claim=await store.open_session(b.task, b.group_id, split=b.split))

    async def claim(request: Request) -> BaseModel:
        b = await _body(request, w.ClaimRequest)
        return w.ClaimBody(claim=await store.claim(b.worker_id, lease_s=b.lease_s, split=b.split))

    async def get_attempt(request: Request) -> BaseModel:
        return w.AttemptBody(attempt=await store.get_attempt(request.path_params["attempt_id"]))

    async def heartbeat(request: Request) -> BaseModel:
        b = await _body(request, w.HeartbeatRequest)
        return w.AttemptBody(attempt=await store.heartbeat(request.path_params["attempt_id"], lease_s=b.lease_s))

    async def finish(request: Request) -> BaseModel:
        b = await _body(request, w.FinishRequest)
        return w.AttemptBody(attempt=await end_attempt(request.path_params["attempt_id"], b.status, b.error))

    async def expire(request: Request) -> BaseModel:
        return w.AttemptsBody(attempts=await store.expire_leases())

    async def token_lookup(request: Request) -> BaseModel:
        b = await _body(request, w.TokenRequest)
        return w.MaybeAttemptBody(attempt=await store.attempt_by_token(b.token))

    async def calls(request: Request) -> BaseModel:
        await store.record_calls((await _body(request, w.CallsBody)).calls)
        return w.OkBody()

    async def rewards(request: Request) -> BaseModel:
        await store.record_rewards((await _body(request, w.RewardsBody)).rewards)
        return w.OkBody()

    async def list_rollouts(request: Request) -> BaseModel:
        raw_status = request.query_params.get("status") or None
        try:
            status = RolloutStatus(raw_status) if raw_status is not None else None
        except ValueError:
            allowed = ", ".join(s.value for s in RolloutStatus)
            raise ConfigError(f"invalid query parameter 'status': {raw_status!r} (one of {allowed})") from None
        after = request.query_params.get("after") or None
        page, nxt = await store.list_rollouts(status=status, limit=_int_param(request, "limit", 100), after=after)
        return w.RolloutPageBody(rollouts=page, next=nxt)

    async def list_details(request: Request) -> BaseModel:
        after = request.query_params.get("after") or None
        page, nxt = await store.list_rollout_details(limit=_int_param(request, "limit", 100), after=after)
        return w.RolloutDetailPageBody(details=page, next=nxt)

    async def get_rollout(request: Request) -> BaseModel:
        return w.RolloutDetailBody(detail=await store.get_rollout(request.path_params["rollout_id"]))

    async def cancel(request: Request) -> BaseModel:
        return w.RolloutBody(rollout=await store.cancel_rollout(request.path_params["rollout_id"]))

    async def group_details(request: Request) -> BaseModel:
        q = request.query_params
        page, nxt = await store.list_group_details(
            split=q.get("split") or None, limit=_int_param(request, "limit", 64), after=q.get("after") or None
        )
        groups = [w.FinishedGroupBody(group=g.group, rollouts=g.rollouts) for g in page]
        return w.GroupDetailPageBody(groups=groups, next=nxt)

    async def counts(request: Request) -> BaseModel:
        return w.CountsBody(counts=await store.counts())

    async def finished(request: Request) -> BaseModel:
        split = request.query_params.get("split") or "train"
        groups = await store.finished_groups(limit=_int_param(request, "limit", 64), split=split)
        return w.FinishedGroupsBody(groups=[w.FinishedGroupBody(group=g.group, rollouts=g.rollouts) for g in groups])

    async def consume(request: Request) -> BaseModel:
        b = await _body(request, w.ConsumeRequest)
        if not 0 <= b.step < 2**63:
            raise ConfigError(f"invalid field 'step': {b.step} is not in [0, 2^63)")
        return w.ConsumeBody(consumed=await store.consume_groups(b.step, b.group_ids))

    async def publish(request: Request) -> BaseModel:
        await store.publish_version(await _body(request, PolicyVersion))
        return w.OkBody()

    async def current(request: Request) -> BaseModel:
        return w.VersionBody(version=await store.current_version())

    async def set_resource(request: Request) -> BaseModel:
        await store.set_resource(await _body(request, Resource))
        return w.OkBody()

    async def get_resources(request: Request) -> BaseModel:
        return w.ResourcesBody(resources=await store.get_resources())

    async def set_meta(request: Request) -> BaseModel:
        await store.set_meta(request.path_params["key"], (await _body(request, w.MetaBody)).value)
        return w.OkBody()

    async def get_meta(request: Request) -> BaseModel:
        return w.MetaBody(value=await store.get_meta(request.path_params["key"]))

    table: list[tuple[str, str, Handler]] = [
        ("POST", "/enqueue", enqueue),
        ("POST", "/sessions", sessions),
        ("POST", "/claim", claim),
        ("GET", "/attempts/{attempt_id}", get_attempt),
        ("POST", "/attempts/{attempt_id}/heartbeat", heartbeat),
        ("POST", "/attempts/{attempt_id}/finish", finish),
        ("POST", "/leases/expire", expire),
        ("POST", "/tokens/lookup", token_lookup),
        ("POST", "/calls", calls),
        ("POST", "/rewards", rewards),
        ("GET", "/rollouts", list_rollouts),
        ("GET", "/rollouts/{rollout_id}", get_rollout),
        ("POST", "/rollouts/{rollout_id}/cancel", cancel),
        ("GET", "/rollout-details", list_details),
        ("GET", "/group-details", group_details),
        ("GET", "/counts", counts),
        ("GET", "/groups/finished", finished),
        ("POST", "/groups/consume", consume),
        ("POST", "/versions", publish),
        ("GET", "/versions/current", current),
        ("PUT", "/resources", set_resource),
        ("GET", "/resources", get_resources),
        ("PUT", "/meta/{key:path}", set_meta),
        ("GET", "/meta/{key:path}", get_meta),
    ]
    return [Route(path, endpoint(h), methods=[method], name=f"store_{h.__name__}") for method, path, h in table]
