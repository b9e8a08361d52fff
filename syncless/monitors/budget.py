"""The stack's overhead budget: each monitor's measured cost, and cadences that fit it.

Default cadences used to be guesses (attention every step, norms every 10). A monitor's
cost depends on the model: exact attention statistics are about 1% of a GPU-bound
Llama step per active step, and more at 32k tokens; norms read every parameter. So the
handle measures what each monitor costs per active step and chooses each cadence so
that the stack stays under ``budget`` (a fraction of the step, default 1%):

* **host**: the monitor's hooks' host time (the ledger ``MonitorContext.timed`` keeps);
* **device**: on CUDA, on *timed* active steps, a pair of timing events around each of
  the monitor's hook calls, read when the GPU has passed them (``Event.query``, never a
  sync). Held-only hook calls give empty pairs; the pairs' own time (calibrated once at
  attach) is subtracted. The first ``TIMED_FIRST`` active steps of a monitor are timed,
  then one in ``TIMED_EVERY``: a timing record adds ~2 us of device time
  (bench/RESULTS.md, event_device_cost), 32 of them on a 16-layer model's hooks.
* **cost per active step** = max(host, device), the median of the last ``WINDOW``
  measurements: a GPU-bound step hides the host's work behind the device's and a
  host-bound one the device's behind the host's, so the larger is what a step pays
  (their sum would count the hidden one too). A monitor's first active step is not
  measured: it compiles its kernels (2 s of host on the H200, which once set attention
  to every 1000 steps, where a smoothed mean would have kept it for thousands more).
* **compiled hooks** (torch.compile traced them: no clock, no event, nothing on the
  ledger) and **hooks replayed from a CUDA graph** (no Python runs in a replay): from
  step times, against steps that run none of them (syncless.monitors.budget_compiled).
  An always-on monitor inside a graph has no such step: it is reported "not measured"
  (docs/cuda_graphs.md gives its measured cost).
* **always-on monitors** (the nonfinite alarm): their hooks run at every step, so
  their cost per step (host per step, or device on timed steps, the larger) is a
  fixed share taken off the budget before the others share it out, and only their
  readout is planned, from its cost per flush, and never rarer than every
  ``ALARM_MAX_EVERY`` steps (the alarm's lag).
* **step time**: the median of the host's wall time between the last ``WINDOW``
  ``handle.step`` calls (the training loop's period, device-paced when the step is
  GPU-bound; a step that saves a checkpoint does not move it).

Across ranks the cadences must agree: a monitor active on one rank and idle on another
would leave the flush's collectives unmatched. Each rank plans from its own costs, and
at steps 2, 4, 8 and 16 and then every ``AGREE_EVERY`` steps the ranks take the slowest
cadence of each monitor in one small all-reduce (a host read of a handful of numbers;
the only sync the budget makes, on the flush path). Between agreements no cadence
changes.

Cadences (:func:`plan`): a monitor's ``every`` is the fastest it may run; ``PLANNED``
of the budget (the rest is headroom, below) is shared out by water-filling: each monitor gets an equal share, those that need less at
their fastest cadence keep it and leave the rest to the others, and each other monitor
runs every ``ceil(cost / share)`` steps (at most ``MAX_EVERY``), a cadence growing at
most ``GROWTH``-fold per plan so that it is measured again soon. The flush's host time
(``handle.step``) is shared out to the monitors active in it, as host cost. Not billed:
the device time of the folds a grouped launch defers to the flush (a few small launches
per monitor and step), the hooks' dispatch on inactive steps and the timing events
themselves. That is what the headroom
is for: planned to the whole 1%, the stack measured +0.54% to +1.24% (medians of 3
rounds) on five GPU-bound Hugging Face models (bench/RESULTS.md, real_models at f1a6061);
at 0.75 of it, +0.61% to +1.04% (1e97993: qwen3-1.7b still over), so 0.6.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Iterable

import torch
import torch.distributed as dist

from syncless.cuda_driver import stream_capturing
from syncless.monitors.budget_compiled import StepDeltas

DEFAULT_BUDGET = 0.01
PLANNED = 0.6  # of the budget given to the measured costs; the rest is headroom
MAX_EVERY = 1000
ALARM_MAX_EVERY = 64  # the longest an always-on monitor's readout waits, in steps
TIMED_FIRST = 3  # active steps timed (after the first, never measured) before sampling
TIMED_EVERY = 4  # then one timed active step in this many
WINDOW = 5  # measurements a median is taken over (costs and the step time)
AGREE_EVERY = 32  # steps between the ranks' agreements on cadences (several ranks)
AGREE_EARLY = (2, 4, 8, 16)  # and these steps: the first measurements land after step 1
GROWTH = 4  # a cadence at most quadruples per new measurement: one bad measurement
# cannot park a monitor for a thousand steps before it is measured again
_PENDING_STEPS = 8  # timed steps waiting for the GPU before the oldest is dropped


def plan(
    costs: dict[str, float], fastest: dict[str, int], budget: float, max_every: int = MAX_EVERY
) -> dict[str, int]:
    """Cadence per monitor so that ``Σ costs[m] / every[m] <= budget`` (water-filling).

    ``costs``: fraction of a step one active step of the monitor costs (monitors
    without a measurement yet keep their fastest cadence and take no share);
    ``fastest``: the smallest ``every`` each may have.
    """
    out = dict(fastest)
    measured = sorted(costs, key=lambda m: costs[m] / fastest[m])
    left = budget
    for i, name in enumerate(measured):
        share = left / (len(measured) - i)
        need = costs[name] / fastest[name]
        if need <= share * (1 + 1e-9):
            every = fastest[name]
        else:
            # 1e-9: 0.1 / 0.01 is 10.000000000000002 in floating point, and means 10
            steps = math.ceil(costs[name] / max(share, 1e-12) - 1e-9)
            every = min(max_every, max(fastest[name], steps))
        out[name] = every
        left = max(0.0, left - costs[name] / every)
    return out


class Budget:
    """Measures each monitor's cost and sets cadences (see the module doc)."""

    clock = staticmethod(time.perf_counter)  # seconds; tests give a fake one

    def __init__(
        self,
        fraction: float,
        fastest: dict[str, int],
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        always_on: Iterable[str] = (),
    ) -> None:
        if not 0 < fraction < 1:
            raise ValueError(
                f"budget must be a fraction of the step in (0, 1), e.g. 0.01 for 1%, got "
                f"{fraction}; pass budget=None for fixed cadences"
            )
        self.fraction = fraction
        self.fastest = dict(fastest)
        # Set once a hook was traced by torch.compile: cadences become powers of two, so
        # the monitors active at a step are always the ones with the shortest cadences.
        # Dynamo compiles one graph per set of active monitors (it guards on each
        # ``active`` flag); prefixes of one order (``CHAIN_ORDER``) bound that at
        # monitors + 1 graphs, under its recompile limit of 8, where free cadences
        # (every 3 and every 5, say) made one per combination, hit the limit and ran
        # the layers eagerly (issue #20).
        self.aligned = False
        self.cadence = dict(fastest)  # in force (agreed across ranks)
        self.proposed = dict(fastest)  # this rank's plan
        self.group = group
        self._device = torch.device(device)
        self._ranks = (
            dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        )
        self.always_on = frozenset(always_on)
        self.fixed_ms: dict[str, float] = {}  # always-on monitors' cost per step (median)
        self._fixed: dict[str, deque[float]] = {m: deque(maxlen=WINDOW) for m in always_on}
        self.cost_ms: dict[str, float] = {}  # the median of _costs, per active step
        self.device_ms: dict[str, float] = {}  # the last timed step's device time
        self.step_ms: float | None = None
        self.timing: frozenset[str] = frozenset()  # monitors timed in the current step
        self.dropped_steps = 0  # timed steps the GPU had not passed after _PENDING_STEPS
        self._cuda = self._device.type == "cuda"
        self._active_steps = dict.fromkeys(fastest, 0)
        self._costs: dict[str, deque[float]] = {m: deque(maxlen=WINDOW) for m in fastest}
        self._periods: deque[float] = deque(maxlen=WINDOW)
        self._fresh: set[str] = set()  # monitors measured since the last plan
        self._spans: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event, float]]] = {}
        self._pending: deque[tuple[dict[str, list], dict[str, float]]] = deque()
        self._free: list[torch.cuda.Event] = []
        self._last_step_end: float | None = None
        # Monitors whose hooks ran in compiled graphs (nothing on their ledger), and
        # their costs from step times (syncless.monitors.budget_compiled).
        self.compiled: set[str] = set()
        self._deltas = StepDeltas()
        self.pair_ms = self._calibrate() if self._cuda else 0.0

    # -- hot path: around each hook call of a timed monitor -------------------------

    def begin(self) -> torch.cuda.Event | None:
        """Open a span; ``None`` under CUDA graph capture, where a timing event cannot
        be recorded (the replayed graph is not what the budget measures)."""
        if stream_capturing():
            return None
        start = self._event()
        start.record()
        return start

    def end(self, monitor: str, start: torch.cuda.Event | None, weight: float = 1.0) -> None:
        """Close the span ``begin`` opened; ``weight``: the share billed to ``monitor``
        (a read shared by two monitors bills each half of one span)."""
        if start is None:
            return
        stop = self._event()
        stop.record()
        self._spans.setdefault(monitor, []).append((start, stop, weight))

    def _event(self) -> torch.cuda.Event:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    # -- cold path: once per step ------------------------------------------------------

    def step_end(
        self,
        active: Iterable[str],
        host_ns: dict[str, int] | None,
        flush_ms: float = 0.0,
        steps: int = 1,
    ) -> None:
        """The step just flushed: ``active`` monitors ran, their hooks took ``host_ns``
        and the flush ``flush_ms`` of host time, which the active monitors share (a
        monitor active every step forces a flush every step, even one that costs
        nothing itself, like the moe monitor on a dense model). ``steps``: the steps
        since the previous flush, over which always-on monitors' hooks ran."""
        now = self.clock()
        active = list(active)
        period = None if self._last_step_end is None else (now - self._last_step_end) * 1e3
        if period is not None:
            self._periods.append(period)
            self.step_ms = statistics.median(self._periods)
        self._last_step_end = now
        flush_share = flush_ms / len(active) if active else 0.0
        host: dict[str, float] = {}
        for m in active:
            hooks_ms = (host_ns or {}).get(m, 0) / 1e6
            # an always-on monitor's hooks, per step; its active step adds the flush
            host[m] = hooks_ms / max(steps, 1) if m in self.always_on else hooks_ms + flush_share
            self._active_steps[m] += 1
        if self.aligned:
            self._compiled_step(period, active, host_ns or {})
            host = {m: ms for m, ms in host.items() if m not in self.compiled}
        for m in self.always_on.intersection(active):
            if self._active_steps[m] > 1:
                self._measured(m, flush_share)
        if self._cuda:
            timed = {m: host[m] for m in self.timing if m in host}
            if timed:
                self._pending.append(({m: self._spans.pop(m, []) for m in timed}, timed))
            self._spans.clear()
            self._read_pending()
        else:  # no device: the hooks' host time is the whole cost
            for m, ms in host.items():
                if self._active_steps[m] > 1:  # the first compiles and allocates
                    self._cost(m, ms)
        self._replan()

    def _cost(self, monitor: str, ms: float) -> None:
        """A measured cost of ``monitor``'s hooks: per active step, or for an always-on
        monitor per step (a fixed cost)."""
        if monitor in self.always_on:
            fixed = self._fixed[monitor]
            fixed.append(ms)
            self.fixed_ms[monitor] = statistics.median(fixed)
            self._fresh.add(monitor)
        else:
            self._measured(monitor, ms)

    def _compiled_step(self, period: float | None, active: list[str], host_ns: dict) -> None:
        """Under compile: the active monitors with no hook time are compiled ones; the
        step's time, less what the others cost, goes to the step-time estimates."""
        for m in active:
            # An always-on monitor's traced hooks run in every step, the baseline's too:
            # no step difference shows them (nor do they add graphs: no cadence branch).
            if not host_ns.get(m) and m not in self.compiled and m not in self.always_on:
                self.compiled.add(m)
                self._costs[m].clear()  # the flush share it was billed is not its cost
        if period is None:
            return
        compiled = frozenset(m for m in active if m in self.compiled)
        billed = sum(self.cost_ms.get(m, 0.0) for m in active if m not in compiled)
        for m, ms in self._deltas.add(period - billed, compiled).items():
            self._measured(m, ms)

    def arm(self, active_next: Iterable[str]) -> None:
        """Which of the monitors active in the next step are timed there."""
        if not self._cuda:
            return
        self.timing = frozenset(m for m in active_next if _timed(self._active_steps[m]))

    def pause(self) -> None:
        """The handle pauses: time nothing, and measure no step period across the pause
        (a period spanning it would make every monitor look cheap)."""
        self.timing = frozenset()
        self._spans.clear()
        self._last_step_end = None

    def _read_pending(self) -> None:
        while self._pending:
            spans, host = self._pending[0]
            ready = all(stop.query() for ps in spans.values() for _, stop, _ in ps)
            if not ready and len(self._pending) <= _PENDING_STEPS:
                return  # the GPU has not got there yet
            self._pending.popleft()
            if ready:
                for m, ps in spans.items():
                    if not ps and not host[m]:
                        # No hook ran on the host: replayed from a CUDA graph (an
                        # always-on monitor there has no step without it to compare).
                        continue
                    device = sum(w * (a.elapsed_time(b) - self.pair_ms) for a, b, w in ps)
                    self.device_ms[m] = max(0.0, device)
                    self._cost(m, max(host[m], self.device_ms[m]))
            else:
                self.dropped_steps += 1
            # a span shared by two monitors is in both lists: free its events once
            events = {id(e): e for ps in spans.values() for a, b, _ in ps for e in (a, b)}
            self._free += events.values()

    def _measured(self, monitor: str, ms: float) -> None:
        costs = self._costs[monitor]
        costs.append(ms)
        self._fresh.add(monitor)
        self.cost_ms[monitor] = statistics.median(costs)

    def _replan(self) -> None:
        if not self.step_ms:
            return
        costs = {m: ms / self.step_ms for m, ms in self.cost_ms.items()}
        fixed = sum(self.fixed_ms.values()) / self.step_ms
        planned = plan(costs, self.fastest, max(0.0, self.fraction * PLANNED - fixed))
        for m in self.always_on:
            planned[m] = min(planned[m], max(ALARM_MAX_EVERY, self.fastest[m]))
        # growth needs a new measurement of that monitor; shrinking needs none
        self.proposed = {
            m: min(every, self.proposed[m] * (GROWTH if m in self._fresh else 1))
            for m, every in planned.items()
        }
        if self.aligned:  # rounded up: the cost stays within the plan
            self.proposed = _aligned(self.proposed, self.compiled)
        self._fresh.clear()
        if self._ranks == 1:
            self.cadence = self.proposed

    def agree(self, next_step: int) -> None:
        """Several ranks: at the agreement steps, each monitor's slowest proposed cadence
        becomes everyone's (a collective every rank reaches at the same step)."""
        if self._ranks == 1 or (next_step % AGREE_EVERY and next_step not in AGREE_EARLY):
            return
        names = list(self.fastest)
        proposed = torch.tensor([float(self.proposed[m]) for m in names], dtype=torch.float64)
        proposed = proposed.to(self._device)
        # syncless: collective-ok the ranks' cadences must agree, or the flush's collectives do not match
        dist.all_reduce(proposed, op=dist.ReduceOp.MAX, group=self.group)
        agreed = proposed.tolist()  # syncless: ok once in AGREE_EVERY steps, on the flush path
        self.cadence = {m: int(every) for m, every in zip(names, agreed, strict=True)}

    def _calibrate(self) -> float:
        """Device time of an empty pair of timing events (cold path: one sync at attach)."""
        pairs = [(self._event(), self._event()) for _ in range(16)]
        for a, b in pairs:
            a.record()
            b.record()
        pairs[-1][1].synchronize()
        ms = statistics.median(a.elapsed_time(b) for a, b in pairs)
        self._free += [e for pair in pairs for e in pair]
        return ms

    # -- reporting ---------------------------------------------------------------------

    def share(self) -> dict[str, float]:
        """Each measured monitor's estimated fraction of the step at its cadence (an
        always-on monitor's fixed cost per step included)."""
        if not self.step_ms:
            return {}
        out = {m: ms / self.cadence[m] / self.step_ms for m, ms in self.cost_ms.items()}
        for m, ms in self.fixed_ms.items():
            out[m] = out.get(m, 0.0) + ms / self.step_ms
        return out

    def records(self, area: str) -> dict[str, float]:
        """``area/self/...`` values: cadence, cost and share per monitor, and the stack's."""
        out = {
            f"{area}/self/budget_frac": self.fraction,
            # timed steps never read (the GPU had not passed them): not measured
            f"{area}/self/budget_unread_steps_count": float(self.dropped_steps),
        }
        for m, every in self.cadence.items():
            out[f"{area}/self/{m}_every_steps"] = float(every)
        for m, ms in self.cost_ms.items():
            out[f"{area}/self/{m}_active_cost_ms"] = ms
        for m, ms in self.device_ms.items():
            out[f"{area}/self/{m}_device_ms"] = ms
        for m, ms in self.fixed_ms.items():
            out[f"{area}/self/{m}_step_cost_ms"] = ms
        shares = self.share()
        for m, frac in shares.items():
            out[f"{area}/self/{m}_share_frac"] = frac
        if self.step_ms:
            out[f"{area}/self/step_ms"] = self.step_ms
            out[f"{area}/self/stack_share_frac"] = sum(shares.values())
        return out

    def summary(self) -> str:
        """One line for the run's output: the budget, each cadence and its share."""
        if not self.step_ms:
            return f"syncless monitors: budget {self.fraction:.1%} (no step measured)"
        shares = self.share()
        parts = []
        for m, every in self.cadence.items():
            if m in self.always_on:
                cost = self.fixed_ms.get(m)
                measured = "not measured" if cost is None else f"{cost:.2f} ms per step"
                shown = f", {shares[m]:.2%}" if m in shares else ""
                parts.append(f"{m} every step ({measured}{shown}), read every {every}")
            elif m in self.cost_ms:
                parts.append(
                    f"{m} every {every} ({self.cost_ms[m]:.2f} ms per active step, {shares[m]:.2%})"
                )
            else:
                parts.append(f"{m} every {every} (not measured)")
        return (
            f"syncless monitors: budget {self.fraction:.1%} of a {self.step_ms:.1f} ms step, "
            f"stack {sum(shares.values()):.2%}: " + "; ".join(parts)
        )


