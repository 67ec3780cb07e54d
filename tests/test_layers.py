"""The floors of the data path: a lower layer never imports a higher one (records/ and tokens/ are pure functions
over the data model; the store reads and writes it; the proxy and the trainer sit on top), checked two ways: the
import statements of every module (``FORBIDDEN``), and what a fresh interpreter really loads for an import (an agent
worker loads no server, no trainer and no torch)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import lightning_sdk

ROOT = Path(lightning_sdk.__file__).parent

#: folder -> the lightning_sdk packages it must not import
_TOP = ("app", "cli", "viewer", "cluster")
FORBIDDEN = {
    "records": ("store", "proxy", "trainer", "agent", "engines", "sandbox", "policy", *_TOP),
    "tokens": ("store", "proxy", "trainer", "agent", "engines", "records", "sandbox", *_TOP),
    "store": ("proxy", "trainer", "agent", "engines", "records", "sandbox", "tokens", *_TOP),
    "engines": ("proxy", "trainer", "agent", "store", "records", "sandbox", *_TOP),
    "sandbox": ("proxy", "trainer", "agent", "store", "records", "engines", "tokens", *_TOP),
    "trainer": ("app", "cli", "proxy"),
    "agent": ("proxy", "trainer", "engines", "records", "policy", *_TOP),
    "proxy": ("trainer", "agent", *_TOP),
    "http1.py": ("proxy", "agent", "store", "trainer", "engines", *_TOP),
    "viewer": ("app", "trainer", "cli", "proxy", "agent", "engines"),
}


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_lower_layers_do_not_import_higher_ones() -> None:
    bad = []
    for folder, banned in FORBIDDEN.items():
        paths = [ROOT / folder] if folder.endswith(".py") else sorted((ROOT / folder).rglob("*.py"))
        for path in paths:
            for module in _imports(path):
                parts = module.split(".")
                if parts[0] == "lightning_sdk" and len(parts) > 1 and parts[1] in banned:
                    bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert bad == []


def test_the_data_model_imports_only_errors() -> None:
    mods = {m for m in _imports(ROOT / "types.py") if m.startswith("lightning_sdk")}
    assert mods == {"lightning_sdk.errors"}


def _loaded_by(statement: str) -> set[str]:
    """The top-level packages and ``lightning_sdk`` subpackages a fresh interpreter has loaded after ``statement``."""
    code = (
        f"import sys; {statement}; "
        "print('\\n'.join(sorted({m if m.startswith('lightning_sdk.') else m.split('.')[0] for m in sys.modules})))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, timeout=120)
    return set(out.stdout.split())


def test_an_agent_worker_loads_no_server_and_no_trainer() -> None:
    """``import lightning_sdk`` / ``lightning_sdk.agent`` in an agent worker: the HTTP client and the store client,
    never the proxy server (starlette, uvicorn), the trainer, an engine or torch."""
    for statement in ("import lightning_sdk.agent", "import lightning_sdk"):
        loaded = _loaded_by(statement)
        assert "lightning_sdk.http1" in loaded or statement == "import lightning_sdk"
        banned = {"starlette", "uvicorn", "torch", "transformers", "litellm"}
        banned |= {m for m in loaded if m.startswith(("lightning_sdk.proxy", "lightning_sdk.trainer"))}
        banned |= {m for m in loaded if m.startswith(("lightning_sdk.engines", "lightning_sdk.app"))}
        assert loaded & banned == set(), statement
