"""``open_store(spec)``: one string (a CLI flag, a config value) names the store to use."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from lightning_sdk.errors import ConfigError
from lightning_sdk.store.base import Store
from lightning_sdk.store.http_client import HTTPStore
from lightning_sdk.store.memory import MemoryStore
from lightning_sdk.store.sqlite import SQLiteStore

__all__ = ["ADMIN_KEY_ENV", "open_store", "redact_url"]

ADMIN_KEY_ENV = "LIGHTNING_SDK_ADMIN_KEY"


def redact_url(spec: str | Path) -> str:
    """``spec`` as it may be shown (logs, messages): a URL's password is replaced by ``***``."""
    text = str(spec)
    if "://" not in text:
        return text
    parts = urlsplit(text)
    if not parts.password:
        return text
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


STORE_PATH = "/lightning/v1/store"


def store_url(url: str) -> str:
    """The store's URL from a daemon's or proxy's root URL (``http://HOST:PORT`` -> ``http://HOST:PORT/lightning/v1/
    store``) or from ``.../lightning/v1``; a URL already ending in ``/lightning/v1/store`` (or another path: a store
    mounted elsewhere) is kept."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    if path in ("", "/lightning/v1", "/lightning"):
        path = STORE_PATH
    return parts._replace(path=path).geturl()


def open_store(spec: str | Path, *, admin_key: str | None = None, timeout: float = 30.0, retries: int = 5) -> Store:
    """The store named by ``spec``.

    - ``"memory"``: a new ``MemoryStore``;
    - ``"http://..."`` / ``"https://..."``: an ``HTTPStore`` for the store served at that URL (the daemon's is
      ``http://HOST:PORT/lightning/v1/store``; its root URL ``http://HOST:PORT`` means the same), authorised by
      ``admin_key`` or ``$LIGHTNING_SDK_ADMIN_KEY``;
    - ``"postgresql://user[:password]@host[:port]/db"`` (or ``postgres://``; any libpq URL, e.g. ``?sslmode=require``):
      a ``PostgresStore`` on that database, which many processes share (the ``postgres`` extra: psycopg 3);
    - anything else: the path of a ``SQLiteStore`` file (created if missing).
    """
    text = str(spec).strip()
    if not text:
        raise ConfigError("store: an empty spec; give 'memory', an http(s) URL, a postgresql:// URL or a file path")
    if text == "memory":
        return MemoryStore()
    if text.startswith(("http://", "https://")):
        key = admin_key or os.environ.get(ADMIN_KEY_ENV)
        if not key:
            raise ConfigError(f"store {text}: an admin key is needed (pass admin_key or set ${ADMIN_KEY_ENV})")
        return HTTPStore(store_url(text), key, timeout=timeout, retries=retries)
    if text.startswith(("postgresql://", "postgres://")):
        try:
            from lightning_sdk.store.postgres import PostgresStore
        except ImportError as exc:
            raise ConfigError(
                f"store {redact_url(text)}: PostgreSQL needs psycopg 3 "
                f"(pip install 'lightning-rl-sdk[postgres]'): {exc}"
            ) from exc
        return PostgresStore(text, connect_timeout_s=timeout)
    return SQLiteStore(Path(text).expanduser())
