"""Sections inside captured graphs, on a CPU: StandInGraph replays, a stand-in clock.

The stand-in clock advances only by the work the captured region itself enqueues
(``clock.now.add_(ns)``), so every captured section's time per replay is known exactly
from the test's own numbers. Sections outside the graph keep the host clock.
"""

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from syncless.graphs import StandInGraph
from syncless.guard import no_sync
from syncless.profile import Profiler
from syncless.profile import graph_sections as gs

UNTIMED = "profile/self/untimed_graph_spans_count"

# Work per replay in ns, by section, as the region below enqueues it.
ATTN_NS, MLP_OWN_NS, ACT_NS = 5_000, 700, 300


def region(prof, clock):
    """A captured step body: attn, then mlp with act nested inside."""
    with prof.section("attn"):
        clock.now.add_(ATTN_NS)
    with prof.section("mlp", "bandwidth", bytes=1024):
        clock.now.add_(MLP_OWN_NS)
        with prof.section("act"):
            clock.now.add_(ACT_NS)


def profiler(**kw):
    prof = Profiler(report_every=1, calibrate=False, **kw)
    return prof, prof._graphs.use_stand_in_clock()


def step(prof, s, body):
    with no_sync(cpu_as_device=True), prof.step(s):
        body()
    return prof.report()


def captured(prof, clock):
    """Step 0 eager (warm-up), step 1 captures: returns the graph and step 1's report."""
    step(prof, 0, lambda: region(prof, clock))
    graph = StandInGraph()

    def capture():
        with prof.section("outside"), graph.capture():
            region(prof, clock)

    return graph, step(prof, 1, capture)


def test_captured_sections_are_timed_at_every_replay_and_steps_without_one_add_nothing():
    prof, clock = profiler()
    graph, at_capture = captured(prof, clock)
    # A CUDA capture runs nothing: no captured span in the capture step.
    for name in ("attn", "mlp", "act"):
        assert at_capture.row(name).calls_per_step == 0.0
    assert at_capture.row("outside").calls_per_step == 1.0  # host clock, as ever
    replays = 0
    for s in range(2, 30):
        replayed = s % 4 != 0  # every fourth step has no replay
        rep = step(prof, s, graph.replay if replayed else lambda: None)
        replays += replayed
        calls = 1.0 if replayed else 0.0
        assert rep.row("attn").calls_per_step == calls
        assert rep.row("attn").ms_per_step == pytest.approx(calls * ATTN_NS / 1e6)
        assert rep.row("mlp").ms_per_step == pytest.approx(calls * (MLP_OWN_NS + ACT_NS) / 1e6)
        assert rep.row("act").ms_per_step == pytest.approx(calls * ACT_NS / 1e6)
        assert rep.row("act").depth == 1  # nested as at capture
        assert rep.row("outside").calls_per_step == 0.0  # its Python ran at capture only
        assert rep.values[UNTIMED] == 0.0
        if replayed:
            mlp = rep.row("mlp")
            assert mlp.gb_per_s == pytest.approx(1024 / (MLP_OWN_NS + ACT_NS))
    assert replays == graph.replays == 21


def test_two_replays_in_a_step_count_both():
    prof, clock = profiler()
    graph, _ = captured(prof, clock)

    def accumulate():
        with prof.section("micro"):  # host clock around the replays
            graph.replay()
            graph.replay()

    rep = step(prof, 2, accumulate)
    assert rep.row("attn").calls_per_step == 2.0
    assert rep.row("attn").ms_per_step == pytest.approx(2 * ATTN_NS / 1e6)
    assert rep.row("act").calls_per_step == 2.0
    assert rep.row("micro").calls_per_step == 1.0


def test_a_report_over_many_steps_sums_the_replays():
    prof, clock = profiler()
    graph, _ = captured(prof, clock)
    prof.report_every = 10
    for s in range(2, 12):
        with no_sync(cpu_as_device=True), prof.step(s):
            for _ in range(s % 3):  # 0, 1 or 2 replays
                graph.replay()
    replays = sum(s % 3 for s in range(2, 12))
    rep = prof.report()
    assert rep.steps == 10
    assert rep.row("attn").calls_per_step == pytest.approx(replays / 10)
    assert rep.row("attn").ms_per_step == pytest.approx(replays * ATTN_NS / 1e6 / 10)


class _Event:
    """A copy's event that has landed only when the test says so."""

    landed = False
    waited = 0

    def record(self):
        pass

    def query(self):
        return _Event.landed

    def synchronize(self):
        _Event.waited += 1


def test_copies_are_read_once_landed_in_order_and_a_full_ring_waits_for_the_oldest():
    prof, clock = profiler()
    graph, _ = captured(prof, clock)
    graphs = prof._graphs
    graphs._events = [_Event() for _ in graphs._events]
    prof.report_every = 10**9  # read the totals through summary() only
    _Event.landed, _Event.waited = False, 0
    before = prof.summary().sections["attn"].calls
    for s in range(2, 5):
        with no_sync(cpu_as_device=True), prof.step(s):
            graph.replay()
    assert len(graphs._pending) == 3  # copied, not read: nothing waited
    assert _Event.waited == 0
    assert prof._recorder._calls[prof._recorder._ids[("attn", "compute")]] == before
    for s in range(5, 7):  # a fifth copy needs a buffer: the oldest is waited for
        with no_sync(cpu_as_device=True), prof.step(s):
            graph.replay()
    assert _Event.waited == 1 and len(graphs._pending) == 4
    _Event.landed = True
    with no_sync(cpu_as_device=True), prof.step(7):
        pass  # no replay: the landed copies still bring steps 2-6's five replays
    assert not graphs._pending
    attn = prof.summary().sections["attn"]
    assert attn.calls - before == 5
    assert attn.time_ns == pytest.approx(5 * ATTN_NS)


