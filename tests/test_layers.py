"""The floors of the data path: a lower layer never imports a higher one (records/ and tokens/ are pure functions
over the data model; the store reads and writes it; the proxy and the trainer sit on top)."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_sdk

ROOT = Path(lightning_sdk.__file__).parent

#: folder -> the lightning_sdk packages it must not import
FORBIDDEN = {
    "records": ("store", "proxy", "trainer", "agent", "engines", "app"),
    "tokens": ("store", "proxy", "trainer", "agent", "engines", "records", "app"),
    "store": ("proxy", "trainer", "agent", "engines", "records", "app"),
    "trainer": ("app", "cli"),
    "agent": ("app", "trainer", "cli"),
    "proxy": ("app", "trainer", "cli"),
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
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in _imports(path):
                parts = module.split(".")
                if parts[0] == "lightning_sdk" and len(parts) > 1 and parts[1] in banned:
                    bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert bad == []


def test_the_data_model_imports_only_errors() -> None:
    mods = {m for m in _imports(ROOT / "types.py") if m.startswith("lightning_sdk")}
    assert mods == {"lightning_sdk.errors"}
