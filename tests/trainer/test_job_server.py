"""The job's proxy (``app/server.py``): bound first on a socket of ``lightning_sdk/listen.py``, served as one context.

Real parts: the tiny policy in an ``EmbeddedEngine``, a SQLite store, uvicorn on loopback, httpx as the client."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import httpx
import pytest

from lightning_sdk.app.server import ProxyServer
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.errors import ConfigError
from lightning_sdk.listen import bind_socket, socket_url
from lightning_sdk.policy.model import load_policy
from lightning_sdk.store import open_store
from tests.trainer.tiny import build_small_policy


def test_a_busy_or_bad_port_is_a_config_error_before_anything_is_built() -> None:
    held = bind_socket("127.0.0.1", 0)
    try:
        port = int(held.getsockname()[1])
        held.listen()
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_socket("127.0.0.1", port)
        with pytest.raises(ConfigError, match="not a TCP port"):
            bind_socket("127.0.0.1", 70000)
        assert socket_url(held, "127.0.0.1") == f"http://127.0.0.1:{port}"
    finally:
        held.close()


def test_serving_answers_inside_the_context_and_stops_and_frees_the_port_on_exit_or_error(tmp_path: Path) -> None:
    model, tokenizer = load_policy(build_small_policy(tmp_path / "tiny"))

    async def main() -> None:
        engine = EmbeddedEngine(model, tokenizer, max_batch_size=2)
        store = open_store(tmp_path / "store.db")
        try:
            for fail in (False, True):
                sock = bind_socket("127.0.0.1", 0)
                server = ProxyServer(sock, "127.0.0.1")
                url = server.url
                assert url == socket_url(sock, "127.0.0.1")
                with pytest.raises(RuntimeError, match="inside") if fail else _nothing():
                    async with server.serving(store, engine, tokenizer, admin_key="k", sampling=None):
                        async with httpx.AsyncClient() as http:
                            health = await http.get(url + "/lightning/v1/health")
                            assert health.status_code == 200
                            models = await http.get(url + "/v1/models")
                            assert [m["id"] for m in models.json()["data"]] == ["policy"]
                        if fail:
                            raise RuntimeError("inside")
                published = {r.name: r.base_url for r in await store.get_resources()}
                assert published["policy"] == url + "/v1"
                assert server.url == url  # readable after the socket closed
                assert sock.fileno() == -1
                async with httpx.AsyncClient() as http:
                    with pytest.raises(httpx.ConnectError):
                        await http.get(url + "/lightning/v1/health")
                again = socket.socket()  # the port is free again
                again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                again.bind(("127.0.0.1", server.port))
                again.close()
        finally:
            await engine.close()
            await store.close()

    asyncio.run(main())


_nothing = contextlib.nullcontext
