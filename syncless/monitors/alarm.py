"""The alarms: what a readout says went NaN/Inf or spiked, and what the handle does then.

The nonfinite monitor counts at every step on the device; a readout (lagged, at the
budget's cadence) carries the counts since the previous one, the first step each
layer had one, and the checks of the loss and gradient norm that ``handle.step`` was
given. :meth:`NonFiniteAlarm.check` reads those few values straight from the flushed
host copy (a handful of numpy reads on the training thread, before any decode), so
the action does not wait for the readout thread.

A readout that carries a spike of the loss or the gradient norm (syncless.monitors.
spikes) is a :class:`SpikeEvent`. Both kinds of event name the layer that moved first,
where the device kept one (syncless.monitors.attribution).

Actions (``attach(..., on_nonfinite=, on_spike=)``, one for each kind): ``"warn"``
prints one line (rank 0), the first time and then at most once a minute; ``"raise"``
also raises :class:`NonFiniteError` (:class:`SpikeError`) from ``handle.step`` once
the readout's records are in the run store; a callable gets the event on the training
thread. With several
ranks, the raise and the callable happen at the same flush on every rank: the readout
of the n-th flush is acted on at flush n + ``HOST_BUFFERS``, the flush by which every
rank has certainly landed it (syncless.metrics.metric_set), where acting when it lands
would stop ranks at different steps and leave the others waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from syncless.errors import UsageError
from syncless.metrics import MetricSet
from syncless.metrics.metric_set import HOST_BUFFERS, Landed
from syncless.monitors.attribution import Attribution, Moved
from syncless.monitors.base import AREA
from syncless.monitors.nonfinite import CHECKED_VALUES, first_bad

#: Seconds between two warning lines after the first (a diverged run has NaNs in every
#: readout; one line a readout would bury everything else).
WARN_EVERY_S = 60.0

ACTIONS = ("warn", "raise")
Action = str | Callable[[Any], object]  # called with a NonFiniteEvent or a SpikeEvent


@dataclass(frozen=True)
class NonFiniteEvent:
    """What one readout says went nonfinite since the readout before it.

    ``first_step``/``first_layer``: the first step at which a layer's output held a
    NaN or Inf, and the first layer (model order) that did at that step; ``count``:
    such values in every layer output together, over ``layers`` layers.
    ``loss_first_step``/``grad_norm_first_step``: the first step whose loss or total
    gradient norm (as handed to ``handle.step``) was nonfinite. ``grad_layers``: the
    layers whose gradient norm was nonfinite at the readout's step (the norms
    monitor's active steps only).
    """

    readout_step: int
    first_step: int | None = None
    first_layer: int | None = None
    count: int = 0
    layers: int = 0
    loss_first_step: int | None = None
    grad_norm_first_step: int | None = None
    grad_layers: tuple[int, ...] = ()
    moved_first: Moved | None = None
    """The layer that moved first, if the device kept one (its step labelled)."""

    @property
    def step(self) -> int:
        """The earliest step anything went nonfinite."""
        steps = [self.first_step, self.loss_first_step, self.grad_norm_first_step]
        if self.grad_layers:
            steps.append(self.readout_step)
        return min(s for s in steps if s is not None)

    def describe(self) -> str:
        parts = []
        if self.first_step is not None:
            parts.append(
                f"layer {self.first_layer} output first at step {self.first_step} "
                f"({self.count} values in {self.layers} layer{'s' * (self.layers != 1)})"
            )
        if self.loss_first_step is not None:
            parts.append(f"loss at step {self.loss_first_step}")
        if self.grad_norm_first_step is not None:
            parts.append(f"gradient norm at step {self.grad_norm_first_step}")
        if self.grad_layers:
            shown = ", ".join(map(str, self.grad_layers[:8]))
            more = f" and {len(self.grad_layers) - 8} more" if len(self.grad_layers) > 8 else ""
            parts.append(f"gradients of layer {shown}{more} at step {self.readout_step}")
        if self.moved_first is not None:
            parts.append(self.moved_first.describe())
        return f"NaN/Inf since the previous readout (read at step {self.readout_step}): " + (
            "; ".join(parts)
        )


class NonFiniteError(RuntimeError):
    """Raised by ``handle.step`` under ``on_nonfinite="raise"``; ``event`` says where."""

    def __init__(self, event: NonFiniteEvent) -> None:
        super().__init__(
            f"{event.describe()}. The run's records up to that readout are in the run "
            "store; the error comes a readout after the step (the check never syncs)."
        )
        self.event = event


@dataclass(frozen=True)
class SpikeEvent:
    """A spike of the loss or the total gradient norm (``value``), as one readout says:
    ``count`` spikes since the readout before, the first at ``first_step``;
    ``moved_first``: the layer that moved first, if the device kept one."""

    readout_step: int
    value: str
    first_step: int
    count: int
    moved_first: Moved | None = None

    @property
    def step(self) -> int:
        return self.first_step

    def describe(self) -> str:
        what = "loss" if self.value == "loss" else "gradient norm"
        many = f" ({self.count} spikes)" if self.count > 1 else ""
        moved = f"; {self.moved_first.describe()}" if self.moved_first is not None else ""
        return (
            f"{what} spike at step {self.first_step}{many}, read at step {self.readout_step}{moved}"
        )


class SpikeError(RuntimeError):
    """Raised by ``handle.step`` under ``on_spike="raise"``; ``event`` says where."""

    def __init__(self, event: SpikeEvent) -> None:
        super().__init__(
            f"{event.describe()}. The run's records up to that readout are in the run "
            "store; the error comes a readout after the step (the check never syncs)."
        )
        self.event = event


def check_action(action: Action, name: str = "on_nonfinite") -> Action:
    if callable(action) or action in ACTIONS:
        return action
    event = "NonFiniteEvent" if name == "on_nonfinite" else "SpikeEvent"
    raise UsageError(
        f"{name}={action!r}: expected 'warn', 'raise' or a callable taking a "
        f"syncless.monitors.{event}"
    )


class NonFiniteAlarm:
    """Finds nonfinite values in a flushed host copy and acts on them (module doc).

    ``label``: the step label ``handle.step`` was given for a label the device wrote
    (they differ only where the steps were not numbered one by one).
    """

    def __init__(
        self,
        metrics: MetricSet,
        action: Action,
        label: Callable[[float], int],
        emit: bool,
        ranks: int = 1,
        on_spike: Action = "warn",
    ) -> None:
        self.action = check_action(action)
        self.on_spike = check_action(on_spike, "on_spike")
        self.label = label
        self.emit = emit
        self.lag = HOST_BUFFERS if ranks > 1 else 0
        self.events: list[NonFiniteEvent | SpikeEvent] = []  # every one, in order
        self._due: list[tuple[int, NonFiniteEvent | SpikeEvent]] = []  # (act at flush, event)
        self._last_warned: dict[type, float] = {}
        self._unwarned: dict[type, int] = {}
        self._attribution = Attribution(metrics)
        self._spike_at = {
            v: (
                _at(metrics, [f"{AREA}/step/{v}_spike_count"], 0),
                _at(metrics, [f"{AREA}/step/{v}_spike_first_step"], 2),
            )
            for v in CHECKED_VALUES
            if f"{AREA}/step/{v}_spike_count" in {spec.key for spec in metrics.specs}
        }
        spec = metrics.layer_specs(AREA, "nonfinite_count")
        firsts = metrics.layer_specs(AREA, "nonfinite_first_step")
        self._layers = np.array(list(spec), dtype=np.int64)
        self._count_at = _at(metrics, [s.key for s in spec.values()], 0)
        self._first_at = _at(metrics, [firsts[i].key for i in spec], 2)
        self._value_at = {
            v: (
                _at(metrics, [f"{AREA}/step/{v}_nonfinite_count"], 0),
                _at(metrics, [f"{AREA}/step/{v}_nonfinite_first_step"], 2),
            )
            for v in CHECKED_VALUES
        }
        replicated = metrics.layer_specs(AREA, "grad_sumsq_replicated")
        sharded = metrics.layer_specs(AREA, "grad_sumsq_sharded")
        self._grad_replicated = (
            np.array(list(replicated), dtype=np.int64),
            _at(metrics, [s.key for s in replicated.values()], 2),
        )
        self._grad_sharded = (
            np.array(list(sharded), dtype=np.int64),
            _at(metrics, [s.key for s in sharded.values()], 0),
            _at(metrics, [s.key for s in sharded.values()], 1),
        )

    def check(self, landed: Landed) -> list[NonFiniteEvent | SpikeEvent]:
        """The events in a flushed copy (a few numpy reads: training thread)."""
        nonfinite = self._nonfinite(landed)
        events: list[NonFiniteEvent | SpikeEvent] = [] if nonfinite is None else [nonfinite]
        for value, (count_at, first_at) in self._spike_at.items():
            count = landed.host[count_at][0]
            if count > 0:
                first = self.label(float(-landed.host[first_at][0]))
                events.append(SpikeEvent(landed.step, value, first, int(count)))
        if events and self._attribution:
            moved = self._attribution.in_buffer(landed.host)
            if moved is not None:
                labelled = Moved(float(self.label(moved.step)), moved.layer, moved.signal)
                events = [dataclasses.replace(e, moved_first=labelled) for e in events]
        return events

    def _nonfinite(self, landed: Landed) -> NonFiniteEvent | None:
        host = landed.host
        found: dict = {}
        counts = host[self._count_at]
        if counts.any():
            firsts = -host[self._first_at]  # min metrics are stored negated
            first = first_bad(firsts, np.isfinite(firsts))
            if first is not None:
                found["first_step"] = self.label(first[0])
                found["first_layer"] = int(self._layers[first[1]])
            found["count"] = int(counts.sum())
            found["layers"] = int((counts > 0).sum())
        for value, (count_at, first_at) in self._value_at.items():
            if host[count_at].any():
                found[f"{value}_first_step"] = self.label(float(-host[first_at][0]))
        bad = self._bad_grads(host)
        if bad:
            found["grad_layers"] = bad
        if not found:
            return None
        return NonFiniteEvent(landed.step, **found)

    def _bad_grads(self, host: np.ndarray) -> tuple[int, ...]:
        layers, at = self._grad_replicated
        values = host[at]
        bad = set(layers[(values != -np.inf) & ~np.isfinite(values)].tolist())
        layers, sum_at, count_at = self._grad_sharded
        values = host[sum_at]
        bad.update(layers[(host[count_at] > 0) & ~np.isfinite(values)].tolist())
        return tuple(sorted(bad))

    def landed(self, landed: Landed) -> None:
        """Check a flushed copy; warn at once (rank 0) and schedule the actions."""
        for event in self.check(landed):
            self.events.append(event)
            self._warn(event)
            if self._action_of(event) != "warn":
                self._due.append((landed.index + self.lag, event))

    def _action_of(self, event: NonFiniteEvent | SpikeEvent) -> Action:
        return self.on_spike if isinstance(event, SpikeEvent) else self.action

    def due(self, flushes: int | None) -> list[NonFiniteEvent | SpikeEvent]:
        """Events to act on after ``flushes`` flushes (None: all, at close)."""
        now = [e for at, e in self._due if flushes is None or at < flushes]
        self._due = [(at, e) for at, e in self._due if flushes is not None and at >= flushes]
        return now

    def act(self, event: NonFiniteEvent | SpikeEvent) -> None:
        """Raise or call the user's callable (the records are in the store already)."""
        action = self._action_of(event)
        if action == "raise":
            if isinstance(event, SpikeEvent):
                raise SpikeError(event)
            raise NonFiniteError(event)
        if callable(action):
            action(event)

    def _warn(self, event: NonFiniteEvent | SpikeEvent) -> None:
        """One line, then at most one a minute for each kind of event."""
        kind = type(event)
        now = time.monotonic()
        last = self._last_warned.get(kind)
        if last is not None and now - last < WARN_EVERY_S:
            self._unwarned[kind] = self._unwarned.get(kind, 0) + 1
            return
        unwarned = self._unwarned.get(kind, 0)
        if self.emit:
            what = "spikes" if kind is SpikeEvent else "NaN/Inf"
            also = (
                f" ({unwarned} more readouts with {what} since the last line)" if unwarned else ""
            )
            print(f"syncless: {event.describe()}{also}", file=sys.stderr)
        self._last_warned[kind], self._unwarned[kind] = now, 0


def _at(metrics: MetricSet, keys: list[str], part: int) -> np.ndarray:
    """Buffer positions of the keys' first elements: their sum (0), count (1) or
    max-region (2) entry."""
    out = []
    for key in keys:
        offsets = metrics.slot(key).offsets
        assert offsets is not None and offsets[part] is not None, key
        out.append(offsets[part])
    return np.array(out, dtype=np.int64)
