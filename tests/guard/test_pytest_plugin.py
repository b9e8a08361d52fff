"""The pytest plugin: ``no_sync`` fixture and ``@pytest.mark.no_sync`` marker."""

from __future__ import annotations

import importlib.metadata

import pytest

pytest_plugins = ["pytester"]

PLUGIN = "syncless.guard.pytest_plugin"


@pytest.fixture(autouse=True, scope="module")
def _warm_torch_in_the_outer_process() -> None:
    """Do torch's lazy imports here, not inside the in-process runs.

    The first op under a TorchDispatchMode imports torch._dynamo, and pytester's
    in-process runs drop the modules they imported; torch cannot import them a second
    time (their op libraries register once per process).
    """
    import torch

    from syncless.guard import census

    with census(cpu_as_device=True):
        torch.ones(2).mul(2).tolist()


def _plugin_args() -> tuple[str, ...]:
    """``-p`` the plugin unless the installed package already loads it by entry point.

    pytest refuses to register one module under two names (``syncless`` from the
    entry point and the module name from ``-p``), so passing both is an error.
    """
    for ep in importlib.metadata.entry_points(group="pytest11"):
        if ep.value == PLUGIN:
            return ()
    return ("-p", PLUGIN)


def _run(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest_inprocess(
        *_plugin_args(), "--strict-markers", "-p", "no:cacheprovider"
    )


def test_marker_raises_on_a_sync_in_the_test_body(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
        import pytest, torch

        @pytest.mark.no_sync(cpu_as_device=True)
        def test_reads_a_value():
            x = torch.ones(3)
            x.sum().item()

        def test_unmarked_is_free():
            assert torch.ones(3).sum().item() == 3.0
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*SyncError*Tensor.item*", "*test_inner.py:6 in test_reads_a_value*"]
    )


def test_marker_guards_the_body_not_the_fixtures(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
        import pytest, torch

        @pytest.fixture
        def value():
            t = torch.ones(2)
            yield t.sum().item()  # setup may sync
            t.tolist()            # and so may teardown

        @pytest.mark.no_sync(cpu_as_device=True)
        def test_body_is_clean(value):
            assert value == 2.0
        """,
    )
    result.assert_outcomes(passed=1)


def test_fixture_is_the_active_guard(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
        import pytest, torch
        from syncless.guard import NoSync, SyncError, allow_sync

        @pytest.mark.no_sync(cpu_as_device=True)
        def test_allowed_is_recorded(no_sync):
            assert isinstance(no_sync, NoSync)
            with allow_sync("read once for the assertion"):
                torch.ones(2).tolist()
            with pytest.raises(SyncError):
                torch.ones(2).cpu()
            assert [(a.reason, a.op) for a in no_sync.allowed] == [
                ("read once for the assertion", "Tensor.tolist")
            ]

        def test_fixture_alone_guards_the_body(no_sync):
            # Default cpu_as_device: CPU tensors count as device tensors only without CUDA.
            device = "cuda" if torch.cuda.is_available() else "cpu"
            with pytest.raises(SyncError):
                torch.nonzero(torch.ones(2, device=device))
        """,
    )
    result.assert_outcomes(passed=2)


def test_marker_is_registered_for_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess(*_plugin_args(), "--markers")
    result.stdout.fnmatch_lines(["*@pytest.mark.no_sync(cpu_as_device=None)*"])
