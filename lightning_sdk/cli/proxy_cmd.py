"""``lightning-sdk proxy``: the tracing proxy alone, in front of any OpenAI-compatible server.

::

    lightning-sdk proxy --upstream http://127.0.0.1:8000/v1 --store traces.db [--host 127.0.0.1] [--port 4700]
                        [--admin-key KEY] [--policy-model NAME] [--upstream-model NAME] [--max-body-bytes N]
                        [--tokenizer DIR]

Agents point ``base_url`` at ``http://HOST:PORT/v1`` with an attempt token as their API key (open one with
``POST /lightning/v1/sessions`` and the admin key). The admin key comes from ``--admin-key``, else
``$LIGHTNING_SDK_ADMIN_KEY``, else a new one is generated and printed.

``--tokenizer DIR`` (the policy's Hugging Face tokenizer directory, with its chat template) is the fallback for an
upstream that answers with text only (no ``return_token_ids``): such calls get their ids rebuilt with the policy
template and recorded with ``token_source="retokenized"`` and the retokenization checks (never silently). Without
it, such calls are recorded with empty ids and ``checks["missing_token_ids"]``.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlparse

import typer

from lightning_sdk.cli._app import app
from lightning_sdk.errors import LightningSDKError
from lightning_sdk.store import ADMIN_KEY_ENV, redact_url

if TYPE_CHECKING:
    from lightning_sdk.tokens import ChatRenderer

__all__ = ["proxy"]


_STORE_HELP = (
    "Store: a SQLite file path (created if missing), a postgresql://USER@HOST:PORT/DB URL (one store many proxies "
    "share: docs/scale-out.md), or a daemon's http(s) store URL."
)


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code=2)


def _check_upstream(upstream: str, auth: str | None) -> None:
    """Fail early and clearly when ``--upstream`` is not an http(s) base URL, or is up and has no ``/models``.

    An upstream that is not reachable yet is fine: the proxy starts, waits for it and answers 503 meanwhile.
    """
    import httpx

    from lightning_sdk.proxy.passthrough import split_credentials

    shown, _ = split_credentials(upstream)
    parsed = urlparse(upstream)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise _fail(f"--upstream {shown!r} is not an http(s) URL (expected e.g. http://127.0.0.1:8000/v1)")
    headers = {"Authorization": auth} if auth else {}
    try:
        r = httpx.get(shown.rstrip("/") + "/models", headers=headers, timeout=5.0)
    except httpx.HTTPError as exc:
        typer.secho(f"upstream {shown} is not reachable yet ({type(exc).__name__}): waiting for it", err=True)
        return
    if r.status_code == 404:
        raise _fail(f"upstream {shown} has no /models: is the URL the server's base URL ending in /v1?")
    if r.status_code >= 400:
        typer.secho(f"warning: upstream GET /models answered {r.status_code}", err=True, fg=typer.colors.YELLOW)


def _check_port(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise _fail(f"--port {port} is not a TCP port (1-65535)")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise _fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _load_renderer(path: str) -> ChatRenderer:
    """The policy's tokenizer + chat template from ``--tokenizer`` (clear errors, no traceback)."""
    from lightning_sdk.tokens import ChatRenderer

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise _fail(f"--tokenizer {path}: not a directory (expected a Hugging Face tokenizer folder)")
    try:
        return ChatRenderer.from_pretrained(folder)
    except LightningSDKError as exc:
        raise _fail(f"--tokenizer {path}: {exc}") from None


