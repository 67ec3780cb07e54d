"""One exception tree: every exception class lightning_sdk defines derives from ``LightningSDKError``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import lightning_sdk
from lightning_sdk.errors import LightningSDKError, UpstreamError
from lightning_sdk.http1 import Http1ConnectError, Http1ReadTimeout
from lightning_sdk.proxy.errors import ProxyHTTPError, from_sdk_error


def test_every_exception_class_is_in_the_tree() -> None:
    outside = []
    for info in pkgutil.walk_packages(lightning_sdk.__path__, "lightning_sdk."):
        if ".sandbox" in info.name or info.name.endswith(("_cpu_platform", "__main__")):
            continue  # platform-specific modules (Linux namespaces, verl's CPU platform) import on use
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            mine = inspect.isclass(obj) and obj.__module__ == module.__name__
            if mine and issubclass(obj, BaseException) and not issubclass(obj, LightningSDKError):
                outside.append(f"{module.__name__}.{name}")
    assert outside == []


def test_transport_errors_are_upstream_errors_and_answers_pass_through() -> None:
    assert issubclass(Http1ConnectError, UpstreamError) and Http1ConnectError("refused").status_code == 502
    assert Http1ReadTimeout("silent").status_code == 504
    answer = ProxyHTTPError(400, "bad temperature", param="temperature")
    assert from_sdk_error(answer) is answer  # already an answer: its status and param stay