def test_a_hooked_module_and_a_collective_inside_the_capture_are_timed():
    prof, clock = profiler()

    class Work(nn.Module):
        def forward(self, x):
            clock.now.add_(2_000)
            return x + 1

    work = Work()
    prof.hook_module(work, "work")
    # A rendezvous payload without a process group: a probe issued would raise.
    prof._recorder.use_rendezvous(torch.zeros(1))

    def exchange(t):
        clock.now.add_(3_000)
        return t * 2

    x = torch.zeros(4)

    def body():
        prof.collective("a2a", exchange, work(x))

    graph = StandInGraph()
    with no_sync(cpu_as_device=True), prof.step(0), graph.capture():
        body()
    at_capture = prof.report()
    for name in ("work", "a2a", "a2a/transfer"):
        assert at_capture.row(name).calls_per_step == 0.0  # the capture ran nothing
    for s in range(1, 21):
        rep = step(prof, s, graph.replay)
        assert rep.row("work").ms_per_step == pytest.approx(2_000 / 1e6)
        assert rep.row("a2a").ms_per_step == pytest.approx(3_000 / 1e6)
        assert rep.values["profile/a2a/transfer_ms"] == pytest.approx(3_000 / 1e6)
        names = {r.name for r in rep.rows}
        assert "a2a/enqueue" not in names  # the host ran the call once, at capture
        assert "a2a/rendezvous" not in names  # no probe inside a graph


def test_without_a_device_clock_each_captured_section_is_named_once_and_counted():
    prof = Profiler(report_every=1, calibrate=False)  # CPU: no clock unless a test gives one
    clock = SimpleNamespace(now=torch.zeros((), dtype=torch.int64))  # the work only
    graphs = [StandInGraph(), StandInGraph()]
    for s, graph in enumerate(graphs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with no_sync(cpu_as_device=True), prof.step(s), graph.capture():
                region(prof, clock)
        texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if s == 0:
            assert len(texts) == 1
            for name in ("'attn'", "'mlp'", "'act'", "no device clock on a CPU", UNTIMED):
                assert name in texts[0]
        else:
            assert texts == []  # the same sections: named once
        rep = prof.report()
        assert rep.values[UNTIMED] == 3.0 * (s + 1)  # three spans per capture, kept
        assert "not timed" in rep.table.caption
    for s in range(2, 6):
        rep = step(prof, s, graphs[0].replay)
        assert rep.row("attn").calls_per_step == 0.0
        assert rep.values[UNTIMED] == 6.0  # "0 ms" here is not "not looked at"


def test_a_section_closed_outside_its_capture_is_untimed_not_garbage():
    prof, clock = profiler()
    graph = StandInGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with no_sync(cpu_as_device=True), prof.step(0):
            with graph.capture():
                prof.begin_section("straddle")
                clock.now.add_(100)
            prof.end_section("straddle")
    assert any("closed outside" in str(w.message) for w in caught)
    graph.replay()
    rep = step(prof, 1, graph.replay)
    assert rep.values[UNTIMED] == 1.0
    assert rep.values["profile/self/misuse_count"] == 0.0


def test_steps_begun_or_ended_inside_a_capture_are_misuse_not_a_crash():
    prof, clock = profiler()
    first, graph = StandInGraph(), StandInGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with no_sync(cpu_as_device=True), first.capture():
            prof.begin_step(0)  # not a step
            region(prof, clock)  # outside a step: counted, not timed
        prof.end_step()  # no step open
        first.replay()
        with no_sync(cpu_as_device=True):
            prof.begin_step(1)
            with graph.capture():
                region(prof, clock)
                prof.end_step()  # dropped
    with no_sync(cpu_as_device=True), prof.step(2):
        graph.replay()
    rep = prof.report(force=True)
    assert rep.steps == 1
    assert rep.values["profile/self/misuse_count"] >= 3.0
    assert rep.row("attn").ms_per_step == pytest.approx(ATTN_NS / 1e6)  # graph's replay


def test_spans_past_the_buffer_are_untimed(monkeypatch):
    monkeypatch.setattr(gs, "CAPACITY", 2)
    prof, clock = profiler()
    graph = StandInGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with no_sync(cpu_as_device=True), prof.step(0), graph.capture():
            region(prof, clock)  # attn and mlp get words, act does not
    assert any("'act'" in str(w.message) and "full" in str(w.message) for w in caught)
    assert prof.report().row("act").calls_per_step == 0.0
    rep = step(prof, 1, graph.replay)
    assert rep.row("attn").ms_per_step == pytest.approx(ATTN_NS / 1e6)
    assert rep.row("mlp").ms_per_step == pytest.approx((MLP_OWN_NS + ACT_NS) / 1e6)
    assert rep.values[UNTIMED] == 1.0
