"""One exception tree: every exception class lightning_sdk defines derives from ``LightningSDKError``, and every
public one is drawn in ``lightning_sdk/errors.py``'s tree under the base it really has, found by walking every
module of the package (a new exception outside the tree, or drawn under the wrong base, fails here)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
from pathlib import Path

import lightning_sdk
import lightning_sdk.errors as errors
from lightning_sdk.errors import LightningSDKError, RunStopped, SandboxError, TrainerError, UpstreamError
from lightning_sdk.http1 import Http1ConnectError, Http1ReadTimeout
from lightning_sdk.proxy._errors import ProxyHTTPError, from_sdk_error

ROOT = Path(lightning_sdk.__file__).parent


def _module_names() -> list[str]:
    """Every module of the package, from its files: namespace folders (``engines/`` has no ``__init__``) and private
    modules (``sandbox/_base.py``) included, which ``pkgutil.walk_packages`` does not all reach."""
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("lightning_sdk", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] != "__main__":  # runs the CLI when imported
            names.append(".".join(parts))
    return names


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the package, by qualified name."""
    found: dict[str, type[BaseException]] = {}
    for name in _module_names():
        module = importlib.import_module(name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and issubclass(obj, BaseException):
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_the_walk_reaches_every_module() -> None:
    """The sandbox's private modules and the engines (a folder without ``__init__``) are walked too: the old walk
    (``pkgutil.walk_packages``) never imported ``lightning_sdk.engines.*``."""
    names = set(_module_names())
    assert {"lightning_sdk.sandbox._base", "lightning_sdk.sandbox._local", "lightning_sdk.sandbox._spec"} <= names
    assert {"lightning_sdk.engines.base", "lightning_sdk.engines.vllm", "lightning_sdk.engines.embedded"} <= names
    walked = {info.name for info in pkgutil.walk_packages(lightning_sdk.__path__, "lightning_sdk.")}
    assert "lightning_sdk.engines.base" not in walked  # why the walk goes by files
    _exception_classes()
    assert [name for name in names if name not in sys.modules] == []  # each one imported, its classes seen


def _drawn_tree() -> dict[str, str | None]:
    """The tree in errors.py's docstring: each class name -> the name it is drawn under (None for the root)."""
    assert errors.__doc__ is not None
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in errors.__doc__.splitlines():
        root = re.fullmatch(r"\s*(LightningSDKError)\s*", line)
        node = re.match(r"^(\s*(?:│\s*)*)[├└]── (\w+)", line)
        if root:
            parents[root.group(1)] = None
            stack = [(-1, root.group(1))]
        elif node and stack:
            depth = len(node.group(1))
            while stack and stack[-1][0] >= depth:
                stack.pop()
            parents[node.group(2)] = stack[-1][1]
            stack.append((depth, node.group(2)))
    return parents


def test_every_exception_class_is_in_the_tree() -> None:
    classes = _exception_classes()
    outside = [q for q, c in classes.items() if not issubclass(c, LightningSDKError)]
    assert outside == []
    assert "lightning_sdk.sandbox._base.SandboxError" not in classes  # defined once, in errors.py
    assert classes["lightning_sdk.errors.RunStopped"] is RunStopped and classes["lightning_sdk.errors.SandboxError"]


def _tree_problems(classes: dict[str, type[BaseException]], drawn: dict[str, str | None]) -> list[str]:
    """What the drawn tree gets wrong about ``classes``: public ones missing, or drawn under another base."""
    public = {c.__name__: c for c in classes.values() if not c.__name__.startswith("_")}
    problems = [f"{name}: not drawn in lightning_sdk/errors.py's tree" for name in sorted(set(public) - set(drawn))]
    problems += [f"{name}: drawn, but the package defines no such class" for name in sorted(set(drawn) - set(public))]
    for name, cls in public.items():
        if cls is LightningSDKError or name not in drawn:
            continue
        bases = [b.__name__ for b in cls.__bases__ if issubclass(b, LightningSDKError)]
        if drawn[name] not in bases:
            problems.append(f"{name}: drawn under {drawn[name]}, derives from {bases}")
    return problems


def test_every_public_exception_is_drawn_under_its_base() -> None:
    assert _tree_problems(_exception_classes(), _drawn_tree()) == []


def test_the_tree_check_fails_on_an_exception_outside_it() -> None:
    """The check reports a public exception drawn nowhere, and one drawn under a base it does not have."""
    drawn = _drawn_tree()
    assert drawn["RunStopped"] == "TrainerError" and drawn["SandboxError"] == "LightningSDKError"
    assert drawn["Http1ConnectError"] == "Http1Error" and drawn["Http1Error"] == "UpstreamError"
    assert RunStopped(3).step == 3 and "step 3" in str(RunStopped(3))

    class StrayError(TrainerError):
        pass

    classes = _exception_classes()
    assert _tree_problems({**classes, "x.StrayError": StrayError}, drawn) == [
        "StrayError: not drawn in lightning_sdk/errors.py's tree"
    ]
    assert _tree_problems(classes, {**drawn, "RunStopped": "EngineError"}) == [
        "RunStopped: drawn under EngineError, derives from ['TrainerError']"
    ]


def test_the_old_import_places_still_give_the_same_classes() -> None:
    from lightning_sdk.app import RunStopped as from_app
    from lightning_sdk.sandbox import SandboxError as from_sandbox

    assert from_app is RunStopped and from_sandbox is SandboxError


def test_transport_errors_are_upstream_errors_and_answers_pass_through() -> None:
    assert issubclass(Http1ConnectError, UpstreamError) and Http1ConnectError("refused").status_code == 502
    assert Http1ReadTimeout("silent").status_code == 504
    answer = ProxyHTTPError(400, "bad temperature", param="temperature")
    assert from_sdk_error(answer) is answer  # already an answer: its status and param stay
