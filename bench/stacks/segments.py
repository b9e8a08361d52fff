"""Interleaved A/B segments of training steps, for bench/stacks/real_models.py,
bench/stacks/compiled_models.py and bench/capture/load.py.

Modes run in segments. In each round every mode runs one segment, in an order rotated
by the round. A mode's ratio in a round is its mean step time over the reference
mode's mean step of that round. ``open_stack`` attaches syncless's monitor stack for
one segment.
"""

from __future__ import annotations

import inspect
import statistics
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from bench.harness import Rounds, interleave, round_overheads
from bench.stacks.hf_models import Workload, free_memory, train_step
from syncless.monitors import MONITORS, attach, build
from syncless.profile import OFF

HAS_BUDGET = "budget" in inspect.signature(attach).parameters
# handle.step(step, loss=, grad_norm=): the nonfinite alarm's every-step checks (#35)
HAS_CHECKS = "on_nonfinite" in inspect.signature(attach).parameters


@dataclass
class Segment:
    """What one mode attached for one segment, and where it runs in each step."""

    context: Callable[[int], AbstractContextManager] = lambda step: nullcontext()
    prof: Any = OFF
    flush: Callable[[int], None] | None = None
    """After the optimizer step, before the loss read."""
    after_read: Callable[[int], None] | None = None
    close: Callable[[], None] = lambda: None


@dataclass
class ModelState:
    """Per model: what the modes keep between their segments, and what they saw."""

    work: Workload
    budget: float
    step: int = 0
    stack: Any = None
    """The stack's handle, kept across segments when it can pause."""
    kept: dict[str, Any] = field(default_factory=dict)
    """Other budgeted handles kept across segments (paused between), by mode."""
    handle: Any = None
    """The handle of the last stack segment opened."""
    self_records: dict[str, list[float]] = field(default_factory=dict)
    cadences: dict[str, int] | None = None


OpenSegment = Callable[[str, Any], Segment]
"""Opens a segment of a mode on a ``ModelState``."""


def attach_kwargs(budget: float | None) -> dict[str, float | None]:
    """``budget=`` only where this syncless's attach takes it."""
    return {"budget": budget} if HAS_BUDGET else {}


def stack_label(budget: float) -> str:
    return f"stack (budget {budget:g})" if HAS_BUDGET else "stack (no budget: attach lacks it)"


def monitor_step(handle: Any, work: Workload, step: int) -> None:
    """``handle.step`` as a user's loop calls it: with the step's loss and gradient
    norm (device tensors) where the nonfinite monitor is attached to check them."""
    if HAS_CHECKS and getattr(handle, "nonfinite", None) is not None:
        handle.step(step, **work.checked)
    else:
        handle.step(step)


def stack_flush(handle: Any, state: ModelState, step: int) -> None:
    monitor_step(handle, state.work, step)
    for record in handle.last_records:
        if record.name.startswith("monitors/self/"):
            state.self_records.setdefault(record.name, []).append(record.value)
    cadences = getattr(handle, "cadences", None)
    if cadences:
        state.cadences = dict(cadences)  # a copy: the controller may change it in place


def open_stack(state: ModelState) -> Segment:
    """Every monitor, with the state's budget: one handle if it can pause, else a new
    one per segment."""
    work = state.work
    handle = state.stack
    if handle is not None:
        handle.resume()
    else:
        monitors = build(list(MONITORS), optimizer=work.optimizer)
        handle = attach(work.model, monitors, **attach_kwargs(state.budget))
        if hasattr(handle, "pause") and hasattr(handle, "resume"):
            state.stack = handle  # one budget controller for all rounds
    state.handle = handle
    close = handle.pause if state.stack is handle else handle.close
    return Segment(flush=partial(stack_flush, handle, state), close=close)


def open_kept(state: ModelState, mode: str, names: list[str]) -> Segment:
    """Monitors ``names`` under the state's budget, one handle for every segment of
    ``mode``, paused between them: what a long run pays once its budget has settled,
    not a budget's first steps again in each segment (its timed steps, a calibration)."""
    work = state.work
    handle = state.kept.get(mode)
    if handle is None:
        monitors = build(names, optimizer=work.optimizer)
        handle = state.kept[mode] = attach(work.model, monitors, **attach_kwargs(state.budget))
    else:
        handle.resume()
    return Segment(flush=partial(monitor_step, handle, work), close=handle.pause)


def stack_note(state: ModelState) -> str:
    if state.stack is not None:
        # Paused, its hooks stay registered and return after a flag read: the off
        # segments pay that (microseconds per hooked module), so the stack's measured
        # overhead is, if anything, a little low.
        return "stack: one handle, paused between segments"
    return "stack: attached anew each segment (no pause/resume)"


def verdict(overheads: list[float], budget: float) -> str:
    """Issue #19's target for the default stack: its median overhead over the rounds
    within its budget. A miss also says how widely the rounds spread: on a host-bound
    step (the demo's) the spread can be many times the miss, which then says nothing."""
    median = statistics.median(overheads)
    if median <= budget:
        return f"target <= {budget * 100:g}%: met"
    miss, spread = median - budget, max(overheads) - min(overheads)
    why = f"; the rounds spread {spread * 100:.2f} points"
    if spread > 2 * miss:
        why += ", over twice the miss: more rounds would be needed to tell"
    return f"target <= {budget * 100:g}%: missed by {miss * 100:.2f} points{why}"


def run_segment(
    mode: str, state: ModelState, warmup: int, steps: int, open_segment: OpenSegment
) -> list[float]:
    """Wall seconds of each timed step of one segment of ``mode``."""
    segment = open_segment(mode, state)
    times = []
    try:
        for i in range(warmup + steps):
            step = state.step
            state.step += 1
            flush = None if segment.flush is None else partial(segment.flush, step)
            start = time.perf_counter()
            with segment.context(step):
                train_step(state.work, segment.prof, flush)
            if segment.after_read is not None:  # the profiler's report: part of its cost
                segment.after_read(step)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    finally:
        segment.close()
    return times


def measure(
    state: ModelState,
    modes: list[str],
    open_segment: OpenSegment,
    lengths: Callable[[str], tuple[int, int]],
    rounds: int,
    deadline: float,
    reference: str = "off",
) -> tuple[Rounds, dict[str, str]]:
    """The interleaved rounds (``bench.harness.interleave``, the order rotating); stops
    before a round that would end past ``deadline``.

    ``lengths(mode)`` is a segment's untimed warm-up steps and timed steps. Returns the
    rounds and the modes that failed, with their exception's name.
    """
    failed: dict[str, str] = {}

    def segment(mode: str) -> list[float] | None:
        if mode in failed:
            return None
        warmup, steps = lengths(mode)
        try:
            return run_segment(mode, state, warmup, steps, open_segment)
        except Exception as e:  # one mode failing (OOM) must not end the model
            traceback.print_exc()
            failed[mode] = type(e).__name__
        # out of the except block: its frames hold device memory
        state.work.optimizer.zero_grad(set_to_none=True)
        free_memory()
        return None

    def progress(r: int, times: dict[str, list[float]], seconds: float) -> None:
        line = ", ".join(
            f"{m} {o * 100:+.2f}%"
            for m in modes
            if m != reference
            for o in round_overheads([times], m, reference)
        )
        print(f"  round {r}: {seconds:.0f} s; {line}")

    contestants = {mode: partial(segment, mode) for mode in modes}
    done = interleave(contestants, rounds, deadline=deadline, after_round=progress)
    if state.stack is not None:
        state.stack.close()
    for handle in state.kept.values():
        handle.close()
    return done, failed
