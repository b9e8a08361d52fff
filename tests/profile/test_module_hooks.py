"""``Profiler.hook_module``: module sections through a wrapped forward.

A fake timer whose marks are consecutive integers makes every span's length a count
of the marks taken inside it, so the expected times are worked out by hand below.
"""

import warnings

import pytest
import torch
from torch import nn

from syncless.guard import no_sync
from syncless.profile import OFF, Profiler


class _Ticks:
    """Each mark is the next integer; one tick reads as 1 ms."""

    lagged = False

    def __init__(self) -> None:
        self.n = 0

    def mark(self) -> int:
        self.n += 1
        return self.n

    def mark_end(self, start: int) -> int:
        return self.mark()

    def elapsed_ns(self, a: int, b: int) -> float:
        return float(b - a) * 1e6

    def wait(self, token: int) -> None:
        pass

    def swap(self) -> None:
        pass


class _Leaf(nn.Module):
    def forward(self, x):
        return x + 1


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Leaf()

    def forward(self, x):
        return self.inner(x) * 2


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _Leaf()
        self.b = _Holder()

    def forward(self, x):
        return self.b(self.a(self.a(x)))


def _profiler(report_every: int = 10) -> Profiler:
    prof = Profiler(report_every=report_every, calibrate=False, cuda=False)
    prof._timer = _Ticks()  # before hook_module: the hooks bind the timer's mark
    return prof


def _hooked(prof) -> tuple[_Model, list]:
    return _hooked_model(prof, _Model())


def _hooked_model(prof, model: _Model) -> tuple[_Model, list]:
    handles = prof.hook_module(model.a, "a")
    handles += prof.hook_module(model.b, "b", category="bandwidth", bytes=1000)
    handles += prof.hook_module(model.b.inner, "c")
    return model, handles


def _assert_hand_computed_rows(rep) -> None:
    """Per step: a opens and closes twice back to back (1 tick each); b opens, c opens,
    c closes, b closes (b spans 3 ticks, c 1)."""
    assert rep.row("a").ms_per_step == pytest.approx(2.0)
    assert rep.row("a").calls_per_step == 2.0
    assert rep.row("b").ms_per_step == pytest.approx(3.0)
    assert rep.row("c").ms_per_step == pytest.approx(1.0)
    assert rep.row("c").depth == 1 and rep.row("b").depth == 0


def test_module_sections_time_calls_and_nesting_exactly():
    prof = _profiler(report_every=3)
    model, _ = _hooked(prof)
    x = torch.ones(4)
    for s in range(3):
        with no_sync(cpu_as_device=True), prof.step(s):
            model(x)
    rep = prof.report()
    _assert_hand_computed_rows(rep)
    assert rep.row("b").category == "bandwidth"
    assert rep.values["profile/b/calls_count"] == 1.0  # per step
    assert rep.row("b").gb_per_s == pytest.approx(1000 / (3.0 * 1e6))
    assert rep.values["profile/self/misuse_count"] == 0.0


def test_hooking_again_every_step_keeps_the_rows_exact():
    """As the benchmarks do: hooks put on before each step and removed after it."""
    prof = _profiler(report_every=3)
    model = _Model()
    x = torch.ones(4)
    for s in range(3):
        _, handles = _hooked_model(prof, model)
        with no_sync(cpu_as_device=True), prof.step(s):
            model(x)
        for h in handles:
            h.remove()
    rep = prof.report()
    _assert_hand_computed_rows(rep)
    assert rep.values["profile/self/misuse_count"] == 0.0


def test_module_sections_equal_begin_end_sections():
    """The short path records what begin_section/end_section in two hooks record."""

    def run(short: bool):
        prof = _profiler()
        model = _Model()
        for module, name in ((model.a, "a"), (model.b, "b"), (model.b.inner, "c")):
            if short:
                prof.hook_module(module, name)
            else:
                module.register_forward_pre_hook(lambda m, a, n=name: prof.begin_section(n))
                module.register_forward_hook(lambda m, a, o, n=name: prof.end_section(n))
        for s in range(4):
            with no_sync(cpu_as_device=True), prof.step(s):
                model(torch.ones(2))
                with prof.section("tail"):
                    model(torch.ones(2))
        rep = prof.report(force=True)
        return {r.name: (r.ms_per_step, r.calls_per_step, r.depth) for r in rep.rows}

    assert run(short=True) == run(short=False)


