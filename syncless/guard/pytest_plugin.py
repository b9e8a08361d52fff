"""pytest plugin: a ``no_sync`` fixture and a ``@pytest.mark.no_sync`` marker.

Both guard the test *body* only (pytest's call phase), not fixture setup/teardown, so
fixtures can build models and read values freely. Registered through the ``pytest11``
entry point ``syncless``; without the installed package use ``-p
syncless.guard.pytest_plugin``. torch is imported lazily, on first use.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from syncless.guard.strict import NoSync

_GUARD = pytest.StashKey["NoSync"]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "no_sync(cpu_as_device=None): run the test body under syncless.guard.no_sync(); "
        "anything that would force a device-to-host sync raises SyncError",
    )


def _guard_for(item: pytest.Item) -> NoSync:
    guard = item.stash.get(_GUARD, None)
    if guard is None:
        from syncless.guard.strict import NoSync

        marker = item.get_closest_marker("no_sync")
        kwargs: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
        guard = NoSync(**kwargs)
        item.stash[_GUARD] = guard
    return guard


@pytest.fixture
def no_sync(request: pytest.FixtureRequest) -> NoSync:
    """The ``no_sync()`` guard that is active while the test body runs.

    Inspect ``no_sync.allowed`` after ``allow_sync`` blocks. Honours the marker's
    keyword arguments when the test also has ``@pytest.mark.no_sync(...)``.
    """
    return _guard_for(request.node)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    if _GUARD not in item.stash and item.get_closest_marker("no_sync") is None:
        return (yield)
    with _guard_for(item):
        return (yield)
