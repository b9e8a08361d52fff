"""Single process: sums, exact call counts, no syncs in the step, off mode, misuse."""

import time
import warnings

import pytest
import torch

from syncless.guard import no_sync
from syncless.profile import OFF, NullProfiler, ProfileMisuse, Profiler
from syncless.report.nesting import parents, positions
from syncless.run.records import check_metric_name


def test_sections_add_up_to_the_step_and_calls_are_exact():
    prof = Profiler(report_every=3)
    for s in range(3):
        with prof.step(s):
            for _ in range(3):
                with prof.section("a"):
                    time.sleep(0.001)
            with prof.section("b", "bandwidth", bytes=4096):
                time.sleep(0.002)
                with prof.section("b_inner"):
                    pass
    rep = prof.report()
    step = rep.row("step").ms_per_step
    top = rep.row("a").ms_per_step + rep.row("b").ms_per_step
    # Stated tolerance: the top-level sections cover the step except the profiler's own
    # bookkeeping between them: at most 10% of the step or 1 ms, never more than it.
    assert top <= step
    assert step - top <= max(0.1 * step, 1.0)
    assert rep.row("a").calls_per_step == 3.0
    assert rep.row("b").calls_per_step == 1.0
    assert rep.row("b_inner").calls_per_step == 1.0 and rep.row("b_inner").depth == 1
    assert rep.row("step").calls_per_step == 1.0
    assert rep.values["profile/a/calls_count"] == 3.0
    b = rep.row("b")
    assert b.gb_per_s == pytest.approx(4096 / (b.ms_per_step * 1e6))
    assert rep.values["profile/self/host_ms"] >= 0.0
    assert rep.values["profile/self/misuse_count"] == 0.0
    for rec in rep:
        check_metric_name(rec.name)
        assert rec.step == 2 and rec.rank == 0
    assert len(rep) == len(rep.values)


def test_report_every_and_window_reset():
    prof = Profiler(report_every=2, calibrate=False)
    with prof.step(0):
        pass
    assert prof.report() is None
    with prof.step(1), prof.section("x"):
        pass
    rep = prof.report()
    assert rep is not None and rep.steps == 2
    assert rep.row("x").calls_per_step == 0.5
    with prof.step(2):
        pass
    assert prof.report() is None
    rep = prof.report(force=True)
    assert rep.steps == 1 and rep.row("x").calls_per_step == 0.0


def test_events_mode_step_body_does_not_sync():
    prof = Profiler(report_every=2)
    x = torch.arange(8.0)

    @prof.section_fn("opt")
    def opt(t):
        return t.mul_(0.5)

    for s in range(2):
        # no_sync raises on any host read of a tensor
        with no_sync(cpu_as_device=True), prof.step(s):
            with prof.section("fwd"):
                y = x * 2
            out = prof.collective("fake_a2a", torch.add, y, 1.0)
            opt(out)
            prof.begin_section("manual", "launch")
            prof.end_section("manual")
    rep = prof.report()
    assert rep.row("fake_a2a").calls_per_step == 1.0
    # Single process: no rendezvous row, but enqueue and transfer are there.
    names = {r.name for r in rep.rows}
    assert {"fake_a2a/enqueue", "fake_a2a/transfer"} <= names
    assert "fake_a2a/rendezvous" not in names
    assert rep.row("opt").calls_per_step == 1.0


class _LaggedFake:
    """A lagged timer that records which tokens were waited on, and when."""

    lagged = True

    def __init__(self):
        self.n = 0
        self.waited = []

    def mark(self):
        self.n += 1
        return self.n

    def mark_end(self, start):
        return self.mark()

    def elapsed_ns(self, a, b):
        return float(b - a)

    def wait(self, token):
        self.waited.append(token)

    def swap(self):
        pass


def test_lagged_timer_is_read_one_step_late():
    prof = Profiler(report_every=10, calibrate=False)
    fake = prof._timer = _LaggedFake()
    with prof.step(0), prof.section("s"):
        pass
    assert fake.waited == []  # step 0 not read at its own end
    with prof.step(1):
        assert fake.waited == []  # nor during step 1
        with prof.section("s"):
            pass
    assert fake.waited == [4]  # step 0's last token, read at the end of step 1
    rep = prof.report(force=True)
    assert fake.waited == [4, 8]  # report reads the rest
    assert rep.row("s").calls_per_step == 1.0


