"""Shared fixtures: the rank-process pools of the multi-rank tests.

A multi-rank test writes its per-rank body as a module-level function and runs it with
the ``dist_run`` fixture::

    def _body(n):
        import sbpflow.distributed as sd
        return sd.get_rank() * n

    def test_something(dist_run):
        assert dist_run(4, _body, 10) == [0, 10, 20, 30]

One pool of real processes per world size (1, 2, 4; the 2x2 mesh uses 4) is started the
first time a test asks for it and reused until the session ends. ``SBPFLOW_TEST_TIMEOUT``
(seconds, default 120) bounds each call; the ranks' own collective timeout
(``SBPFLOW_TIMEOUT``) is 20 s; ``SBPFLOW_TEST_HEAP_CHECK=1`` runs the pools' ranks under
glibc's full heap checks. See ``_pool.py``.
"""

from __future__ import annotations

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _path in (_ROOT, _TESTS):  # sbpflow (not necessarily installed) and the test helpers
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _pool import DEFAULT_CALL_TIMEOUT_S, RankPool, close_pools, heap_check_env  # noqa: E402

#: ``SBPFLOW_TEST_HEAP_CHECK=1``: the pools' ranks run under glibc's full heap checks
#: (``_pool.heap_check_env``; about 1.6x slower): a write into a freed chunk aborts there.
HEAP_CHECK_ENV = "SBPFLOW_TEST_HEAP_CHECK"


def call_timeout() -> float:
    """Per-call timeout of ``dist_run`` (``SBPFLOW_TEST_TIMEOUT``, default 120 s)."""
    raw = os.environ.get("SBPFLOW_TEST_TIMEOUT", "")
    return float(raw) if raw.strip() else DEFAULT_CALL_TIMEOUT_S


class DistRunner:
    """``dist_run(world_size, fn, *args, timeout=None)`` -> list of per-rank results."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def pool(self, world_size: int) -> RankPool:
        """The session's pool for ``world_size`` (started on first use)."""
        pool = self._pools.get(world_size)
        if pool is None:
            env = heap_check_env() if os.environ.get(HEAP_CHECK_ENV) == "1" else None
            pool = self._pools[world_size] = RankPool(world_size, env=env)
        return pool

    def __call__(self, world_size: int, fn, *args, timeout: float | None = None) -> list:
        return self.pool(world_size).run(fn, *args,
                                         timeout=call_timeout() if timeout is None else timeout)

    def close(self) -> None:
        close_pools(list(self._pools.values()))
        self._pools.clear()


@pytest.fixture(scope="session")
def dist_pools():
    """The session's :class:`DistRunner` (pools per world size, closed at session end)."""
    runner = DistRunner()
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture
def dist_run(dist_pools) -> DistRunner:
    """Run a module-level function on every rank of a pooled world; see the module doc."""
    return dist_pools
