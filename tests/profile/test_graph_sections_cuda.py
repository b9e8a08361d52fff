"""Sections inside real CUDA graphs: stamped at capture, timed at every replay (needs a GPU).

The pattern is torchtitan's (torchtitan/distributed/cudagraph.py): one eager warm-up on
a side stream, a capture on that stream into a shared pool, then a replay per step.
"""

import pytest
import torch
from torch import nn

from syncless.guard import no_sync
from syncless.profile import Profiler

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

UNTIMED = "profile/self/untimed_graph_spans_count"
N = 4096  # a bf16 matmul of 4096^3: ~0.2 ms on an H100, far above the timer's grain


class Matmuls:
    """Two sections of matmuls (one a hooked module) and a collective-shaped call."""

    def __init__(self, prof):
        self.prof = prof
        self.x = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(N, N, device="cuda", dtype=torch.bfloat16) / N**0.5
        self.proj = nn.Linear(N, N, bias=False, device="cuda", dtype=torch.bfloat16)
        self.proj.requires_grad_(False)
        prof.hook_module(self.proj, "proj")

    def first(self):
        with self.prof.section("mm1"):
            return self.x @ self.w

    def second(self, y):
        with self.prof.section("mm2"):
            z = y @ self.w
            z = z @ self.w
        return self.prof.collective("fake_ar", torch.add, self.proj(z), 1.0)

    def __call__(self):
        return self.second(self.first())


def eager_ms(prof, work, steps=5):
    """Each section's ms per step, timed by CUDA events in eager steps (after two
    steps of warm-up: the profiler's setup, cuBLAS's)."""
    for s in range(2 + steps):
        if s == 2:
            prof.report(force=True)
        with prof.step(s):
            work()
    rep = prof.report(force=True)
    return {name: rep.row(name).ms_per_step for name in ("mm1", "mm2", "proj", "fake_ar")}


def capture(fn, pool, stream, mode):
    """torchtitan's capture: an eager warm-up on the side stream, then the capture."""
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        fn()
    current.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
        fn()
    return graph


@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_captured_sections_are_timed_at_every_replay_close_to_eager(mode):
    prof = Profiler(mode="events", report_every=1, calibrate=False)
    work = Matmuls(prof)
    eager = eager_ms(prof, work)
    pool, side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    held = {}
    with prof.step(10):  # warm-ups and captures: two graphs sharing one pool
        first = capture(lambda: held.__setitem__("y", work.first()), pool, side, mode)
        second = capture(lambda: work.second(held["y"]), pool, side, mode)
    at_capture = prof.report()
    for name in eager:  # the warm-ups' eager spans only; nothing captured ran
        assert at_capture.row(name).calls_per_step == 1.0
    for s in range(11, 31):
        with no_sync(), prof.step(s):
            first.replay()
            if s % 2:  # the second graph every other step only
                second.replay()
        rep = prof.report()  # drains the step's copy: per-step attribution
        assert rep.values[UNTIMED] == 0.0
        assert rep.row("mm1").calls_per_step == 1.0
        second_calls = 1.0 if s % 2 else 0.0
        for name in ("mm2", "proj", "fake_ar", "fake_ar/transfer"):
            assert rep.row(name).calls_per_step == second_calls, name
        for name, ms in eager.items():
            got = rep.row(name).ms_per_step
            if rep.row(name).calls_per_step:
                assert ms / 2 < got < ms * 2, (name, got, ms)
            else:
                assert got == 0.0, name
        inside = rep.row("mm1").ms_per_step + rep.row("mm2").ms_per_step
        assert rep.row("step").ms_per_step > 0.8 * inside  # events and stamps agree on units


def test_replays_read_lagged_over_a_window_and_accumulation_counts_each_replay():
    prof = Profiler(mode="events", report_every=20, calibrate=False)
    work = Matmuls(prof)
    eager = eager_ms(prof, work)
    side = torch.cuda.Stream()
    with prof.step(10):
        graph = capture(work, None, side, "thread_local")
    prof.report(force=True)
    replays = 0
    with no_sync():
        for s in range(11, 31):
            with prof.step(s):
                for _ in range(s % 3):  # 0, 1 or 2 replays (gradient accumulation)
                    graph.replay()
                    replays += 1
    rep = prof.report()
    assert rep.steps == 20
    mm1 = rep.row("mm1")
    assert mm1.calls_per_step == pytest.approx(replays / 20)
    assert eager["mm1"] / 2 < mm1.us_per_call / 1e3 < eager["mm1"] * 2


@pytest.mark.parametrize("mode", ["collectives", "sync"])
def test_modes_that_synchronize_stamp_inside_a_capture_instead(mode):
    prof = Profiler(mode=mode, report_every=1, calibrate=False)
    work = Matmuls(prof)
    with prof.step(0):
        graph = capture(work, None, torch.cuda.Stream(), "global")
    prof.report()
    for s in range(1, 4):
        with prof.step(s):
            graph.replay()
        rep = prof.report()
        assert rep.row("mm1").calls_per_step == 1.0
        assert rep.row("mm1").ms_per_step > 0.0
        assert rep.row("fake_ar").ms_per_step > 0.0
        assert "fake_ar/rendezvous" not in {r.name for r in rep.rows}
