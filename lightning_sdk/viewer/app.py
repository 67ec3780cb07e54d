"""The run viewer's ASGI app: server-rendered pages (jinja2) and the same data as JSON, read-only.

Routes (relative to where it is served: ``/`` by ``lightning-sdk view``, ``/lightning/v1/ui`` on the daemon)::

    GET /                     overview: reward and held-out curves (inline SVG), steps (loss, staleness, learner wait)
    GET /rollouts             the rollouts table: ?split=&group=&status=&reward_min=&reward_max=&after=CURSOR
    GET /rollouts/{id}        one rollout: calls as a conversation, records as tokens (?page=CURSOR: its group's page)
    GET /fidelity             the fidelity report: splits and reasons, failed calls, truncated segments
    GET /api/overview | /api/rollouts | /api/rollouts/{id} | /api/fidelity     the same, as JSON
    GET /static/viewer.js, /static/viewer.css

A bad filter answers 400 in the OpenAI error shape naming the parameter; an unknown rollout 404. ``admin_key``
(the daemon's) guards every route: ``Authorization: Bearer KEY``, or ``?key=KEY`` once in a browser, which sets an
HttpOnly cookie for the viewer's path and redirects to the same page without the key.
"""

from __future__ import annotations

import hmac
import math
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import orjson
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from lightning_sdk.errors import ConfigError, LightningSDKError, NotFoundError
from lightning_sdk.http_errors import bearer_token, error_body, error_fields
from lightning_sdk.viewer.data import RolloutFilter, RunData, status_filter

__all__ = ["COOKIE", "create_viewer_app", "svg_curves"]

COOKIE = "lightning_sdk_admin"
_STATIC = Path(__file__).parent / "static"
_COLORS = ("#2563eb", "#16a34a", "#9333ea", "#ea580c", "#0891b2")


def svg_curves(
    series: list[tuple[str, list[tuple[float, float]]]],
    *,
    lines: list[tuple[str, float]] = (),  # type: ignore[assignment]
    width: int = 640,
    height: int = 220,
    y_range: tuple[float, float] | None = None,
    empty: str = "no steps yet",
) -> Markup:
    """Line charts as inline SVG (no script needed): ``series`` of (label, [(x, y)]), ``lines`` horizontal
    (label, y). Each point carries a ``<title>`` with its value (the browser shows it on hover)."""
    pts = [p for _, s in series for p in s if math.isfinite(p[1])]
    if not pts:
        return Markup(f'<p class="empty">{escape(empty)}</p>')
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts] + [y for _, y in lines]
    x0, x1 = min(xs), max(xs)
    y0, y1 = y_range if y_range is not None else (min(ys), max(ys))
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad_l, pad_r, pad_t, pad_b = 44, 8, 8, 24

    def sx(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)

    def sy(y: float) -> float:
        return pad_t + (1 - (y - y0) / (y1 - y0)) * (height - pad_t - pad_b)

    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}">']
    parts.append(f'<line class="axis" x1="{pad_l}" y1="{sy(y0):.1f}" x2="{width - pad_r}" y2="{sy(y0):.1f}"/>')
    for v in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<text class="tick" x="{pad_l - 4}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    parts.append(f'<text class="tick" x="{pad_l}" y="{height - 6}">{x0:g}</text>')
    parts.append(f'<text class="tick" x="{width - pad_r}" y="{height - 6}" text-anchor="end">{x1:g}</text>')
    legend = []
    for i, (label, y) in enumerate(lines):
        color = _COLORS[(len(series) + i) % len(_COLORS)]
        parts.append(
            f'<line class="hline" stroke="{color}" x1="{pad_l}" x2="{width - pad_r}" y1="{sy(y):.1f}" '
            f'y2="{sy(y):.1f}"><title>{escape(label)}: {y:.4g}</title></line>'
        )
        legend.append((label, color))
    for i, (label, s) in enumerate(series):
        color = _COLORS[i % len(_COLORS)]
        good = [(x, y) for x, y in s if math.isfinite(y)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"/>')
        for x, y in good:
            parts.append(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}" data-series="{escape(label)}" '
                f'data-x="{x:g}" data-y="{y:.6g}"><title>{escape(label)} at {x:g}: {y:.4g}</title></circle>'
            )
        legend.append((label, color))
    parts.append("</svg>")
    keys = "".join(f'<span class="key"><i style="background:{c}"></i>{escape(label)}</span>' for label, c in legend)
    return Markup("".join(parts) + f'<div class="legend">{keys}</div>')


