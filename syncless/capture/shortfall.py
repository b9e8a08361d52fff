"""The first drop for lack of room, explained: the rate captures need against the rates
the engine's stages reached.

A team that dumps activations must learn at the first lost record, not at the end of
the run, that its volume exceeds what the machine can store, and which stage is the
limit: the device-to-host copies, the sink (the disk, the object store), or neither
(a burst larger than the ring). The numbers come from the engine's cumulative counters
since its first capture, so the message costs nothing until it is printed, once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

__all__ = ["Shortfall"]


class Shortfall:
    """Says once, on stderr, why the first record that found no room was dropped.

    Which stage is short is read from where the bytes wait: a full staging ring means
    the sink is not writing fast enough (the drain has nowhere to copy to); a full
    device ring with staging room means the drain and its device-to-host copies were
    outrun, by the average rate or by a burst. The rates since the first capture say
    by how much.
    """

    def __init__(self, sink_name: str, writers: int, ring_bytes: int, staging_bytes: int) -> None:
        self._sink_name = sink_name
        self._writers = writers
        self._ring_bytes = ring_bytes
        self._staging_bytes = staging_bytes
        self.started: float | None = None  # monotonic time of the first capture
        self.message: str | None = None

    def start(self) -> None:
        """The first capture: the rates are measured from now."""
        self.started = time.monotonic()

    def drop(
        self,
        counters: Mapping[str, float],
        reason: str,
        tag: str,
        step: int | None,
        recent_sink: tuple[float, int] | None = None,
    ) -> None:
        """A record found no room: the first time, say why on stderr and keep it as
        :attr:`message`. From the engine's ``counters()`` (cumulative counters and
        current gauges) and the sink's rate over its last shards
        (:meth:`SinkWriter.recent_rate <syncless.capture.writer.SinkWriter.recent_rate>`):
        GB/s and how many shards."""
        if self.message is not None:
            return
        elapsed = time.monotonic() - (self.started or time.monotonic())
        need = _rate(counters["offered_bytes"], elapsed)
        stored = _rate(counters["stored_bytes"], elapsed)
        d2h = _rate(counters["d2h_bytes"], counters["d2h_ms"] / 1e3)
        average = _rate(counters["stored_bytes"], counters["sink_ms"] / 1e3 / self._writers)
        # The rate the sink keeps now: a disk's page cache takes the first minutes at
        # memory speed, and only the recent shards show the disk behind it.
        sink = recent_sink[0] if recent_sink else average
        sink_rate = f"{_gbps(average)} while it writes"
        if recent_sink:
            sink_rate = (
                f"{_gbps(sink)} over its last {recent_sink[1]} shards ({_gbps(average)} "
                f"on average while it writes)"
            )
        where = f" at step {step}" if step is not None else ""
        writers = f", {self._writers} writers" if self._writers > 1 else ""
        text = (
            f"syncless: capture dropped its first record ({reason}, tag {tag!r}{where}). "
            f"Captures arrive at {_gbps(need)} since the first, {elapsed:.1f} s ago; "
            f"{_gbps(stored)} of it was stored. The device-to-host copies run at "
            f"{_gbps(d2h)}, the sink ({self._sink_name}{writers}) writes {sink_rate}. "
        )
        if reason == "records_full":
            text += (
                "Every record slot is in flight (many small captures): raise "
                "EngineConfig.max_records, or capture fewer, larger tensors."
            )
        elif counters["staging_used_bytes"] >= 0.9 * self._staging_bytes:
            text += "The staging ring is full: the sink is the limit. "
            if sink:
                text += f"Keep the volume under {_gbps(sink)}, or give "
            else:
                text += "It has not finished a write yet. Check it, or give "
            text += "the sink more writers (EngineConfig.writers) or a faster disk."
        else:
            text += (
                f"Staging has room, so the {self._ring_bytes / 2**20:.0f} MiB device ring "
                f"filled faster than the drain emptied it: raise ring_bytes for bursts, "
                f"or capture less if the average rate is above the copies' rate."
            )
        self.message = text + (
            f" Further drops are counted (capture/step/dropped_{reason}_count), not "
            f'printed; on_full="block" slows the step instead of dropping.'
        )
        print(self.message, file=sys.stderr)


def _rate(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 else None


def _gbps(rate: float | None) -> str:
    return "n/a GB/s" if rate is None else f"{rate:.2f} GB/s"
