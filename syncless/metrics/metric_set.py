"""``MetricSet``: declare, allocate, record through slots, flush once per step."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from syncless.metrics.consensus import agree
from syncless.metrics.readout import Layout, Readout, decode
from syncless.metrics.schema import Agg, MetricSpec
from syncless.metrics.slot import Slot


@dataclass
class _Pending:
    step: int
    host: np.ndarray
    event: torch.cuda.Event | None
    index: int  # the flush's ordinal (MetricSet.flushes before it)

    def landed(self) -> bool:
        return self.event is None or self.event.query()


@dataclass(frozen=True)
class Landed:
    """A flushed step's packed host values: what ``MetricSet.decode`` turns into a
    ``Readout``. From ``flush_landed``/``drain_landed`` a copy out of the pinned ring
    (later flushes reuse it), so it may be decoded on any thread."""

    step: int
    host: np.ndarray
    index: int = 0  # the flush's ordinal: every rank's n-th flush has the same


#: Pinned host buffers a flush copies into, in turn. A readout is decoded once its copy
#: has landed, so a host that runs ahead of the device keeps up to this many copies in
#: flight before a flush waits for the oldest (the only wait, and a bound on memory).
HOST_BUFFERS = 4


class MetricSet:
    """A fixed set of metrics in one packed device buffer.

    Lifecycle: ``declare`` (any number) -> ``allocate(device)`` (locks the schema,
    agrees on it across ranks, materialises the buffer) -> hooks record through the
    returned ``Slot`` objects -> ``flush(step)`` once per step on the cold path.

    Every slot records through a *gate*, a device flag of its own group of metrics (a
    monitor's: ``with metrics.gated("attention"): declare(...)``). ``set_gates`` turns
    groups on and off with a device write outside the step: that is how a cadence
    works inside a CUDA graph, whose replays re-run the hooks' kernels whatever the
    host decided at capture (docs/cuda_graphs.md).

    The buffer is float64: ``[sums | counts | maxima (minima negated)]``. A flush is
    exactly one SUM and one MAX all_reduce over the two regions (when
    torch.distributed is initialised and the group has more than one rank), one
    non-blocking D2H copy into pinned memory and one event. By default the values are
    read at the next flush (lagged), so the step never waits; ``flush(wait=True)``
    reads them now.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._slots: dict[str, Slot] = {}
        self._locked = False
        self.buffer: torch.Tensor | None = None
        self._identity: torch.Tensor | None = None
        self._pending: deque[_Pending] = deque()  # oldest first
        self._host: list[torch.Tensor] = []
        self._host_np: list[np.ndarray] = []
        self._turn = 0
        self.flushes = 0
        self.d2h_copies = 0
        self.collectives = 0
        # Gates: a device flag per group of metrics (index 0, "", is the default group).
        self._declaring_gate = ""
        self._gate_of: dict[str, str] = {}  # key -> gate name, for this rank's declares
        self.gate_names: list[str] = [""]
        self._gate_state: list[bool] = []  # the host's copy of what the device holds
        # Called at the start of every flush, on its thread: recorders that batch
        # their device work up to the flush (syncless.monitors.layer_batch) finish it.
        self.before_flush: list[Callable[[], None]] = []

    # -- declaration ---------------------------------------------------------------

    def declare(
        self,
        area: str,
        name: str,
        agg: Agg,
        size: int = 1,
        layer: int | None = None,
        element: str = "i",
        emit_elements: bool = True,
        derive_global: bool = True,
        gate: str | None = None,
    ) -> Slot:
        """Declare a metric and return its slot. Declaring the same key twice with the
        same definition returns the same slot; a different definition raises.

        ``gate``: the group whose device flag gates its records (default: the one of the
        enclosing ``gated`` block, else the default group)."""
        spec = MetricSpec(area, name, agg, size, layer, element, emit_elements, derive_global)
        if self._locked:
            raise RuntimeError(
                f"cannot declare {spec.key!r}: the schema is locked by allocate(). "
                "Declare every metric at registration, before allocate()."
            )
        existing = self._slots.get(spec.key)
        if existing is not None:
            if existing.spec != spec:
                raise ValueError(
                    f"metric {spec.key!r} already declared as {existing.spec}, now as {spec}"
                )
            return existing
        slot = self._slots[spec.key] = Slot(spec)
        gate = self._declaring_gate if gate is None else gate
        self._gate_of[spec.key] = gate
        if gate not in self.gate_names:
            self.gate_names.append(gate)
        return slot

    @contextmanager
    def gated(self, gate: str) -> Iterator[None]:
        """Metrics declared inside record through the device flag ``gate``."""
        before, self._declaring_gate = self._declaring_gate, gate
        try:
            yield
        finally:
            self._declaring_gate = before

    def slot(self, key: str) -> Slot:
        """The slot of a declared metric (for setup code; hooks should keep slots)."""
        try:
            return self._slots[key]
        except KeyError:
            declared = ", ".join(sorted(self._slots)) or "(none)"
            raise KeyError(
                f"metric {key!r} was not declared; declared metrics: {declared}"
            ) from None

    def record(self, key: str, value: torch.Tensor, count: int | torch.Tensor = 1) -> None:
        """Record by key: a dict lookup per call, so prefer keeping the slot in hooks."""
        self.slot(key).record(value, count)

    @property
    def specs(self) -> list[MetricSpec]:
        return [s.spec for s in self._slots.values()]

    def layer_specs(self, area: str, name: str) -> dict[int, MetricSpec]:
        """Layer -> spec of the layer metric ``area/layer_XX/name``, sorted by layer.

        Over the allocated schema: every rank's layers, not only the ones declared
        here (pipeline stages hold different layers). A monitor's ``derive`` runs on
        rank 0 over the cluster-wide readout, so it builds its tables from this.
        """
        if not self._locked:
            raise RuntimeError(
                f"layer_specs({area!r}, {name!r}) before allocate(): the layers of other "
                "ranks are known only once allocate() agreed on the schema; call it from "
                "a monitor's attach(), not prepare()"
            )
        found = {
            s.layer: s
            for s in self._specs
            if s.layer is not None and s.area == area and s.name == name
        }
        return dict(sorted(found.items()))

    # -- allocation ----------------------------------------------------------------

    def allocate(self, device: torch.device | str) -> None:
        if self._locked:
            raise RuntimeError("allocate() was already called on this MetricSet")
        self._locked = True
        device = torch.device(device)
        self._specs = agree(self.specs, self.group)
        for spec in self._specs:  # keys other ranks own: slots nobody here records into
            self._slots.setdefault(spec.key, Slot(spec))
        # [sums | counts | maxima]: each region contiguous, so a flush decodes it with a
        # few whole-array passes (syncless.metrics.readout) and reduces it with two
        # collectives over two contiguous views.
        n_sum = sum(s.size for s in self._specs if s.agg in ("mean", "sum"))
        sum_at = max_at = 0
        self._offsets = []
        for spec in self._specs:
            if spec.agg in ("mean", "sum"):
                self._offsets.append((sum_at, n_sum + sum_at, None))
                sum_at += spec.size
            else:
                self._offsets.append((None, None, 2 * n_sum + max_at))
                max_at += spec.size
        self._sum_len = sum_len = 2 * n_sum
        max_len = max_at
        self._layout = Layout(self._specs, self._offsets, n_sum, max_len)
        self.buffer = torch.zeros(sum_len + max_len, dtype=torch.float64, device=device)
        self._reset()
        # One float64 flag (multiplies sums and counts) and one bool flag (selects
        # maxima) per gate, all on at first.
        self.gates = torch.ones(len(self.gate_names), dtype=torch.float64, device=device)
        self.gates_on = torch.ones(len(self.gate_names), dtype=torch.bool, device=device)
        self._gate_state = [True] * len(self.gate_names)
        # Views made once: a view per write would be a torch call of host time each.
        self._gate_views = [(self.gates[i], self.gates_on[i]) for i in range(len(self.gate_names))]
        self.gate, self.gate_on = self._gate_views[0]  # the default group's
        # The label of the step being recorded, for "first step" metrics (a NaN's step
        # stays on the device until the flush): set_step_label writes it.
        self.step_label = torch.zeros((), dtype=torch.float64, device=device)
        neg_inf = torch.full((), -torch.inf, dtype=torch.float64, device=device)
        for spec, offsets in zip(self._specs, self._offsets, strict=True):
            gate, gate_on = self.gate_views(self._gate_of.get(spec.key, ""))
            self._slots[spec.key].bind(self.buffer, offsets, gate, gate_on, neg_inf)
        if device.type == "cuda":
            self._static_for_compile()
        pin = device.type == "cuda"
        self._host = [
            torch.empty(self.buffer.numel(), dtype=torch.float64, pin_memory=pin)
            for _ in range(HOST_BUFFERS)
        ]
        # numpy views made once here: reading the landed copy is then plain host memory
        # access, not a torch call a sync detector would have to reason about.
        self._host_np = [t.numpy() for t in self._host]

    def _static_for_compile(self) -> None:
        """Mark what hooks write and read as staying at its address. torch.compile's
        ``mode="reduce-overhead"`` captures each compiled region in a CUDA graph, and
        skips any region that writes an input it does not know to stay put (the hooks
        write the slots' views of the buffer); reads of unmarked inputs cost a copy."""
        from torch._dynamo import mark_static_address

        tensors = [self.buffer, self.gates, self.gates_on, self.step_label]
        tensors += [t for pair in self._gate_views for t in pair]
        tensors += [t for slot in self._slots.values() for t in slot.views()]
        for t in tensors:
            mark_static_address(t)

    def _reset(self) -> None:
        # One copy from the identities (zeros, then -inf): one op where zero_ and fill_
        # on two slices are four torch calls of the training thread's host time.
        assert self.buffer is not None
        if self._identity is None:
            self._identity = torch.zeros_like(self.buffer)
            self._identity[self._sum_len :] = -torch.inf
        self.buffer.copy_(self._identity)

    def set_step_label(self, label: int) -> None:
        """The label of the next recorded step (one fill launch, no host read)."""
        self.step_label.fill_(float(label))

    def set_enabled(self, enabled: bool) -> None:
        """Turn every gate on or off on the device (no retrace, no graph re-capture)."""
        self.gates.fill_(1.0 if enabled else 0.0)
        self.gates_on.fill_(enabled)
        self._gate_state = [enabled] * len(self.gate_names)

    def gate_index(self, gate: str) -> int:
        """The position of ``gate``'s flag in ``gates`` (``SlotGroup``'s fold reads it)."""
        try:
            return self.gate_names.index(gate)
        except ValueError:
            raise KeyError(
                f"no metric was declared under gate {gate!r}; gates: {self.gate_names}"
            ) from None

    def gate_of(self, key: str) -> str:
        """The gate a metric was declared under (the default one for other ranks' keys)."""
        return self._gate_of.get(key, "")

    def gate_views(self, gate: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate``'s float64 and bool device flags (0-d views, fixed at allocate)."""
        if self.buffer is None:
            raise RuntimeError(f"gate_views({gate!r}) before allocate()")
        return self._gate_views[self.gate_index(gate)]

    def set_gates(self, states: Mapping[str, bool]) -> None:
        """Turn gates on or off: two fill launches per gate that changed, none for the
        others (the host keeps what it wrote). Stream-ordered: the next step's kernels,
        replayed from a graph or not, read the new values."""
        names = self.gate_names
        for gate, on in states.items():
            if gate not in names:  # a group that declared no metric records nothing
                continue
            i = names.index(gate)
            if self._gate_state[i] != on:
                self._gate_state[i] = on
                flag, flag_on = self._gate_views[i]
                flag.fill_(1.0 if on else 0.0)
                flag_on.fill_(on)

    def gate_state(self, gate: str) -> bool:
        """What the host last wrote into ``gate`` (no device read)."""
        return self._gate_state[self.gate_index(gate)]

    # -- flush ---------------------------------------------------------------------

    def flush(self, step: int, wait: bool = False) -> list[Readout]:
        """Reduce across ranks, start the D2H copy, reset; return finished readouts.

        Lagged (default): returns the readouts of earlier flushes whose copies have
        landed, oldest first (usually just the previous one; none at the first flush,
        or while the device is still behind). It waits only when every host buffer
        holds a copy not landed yet (the host ``HOST_BUFFERS`` flushes ahead), and then
        only for the oldest. ``wait=True``: also waits for this flush and returns it.
        """
        return [self.decode(c) for c in self._flush(step, wait, copy=False)]

    def flush_landed(self, step: int, wait: bool = False, copy: bool = True) -> list[Landed]:
        """``flush`` without the decode: the landed steps' values copied out of the
        pinned ring (a ~200 KB memcpy on the demo's large schema), for ``decode`` on
        another thread while this one goes on training. ``copy=False``: views into the
        ring, valid until the next flush (decode them before it)."""
        return self._flush(step, wait, copy=copy)

    def decode(self, landed: Landed) -> Readout:
        """The ``Readout`` of a ``flush_landed`` copy (pure numpy: any thread)."""
        return decode(landed.step, landed.host, self._layout)

    def _flush(self, step: int, wait: bool, copy: bool) -> list[Landed]:
        """The flush; returns the landed steps, copied out of the pinned ring if
        ``copy`` (else views, decoded before the next flush), and always the one whose
        buffer this flush reuses (copied before the new copy overwrites it)."""
        if self.buffer is None:
            raise RuntimeError("flush() before allocate()")
        for finish in self.before_flush:
            finish()
        buf = self.buffer
        ready: list[Landed] = []
        if len(self._pending) == len(self._host):  # this turn's buffer is still unread
            oldest = self._landed(self._pending.popleft())
            ready.append(Landed(oldest.step, oldest.host.copy(), oldest.index))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            # The two packed collectives of a flush; contiguous views of one buffer.
            dist.all_reduce(buf[: self._sum_len], op=dist.ReduceOp.SUM, group=self.group)
            dist.all_reduce(buf[self._sum_len :], op=dist.ReduceOp.MAX, group=self.group)
            self.collectives += 2
        host, host_np = self._host[self._turn], self._host_np[self._turn]
        self._turn = (self._turn + 1) % len(self._host)
        host.copy_(buf, non_blocking=buf.is_cuda)
        self.d2h_copies += 1
        event = None
        if buf.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._reset()  # stream-ordered after the copy
        self.flushes += 1
        landed = []
        while self._pending and self._pending[0].landed():
            landed.append(self._pending.popleft())
        current = _Pending(step, host_np, event, self.flushes - 1)
        if wait:
            landed += [self._landed(p) for p in (*self._pending, current)]
            self._pending.clear()
        else:
            self._pending.append(current)
        return ready + [Landed(p.step, p.host.copy() if copy else p.host, p.index) for p in landed]

    def drain(self) -> list[Readout]:
        """Every readout still pending (waiting for copies in flight), oldest first."""
        return [self.decode(c) for c in self.drain_landed()]

    def drain_landed(self) -> list[Landed]:
        """``drain`` without the decode (see ``flush_landed``)."""
        pending, self._pending = list(self._pending), deque()
        return [Landed(p.step, self._landed(p).host.copy(), p.index) for p in pending]

    def _landed(self, pending: _Pending) -> _Pending:
        if pending.event is not None:
            # Landed already (checked by query) unless called from wait=True, drain(),
            # or with every host buffer in flight.
            pending.event.synchronize()
        return pending
