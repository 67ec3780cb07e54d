"""The test cluster's port plan (``tests/support/ray_cluster.py``): a node's 100 worker ports never hold one of its
other ports (Ray refuses to start such a node; seen in CI with the object manager's port inside the range)."""

from __future__ import annotations

import pytest

from tests.support.ray_cluster import _worker_ports


def test_the_worker_range_holds_none_of_the_nodes_other_ports() -> None:
    # the CI failure: node manager 59787 put the range at 38700-38799, where the object manager's 38787 was
    taken = [59787, 38787, 58979, 42387, 43079, 50625, 56051, 58361]
    low = _worker_ports(taken)
    assert low >= 20000 and low + 99 <= 59999 and low % 100 == 0
    assert not any(low <= p <= low + 99 for p in taken)
    assert _worker_ports([59787, 20000]) == 38700  # clear: the range the first port picks, as before
    with pytest.raises(AssertionError, match="no 100-port worker range"):
        _worker_ports([20000 + 100 * k + 1 for k in range(400)])
