"""GPU sensors through NVML: SM clock, power, temperature and utilisation of one GPU.

A daemon thread samples the GPU every ``interval_s`` into a small ring; the profiler
takes a :class:`SensorSummary` per report, which rides in the rank's summary through
the report's one gather (syncless.profile.stragglers names a rank whose clock fell).
NVML is optional (``pip install "syncless[gpu]"``, the ``nvidia-ml-py`` package):
without it, or without a GPU it can open, one warning says so and the profiler goes on
without sensors.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

__all__ = ["GpuSensors", "Sample", "SensorSummary"]

log = logging.getLogger(__name__)

# One warning per process for a missing NVML, however many profilers start.
_warned = False


class Sample(NamedTuple):
    """One reading of the GPU."""

    time: float  # time.monotonic()
    sm_clock_mhz: float
    power_w: float
    temperature_c: float
    util_frac: float


@dataclass(frozen=True, slots=True)
class SensorSummary:
    """The samples of one report window (record names: ``profile/gpu_sensors/<field>``)."""

    sm_clock_mhz: float  # median
    sm_clock_min_mhz: float
    power_mean_w: float
    temperature_max_c: float
    util_mean_frac: float
    samples_count: float


def summarize(samples: list[Sample]) -> SensorSummary | None:
    """The summary of ``samples``; None for none."""
    if not samples:
        return None
    return SensorSummary(
        sm_clock_mhz=statistics.median(s.sm_clock_mhz for s in samples),
        sm_clock_min_mhz=min(s.sm_clock_mhz for s in samples),
        power_mean_w=statistics.fmean(s.power_w for s in samples),
        temperature_max_c=max(s.temperature_c for s in samples),
        util_mean_frac=statistics.fmean(s.util_frac for s in samples),
        samples_count=float(len(samples)),
    )


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("%s", message)


class GpuSensors:
    """Samples one GPU on a daemon thread; :meth:`summary` drains the ring.

    Example::

        sensors = GpuSensors.start(torch.cuda.current_device())  # None without NVML
        ...
        summary = sensors.summary()  # a dict per report window, or None

    Args:
        nvml: the ``pynvml`` module (tests pass a stand-in).
        handle: the NVML device handle.
        interval_s: seconds between samples.
        capacity: samples kept; older ones are dropped (a report every 10 minutes at 1 s
            keeps its last 10 minutes with the default).
    """

    def __init__(self, nvml: Any, handle: Any, interval_s: float = 1.0, capacity: int = 600):
        self._nvml = nvml
        self._handle = handle
        self.interval_s = interval_s
        self._ring: deque[Sample] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors = 0  # samples NVML failed to read (the first is logged)
        self._thread = threading.Thread(target=self._loop, name="syncless-gpu-sensors", daemon=True)

    @classmethod
    def start(cls, device: int = 0, interval_s: float = 1.0, nvml: Any = None) -> GpuSensors | None:
        """Sample CUDA device ``device`` (its NVML handle found by UUID, so that
        CUDA_VISIBLE_DEVICES does not matter); None, with one warning, without NVML."""
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            handle = _handle(nvml, device)
        except Exception as e:  # ImportError, NVMLError: no sensors, never a crash
            _warn_once(
                f"syncless: no GPU sensors (SM clock, power, temperature): NVML is not "
                f'available ({type(e).__name__}: {e}); pip install "syncless[gpu]"'
            )
            return None
        sensors = cls(nvml, handle, interval_s)
        sensors.sample()  # the first reading now: a report soon after start has one
        sensors._thread.start()
        return sensors

    def sample(self) -> Sample | None:
        """Read the GPU once into the ring (the thread's work; tests call it)."""
        nvml, handle = self._nvml, self._handle
        try:
            reading = Sample(
                time.monotonic(),
                float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
                nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # mW
                float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
                nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
            )
        except Exception as e:
            self.errors += 1
            if self.errors == 1:
                log.warning("syncless: reading the GPU sensors failed (%s); counting", e)
            return None
        with self._lock:
            self._ring.append(reading)
        return reading

    def summary(self) -> dict[str, float] | None:
        """The samples since the last call, summarized (a dict: it travels in the
        gathered RankSummary); None when there were none."""
        with self._lock:
            samples = list(self._ring)
            self._ring.clear()
        summary = summarize(samples)
        return None if summary is None else asdict(summary)

    def close(self) -> None:
        """Stop the thread (it is a daemon: a process may also just exit)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


def _handle(nvml: Any, device: int) -> Any:
    """The NVML handle of CUDA device ``device``: by UUID where torch knows it."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return nvml.nvmlDeviceGetHandleByIndex(device)