# The order compiled monitors' cadences grow in, cheapest first (ms per active step on
# the H200, bench/RESULTS.md real_models: moe 0.2-1.4, activations and nonfinite about
# 1, attention 2.5-5). Fixed, so the active sets are always prefixes of it: monitors + 1
# graphs for the whole run. Re-ordered by measured costs, they added graphs with each
# new order and hit dynamo's recompile limit (1 of 4 rounds at b7d1470: +57.7%).
# The nonfinite monitor is not in it: its hooks run at every step (always on), so it
# branches on no cadence and adds no graph.
CHAIN_ORDER = ("moe", "activations", "attention")


def _aligned(proposed: dict[str, int], compiled: set[str]) -> dict[str, int]:
    """Cadences rounded up to powers of two. Compiled monitors get at least 2 (a
    baseline step every other step) and grow strictly along ``CHAIN_ORDER``: two that
    always ran together could only be billed their sum, split evenly
    (syncless.monitors.budget_compiled). Only ever longer than planned."""
    out = {m: 1 << (every - 1).bit_length() for m, every in proposed.items()}
    taken = 1
    for m in sorted(compiled & out.keys(), key=_chain_rank):
        out[m] = taken = max(out[m], 2 * taken)
    return out


def _chain_rank(monitor: str) -> tuple[int, str]:
    known = monitor in CHAIN_ORDER
    return (CHAIN_ORDER.index(monitor) if known else len(CHAIN_ORDER), monitor)


def _timed(done: int) -> bool:
    """Whether a monitor's active step after ``done`` active steps is timed: not the
    first (it compiles), the next ``TIMED_FIRST``, then one in ``TIMED_EVERY``."""
    return 1 <= done <= TIMED_FIRST or (done > TIMED_FIRST and done % TIMED_EVERY == 0)