def test_counts_continue_in_the_next_report_window():
    prof = _profiler(report_every=2)
    model, _ = _hooked(prof)
    for s in range(4):
        with no_sync(cpu_as_device=True), prof.step(s):
            model(torch.ones(1))
            if s == 3:
                model(torch.ones(1))
        rep = prof.report()
        if s == 1:
            assert rep.row("a").calls_per_step == 2.0
    assert rep.row("a").calls_per_step == 3.0  # (2 + 4) calls over steps 2 and 3
    assert rep.row("b").ms_per_step == pytest.approx(4.5)  # (3 + 2 * 3) ticks / 2 steps


class _Recursive(nn.Module):
    def forward(self, x, depth: int = 1):
        return self(x + 1, depth - 1) if depth > 0 else x


def test_a_module_that_reenters_itself_gets_a_span_per_call():
    prof = _profiler()
    model = _Recursive()
    prof.hook_module(model, "r")
    for s in range(2):
        with no_sync(cpu_as_device=True), prof.step(s):
            model(torch.ones(1))
    rep = prof.report(force=True)
    # outer opens (1), inner opens (2), inner closes (3), outer closes (4): 3 + 1 ticks.
    assert rep.row("r").calls_per_step == 2.0
    assert rep.row("r").ms_per_step == pytest.approx(4.0)
    assert rep.values["profile/self/misuse_count"] == 0.0


def test_forward_outside_a_step_is_counted_not_raised():
    prof = _profiler()
    model, _ = _hooked(prof)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with no_sync(cpu_as_device=True):
            model(torch.ones(1))  # no open step
    with no_sync(cpu_as_device=True), prof.step(0):
        model(torch.ones(1))
    rep = prof.report(force=True)
    assert rep.values["profile/self/misuse_count"] >= 1.0
    assert rep.row("a").calls_per_step == 2.0  # the step's calls only
    assert rep.row("b").ms_per_step == pytest.approx(3.0)


def test_removed_hooks_and_off_leave_the_module_unhooked():
    prof = _profiler()
    model, handles = _hooked(prof)
    for h in handles:
        h.remove()
    for m in (model.a, model.b, model.b.inner):
        assert "forward" not in m.__dict__  # the class's forward again
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert OFF.hook_module(model.a, "a") == []
    assert "forward" not in model.a.__dict__


class _Raises(nn.Module):
    def forward(self, x):
        raise ValueError("boom")


def test_a_forward_that_raises_still_closes_its_section():
    prof = _profiler()
    model = _Raises()
    prof.hook_module(model, "r")
    with no_sync(cpu_as_device=True), prof.step(0), pytest.raises(ValueError, match="boom"):
        model(torch.ones(1))
    rep = prof.report(force=True)
    assert rep.row("r").calls_per_step == 1.0
    assert rep.row("r").ms_per_step == pytest.approx(1.0)  # its open and close marks
    assert rep.values["profile/self/misuse_count"] == 0.0  # nothing left open at the end


def test_other_hooks_on_the_module_run_outside_its_section():
    """A forward-pre-hook that takes a mark itself (a tick) is not inside the section."""
    prof = _profiler()
    model = _Leaf()
    prof.hook_module(model, "leaf")
    model.register_forward_pre_hook(lambda m, a: prof._timer.mark())
    with no_sync(cpu_as_device=True), prof.step(0):
        model(torch.ones(1))
    rep = prof.report(force=True)
    assert rep.row("leaf").ms_per_step == pytest.approx(1.0)  # the hook's tick is outside


def test_remove_restores_an_earlier_wrapper_and_leaves_a_later_one():
    prof = _profiler()
    model = _Leaf()
    calls: list[str] = []
    own = model.forward

    def earlier(x):
        calls.append("earlier")
        return own(x)

    model.forward = earlier
    (handle,) = prof.hook_module(model, "leaf")
    with no_sync(cpu_as_device=True), prof.step(0):
        out = model(torch.ones(1))
    assert torch.equal(out, torch.full((1,), 2.0))
    assert calls == ["earlier"]
    handle.remove()
    assert model.__dict__["forward"] is earlier  # put back as it was
    handle.remove()  # twice: nothing more
    (handle,) = prof.hook_module(model, "leaf")
    timed = model.__dict__["forward"]

    def later(x):
        return timed(x)

    model.forward = later  # someone wraps ours
    handle.remove()
    assert model.__dict__["forward"] is later  # theirs stays (and still calls ours)