def test_off_mode_is_a_shared_no_op_that_still_calls_fn():
    prof = Profiler(mode="off")
    assert prof is OFF and isinstance(prof, NullProfiler)
    assert Profiler(mode="off", report_every=3) is OFF
    calls = []

    def fn(a, b=0):
        calls.append((a, b))
        return a + b

    with prof.step(0), prof.section("x"):
        assert prof.collective("c", fn, 1, b=2) == 3
    assert calls == [(1, 2)]

    def g():
        return 7

    assert prof.section_fn("g")(g) is g
    assert prof.report(0) is None


def test_bad_arguments_raise_clearly():
    with pytest.raises(ValueError, match="unknown profiler mode"):
        Profiler(mode="fast")
    with pytest.raises(ValueError, match="report_every"):
        Profiler(report_every=0)
    with pytest.raises(ValueError, match="before any completed step"):
        Profiler(calibrate=False).report(force=True)


def _misuse_run(prof):
    with prof.step(0):
        prof.end_section("never_opened")  # not open
        prof.end_section("never_opened")  # same again: counted, not warned twice
        prof.begin_section("a")
        prof.begin_section("b")
        prof.end_section("a")  # ends a before b: mismatched nesting
        assert prof.report() is None  # report inside a step
        prof.begin_section("left_open")
    with prof.section("outside"):  # outside a step
        pass
    prof.end_step()  # no open step


def test_misuse_inside_the_step_is_counted_and_warned_once_per_kind():
    prof = Profiler(report_every=1, calibrate=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _misuse_run(prof)
    msgs = [str(w.message) for w in caught]
    assert sum("not open" in m for m in msgs) == 1
    assert len(msgs) == 6, msgs  # one per kind
    rep = prof.report()
    assert rep.values["profile/self/misuse_count"] == 7.0
    assert rep.row("a").calls_per_step == 1.0  # closed, with b dropped
    assert "b" not in {r.name for r in rep.rows if r.calls_per_step}


def test_strict_raises_on_misuse():
    prof = Profiler(strict=True, calibrate=False)
    prof.begin_step(0)
    with pytest.raises(ProfileMisuse, match="not open"):
        prof.end_section("nope")


def test_names_are_sanitised_and_reserved_scopes_protected():
    prof = Profiler(report_every=1, calibrate=False)
    with prof.step(0):
        with prof.section("attn/qk v"):
            pass
        with prof.section("step"):
            pass
        prof.collective("moe a2a", lambda: None)
    rep = prof.report()
    assert "profile/attn_qk_v/time_ms" in rep.values
    assert "profile/step_/time_ms" in rep.values
    assert "profile/moe_a2a/transfer_ms" in rep.values
    assert rep.row("step").calls_per_step == 1.0


def test_unknown_category_is_misuse_not_a_crash():
    prof = Profiler(report_every=1, calibrate=False)
    with pytest.warns(RuntimeWarning, match="category"), prof.step(0), prof.section("x", "gpu"):
        pass
    rep = prof.report()
    assert rep.row("x").category == "compute"
    assert rep.values["profile/self/misuse_count"] == 1.0


def test_nesting_records_give_back_the_known_parents():
    prof = Profiler(report_every=2, calibrate=False)
    for s in range(2):
        with prof.step(s):
            with prof.section("forward"):
                with prof.section("attention"), prof.section("qk"):
                    pass
                prof.collective("a2a", lambda: None)
                if s == 1:  # first seen in the second step: after a2a among forward's children
                    with prof.section("router"):
                        pass
            with prof.section("optimizer"):
                pass
    rep = prof.report()
    known = {"step": None, "forward": None, "attention": "forward", "qk": "attention",
             "a2a": "forward", "router": "forward", "optimizer": None}  # fmt: skip
    # Depth 0: the step row itself and the sections directly inside the step.
    expected = {"step": (0, 0), "forward": (0, 1), "attention": (1, 2), "qk": (2, 3),
                "a2a": (1, 4), "router": (1, 5), "optimizer": (0, 6)}  # fmt: skip
    for name, (depth, order) in expected.items():
        assert rep.values[f"profile/{name}/depth_count"] == depth
        assert rep.values[f"profile/{name}/order_count"] == order
        assert rep.row(name).depth == depth
    # Only section, collective and step rows: no collective part, no self row.
    assert {k for k in rep.values if k.endswith("/depth_count")} == {
        f"profile/{n}/depth_count" for n in known
    }
    assert "profile/a2a/transfer_ms" in rep.values
    found = positions(rep.values)
    assert found == expected
    shuffled = dict(sorted(found.items(), reverse=True))  # storage order is not relied on
    assert parents(shuffled) == known
    assert {r.name for r in rep} >= {f"profile/{n}/depth_count" for n in known}
