"""Print which lightning_sdk packages each package imports (from the import statements, nothing is run).

    python scripts/layers.py            # package -> the packages it imports
    python scripts/layers.py --private  # also: imports of another package's private (_module) modules

docs/development.md ("Code layout") draws the floors this graph must keep; tests/test_layers.py and
tests/test_private_modules.py check them.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "lightning_sdk"


def graph() -> tuple[dict[str, set[str]], list[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    private: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        home = rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for mod in mods:
                parts = mod.split(".")
                if parts[0] != "lightning_sdk" or len(parts) < 2 or parts[1] == home:
                    continue
                edges[home].add(parts[1])
                if len(parts) > 2 and parts[2].startswith("_"):
                    private.append(f"{'/'.join(rel)} imports {mod}")
    return edges, private


def main() -> None:
    edges, private = graph()
    for pkg in sorted(edges):
        print(f"{pkg:13} -> {' '.join(sorted(edges[pkg]))}")
    if "--private" in sys.argv:
        print("\nimports of another package's private module:")
        print("\n".join(f"  {line}" for line in private) or "  none")


if __name__ == "__main__":
    main()