@app.command("proxy")
def proxy(
    upstream: Annotated[str, typer.Option(help="Base URL of the OpenAI-compatible server, ending in /v1.")],
    store: Annotated[str, typer.Option(help=_STORE_HELP)],
    host: Annotated[str, typer.Option(help="Interface to bind (127.0.0.1 unless you mean it).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 4700,
    admin_key: Annotated[
        str | None, typer.Option(help=f"Admin key (default: ${ADMIN_KEY_ENV}, else generated and printed).")
    ] = None,
    policy_model: Annotated[
        list[str] | None,
        typer.Option(help="Model name(s) that mean the policy (repeatable); default: any name."),
    ] = None,
    upstream_model: Annotated[
        str | None, typer.Option(help="Model name sent upstream (when agents use another name).")
    ] = None,
    upstream_api_key: Annotated[
        str | None, typer.Option(help="Bearer key for the upstream (default: $OPENAI_API_KEY if set).")
    ] = None,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body accepted (413 above).")] = 32 * 1024 * 1024,
    token_ids: Annotated[
        bool, typer.Option(help="Ask the upstream for token ids (vLLM return_token_ids) and logprobs.")
    ] = True,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the upstream's next bytes (504 after).")] = 600.0,
    retries: Annotated[int, typer.Option(help="Retries on connection errors, 429 and 5xx (then 502).")] = 3,
    read_timeout: Annotated[
        float, typer.Option(help="Seconds an incomplete request (partial body) may stay silent before 408.")
    ] = 30.0,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="The policy's HF tokenizer dir (with chat template): rebuild ids of text-only replies (retokenized)."
        ),
    ] = None,
) -> None:
    """Trace an OpenAI-compatible server: every call through the proxy is recorded in the store."""
    from lightning_sdk.proxy import (
        PassthroughBackend,
        PassthroughConfig,
        PolicyBackend,
        ProxyConfig,
        create_app,
        serve,
    )
    from lightning_sdk.store import open_store

    if max_body_bytes < 1024:
        raise _fail("--max-body-bytes must be at least 1024")
    if retries < 0 or timeout <= 0 or read_timeout <= 0:
        raise _fail("--retries must be >= 0, --timeout and --read-timeout > 0")
    from lightning_sdk.proxy.passthrough import split_credentials

    shown_upstream, basic = split_credentials(upstream)
    key = upstream_api_key or (None if basic else os.environ.get("OPENAI_API_KEY")) or None
    renderer = _load_renderer(tokenizer) if tokenizer is not None else None
    _check_upstream(upstream, f"Bearer {key}" if key else basic)
    if basic is not None and key is not None:
        raise _fail("--upstream carries user:password and an upstream API key is set: give one of them")
    _check_port(host, port)
    admin = admin_key or os.environ.get(ADMIN_KEY_ENV)
    if not admin:
        admin = secrets.token_urlsafe(24)
        typer.echo(f"admin key (generated): {admin}")
    if "://" not in store:
        parent = Path(store).expanduser().resolve().parent
        if not parent.is_dir():
            raise _fail(f"--store {store}: folder {parent} does not exist")
    try:
        the_store = open_store(store, admin_key=admin)
    except LightningSDKError as exc:
        raise _fail(f"--store {redact_url(store)}: {exc}") from None
    backend: PolicyBackend = PassthroughBackend(
        PassthroughConfig(
            upstream=upstream,
            api_key=key,
            model=upstream_model,
            request_token_ids=token_ids,
            request_logprobs=token_ids,
            max_retries=retries,
            timeout_s=timeout,
        )
    )
    if renderer is not None:
        from lightning_sdk.proxy.token_mode import RetokenizingBackend

        backend = RetokenizingBackend(backend, renderer)
    config = ProxyConfig(
        policy_models=policy_model or None,
        max_body_bytes=max_body_bytes,
        call_timeout_s=timeout,
        read_timeout_s=read_timeout,
    )
    from lightning_sdk.telemetry import open_telemetry
    from lightning_sdk.telemetry.observer import SpanObserver

    try:
        telemetry = open_telemetry()  # OTEL_EXPORTER_OTLP_ENDPOINT / _PROTOCOL; None (off) when unset
    except LightningSDKError as exc:
        raise _fail(str(exc)) from None
    observers = [SpanObserver(telemetry)] if telemetry is not None else []
    application = create_app(
        the_store, policy_backend=backend, admin_key=admin, config=config, close_store=True, observers=observers
    )
    retok = f", retokenizing text-only replies with {tokenizer}" if renderer is not None else ""
    typer.echo(f"tracing proxy on http://{host}:{port}/v1 -> {shown_upstream} (store: {redact_url(store)}){retok}")
    typer.echo("calls get 503 + Retry-After until the upstream answers (state: GET /lightning/v1/health)")
    typer.echo(
        f"open a session: POST http://{host}:{port}/lightning/v1/sessions with 'Authorization: Bearer <admin key>'"
    )
    try:
        serve(application, host=host, port=port)
    finally:
        if telemetry is not None:
            telemetry.shutdown()  # export the spans still queued