def _fmt(value: Any, spec: str = ".4g") -> str:
    """A number for a page: ``-`` when missing (a step without a loss, a rollout without a reward)."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _unit_range(values: list[float]) -> tuple[float, float]:
    """[0, 1] (rates and most rewards), widened to hold every value."""
    good = [v for v in values if math.isfinite(v)]
    return (min([0.0, *good]), max([1.0, *good]))


def _num(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) else math.nan


def _error(exc: LightningSDKError, param: str | None = None) -> Response:
    status, kind, code = error_fields(exc)
    return Response(
        error_body(str(exc), kind, param=param, code=code), status_code=status, media_type="application/json"
    )


def _float_param(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise _BadParam(name, f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise _BadParam(name, f"{name} must be a finite number, got {raw!r}")
    return value


class _BadParam(ConfigError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _filters(request: Request) -> RolloutFilter:
    q = request.query_params
    try:
        status = status_filter(q.get("status"))
    except ConfigError as exc:
        raise _BadParam("status", str(exc)) from None
    return RolloutFilter(
        split=q.get("split") or None,
        group=q.get("group") or None,
        status=status,
        reward_min=_float_param(request, "reward_min"),
        reward_max=_float_param(request, "reward_max"),
    )


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit", "50")
    if not raw.isdigit() or not 1 <= int(raw) <= 500:
        raise _BadParam("limit", f"limit must be an integer in [1, 500], got {raw!r}")
    return int(raw)


class _AdminGuard:
    """Every request needs the admin key: a bearer header, the viewer's cookie, or ``?key=`` (sets the cookie)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key

    def _ok(self, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(value.encode(), self.key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        if self._ok(bearer_token(scope["headers"])) or self._ok(request.cookies.get(COOKIE)):
            await self.app(scope, receive, send)
            return
        if self._ok(request.query_params.get("key")):
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "key"]
            base = str(scope.get("root_path", "")) + scope["path"][len(str(scope.get("root_path", ""))) :]
            target = base + (f"?{urlencode(rest)}" if rest else "")
            response: Response = RedirectResponse(target, status_code=303)
            response.set_cookie(
                COOKIE, self.key, httponly=True, samesite="strict", path=str(scope.get("root_path") or "/")
            )
            await response(scope, receive, send)
            return
        body = error_body(
            "the run viewer needs the admin key (Authorization: Bearer KEY, or ?key=KEY)", "authentication_error"
        )
        await Response(body, status_code=401, media_type="application/json")(scope, receive, send)


def create_viewer_app(data: RunData, *, admin_key: str | None = None) -> ASGIApp:
    """The viewer over ``data`` (a run directory and its store); behind ``admin_key`` when given."""
    env = Environment(loader=PackageLoader("lightning_sdk.viewer", "templates"), autoescape=select_autoescape())
    env.filters["fmt"] = _fmt

    def page(request: Request, name: str, **ctx: Any) -> HTMLResponse:
        base = str(request.scope.get("root_path", "")).rstrip("/")
        html = env.get_template(name).render(base=base, request=request, **ctx)
        return HTMLResponse(html)

    def json(data_: Any, status: int = 200) -> Response:
        return Response(orjson.dumps(data_, default=str), status_code=status, media_type="application/json")

    def guarded(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                result: Response = await handler(request)
                return result
            except _BadParam as exc:
                return _error(exc, exc.param)
            except NotFoundError as exc:
                return _error(exc)
            except LightningSDKError as exc:
                return _error(exc)

        return endpoint

    async def overview_page(request: Request) -> Response:
        ov = data.overview()
        steps = ov["steps"]
        reward = svg_curves(
            [
                ("train reward", [(r["step"], _num(r, "reward_mean")) for r in steps]),
                ("train success", [(r["step"], _num(r, "success_rate")) for r in steps]),
            ],
            lines=[(f"held-out {h['label']}", float(h["success_rate"])) for h in ov["heldout"]],
            y_range=_unit_range([_num(r, k) for r in steps for k in ("reward_mean", "success_rate")]),
        )
        checks = [(c.get("step", i), _num(c, "success_rate")) for i, c in enumerate(ov["checks"])]
        heldout = svg_curves([("held-out success (checks)", checks)]) if checks else None
        loss = svg_curves(
            [("loss", [(r["step"], _num(r, "loss")) for r in steps if "loss" in r])],
            empty="no loss recorded (no step trained records yet)",
        )
        timing = svg_curves(
            [
                ("learner wait s", [(r["step"], _num(r, "wait_s")) for r in steps]),
                ("staleness mean", [(r["step"], _num(r, "staleness_mean")) for r in steps]),
            ]
        )
        return page(request, "overview.html", ov=ov, reward=reward, heldout=heldout, loss=loss, timing=timing)

    async def overview_api(request: Request) -> Response:
        return json(data.overview())

    async def read_rollouts(request: Request, filters: RolloutFilter) -> dict[str, Any]:
        try:
            return await data.rollouts_page(filters, request.query_params.get("after") or None, limit=_limit(request))
        except _BadParam:
            raise
        except ConfigError as exc:  # a cursor that is not one of this table's
            raise _BadParam("after", str(exc)) from None

    async def rollouts_page(request: Request) -> Response:
        filters = _filters(request)
        result = await read_rollouts(request, filters)
        q = {k: v for k, v in request.query_params.items() if k != "after" and v}
        more = urlencode({**q, "after": result["next"]}) if result["next"] else None
        return page(request, "rollouts.html", result=result, filters=filters, q=q, more=more)

    async def rollouts_api(request: Request) -> Response:
        return json(await read_rollouts(request, _filters(request)))

    async def rollout_page(request: Request) -> Response:
        detail = await data.rollout(request.path_params["rollout_id"], request.query_params.get("page"))
        return page(request, "rollout.html", r=detail)

    async def rollout_api(request: Request) -> Response:
        return json(await data.rollout(request.path_params["rollout_id"], request.query_params.get("page")))

    async def fidelity_page(request: Request) -> Response:
        return page(request, "fidelity.html", f=await data.fidelity())

    async def fidelity_api(request: Request) -> Response:
        return json(await data.fidelity())

    app = Starlette(
        routes=[
            Route("/", guarded(overview_page)),
            Route("/rollouts", guarded(rollouts_page)),
            Route("/rollouts/{rollout_id}", guarded(rollout_page)),
            Route("/fidelity", guarded(fidelity_page)),
            Route("/api/overview", guarded(overview_api)),
            Route("/api/rollouts", guarded(rollouts_api)),
            Route("/api/rollouts/{rollout_id}", guarded(rollout_api)),
            Route("/api/fidelity", guarded(fidelity_api)),
            Mount("/static", StaticFiles(directory=str(_STATIC)), name="static"),
        ]
    )
    return _AdminGuard(app, admin_key) if admin_key else app
