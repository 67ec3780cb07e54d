"""Two user folders that each have a ``tasks.py`` load in one process, each file seeing its own neighbour."""

from __future__ import annotations

from pathlib import Path

from lightning_sdk.agent import import_path


def _folder(root: Path, name: str, value: int) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "tasks.py").write_text(f"VALUE = {value}\n")
    (folder / "agent.py").write_text("from tasks import VALUE\n\nSEEN = VALUE\n")
    return folder


def test_same_named_neighbours_of_two_folders_do_not_mix(tmp_path: Path) -> None:
    first = _folder(tmp_path, "first", 1)
    second = _folder(tmp_path, "second", 2)
    assert import_path(first / "agent.py").SEEN == 1
    assert import_path(second / "agent.py").SEEN == 2
    assert import_path(second / "tasks.py").VALUE == 2
