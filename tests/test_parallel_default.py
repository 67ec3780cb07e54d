"""The default selection runs on pytest-xdist workers; a long stage's selection runs in one process
(tests/conftest.py ``workers_for``, behind pyproject's ``-n auto``)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import workers_for

DEFAULT = "not slow and not harness and not real_cli and not vllm and not ray_cluster and not browser"


@pytest.mark.parametrize(
    ("markexpr", "cores", "workers"),
    [
        (DEFAULT, 2, 2),
        (DEFAULT, 1, 1),
        (DEFAULT, 16, 2),
        ("slow", 2, 0),
        ("vllm", 2, 0),
        ("real_cli", 2, 0),
        ("ray_cluster", 2, 0),
        ("harness or browser", 2, 0),
        ("not vllm", 2, 0),  # selects slow, harness... too
        ("", 2, 0),  # everything
        (DEFAULT.replace("not slow", "slow"), 2, 0),
        ("slow and acceptance", 2, 0),  # .ci/run's timed acceptance runs: alone, in one process
        ("slow and not acceptance", 2, 0),  # the other slow tests: .ci/run runs two such processes side by side
        ("acceptance", 2, 0),
    ],
)
def test_workers_for_a_selection(markexpr: str, cores: int, workers: int) -> None:
    assert workers_for(markexpr, cores) == workers


def test_this_session_is_distributed_as_its_selection_says(request: pytest.FixtureRequest) -> None:
    """On an xdist worker (the default command) the selection is one that distributes; in one process (``-n 0``, or
    a selection of a long stage) no worker id is set."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if hasattr(request.config, "workerinput"):  # an xdist worker
        assert worker is not None and worker.startswith("gw")
        assert workers_for(str(request.config.option.markexpr), os.cpu_count() or 1) > 0
    else:
        assert worker is None
