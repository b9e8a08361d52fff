"""Straggler verdicts from CUDA-event section times and NVML sensors (needs a GPU).

Four gloo ranks share one GPU (NCCL refuses two ranks on one device): each section is a
``torch.cuda._sleep`` kernel of a known length, timed by the profiler's CUDA events, and
rank 2's backward kernel runs 4x longer from step 20. Ground truth: the injected rank,
section and step. Every rank waits for the others in the gradient sync, as NCCL would
make it wait on the device: here a host drain inside that collective section stands in
for NCCL's device-side wait (gloo syncs the host only). The section is a collective, so
the wait is never scored.
"""

import re

import pytest
import torch
import torch.distributed as dist

from syncless.profile import Profiler
from syncless.testing import spawn_gloo

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.dist,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WORLD = 4
STEPS, REPORT_EVERY, SLOW_RANK, FROM_STEP = 80, 5, 2, 20
BASE_MS = {"forward": 2.0, "backward": 4.0}
# Rank 2's backward: 34 ms, against 4 ms elsewhere. Kernels of four processes time-slice
# the GPU, so a healthy section measures up to 4x its kernel when all four overlap;
# the ranks leave each step's sync together, so the overlap is the same on each.
EXTRA_MS = 30.0


def _cycles_per_ms() -> float:
    """The sleep kernel's cycles per ms on this GPU, timed once (outside the steps)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _train(rank: int, world: int) -> dict:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    per_ms = _cycles_per_ms()
    opened = []
    prof = Profiler(report_every=REPORT_EVERY, on_straggler=opened.append)
    grad = torch.ones(64)
    reports, sensors = [], []
    for step in range(STEPS):
        with prof.step(step):
            for name, ms in BASE_MS.items():
                with prof.section(name):
                    late = rank == SLOW_RANK and name == "backward" and step >= FROM_STEP
                    torch.cuda._sleep(int((ms + (EXTRA_MS if late else 0.0)) * per_ms))
            with prof.section("grad_sync", category="collective"):
                torch.cuda.current_stream().synchronize()  # NCCL's device wait, see above
                dist.all_reduce(grad)
        rep = prof.report(step)
        if rep is not None:
            reports.append((step, [(v.rank, v.section, v.first_step) for v in rep.stragglers]))
            sensors.append({k: v for k, v in rep.values.items() if "gpu_sensors" in k})
    return {"reports": reports, "opened": [(v.rank, v.section) for v in opened],
            "where": [v.device for v in opened],
            "sensors": sensors, "timer": type(prof._timer).__name__}  # fmt: skip


@pytest.fixture(scope="module")
def results():
    return spawn_gloo(_train, WORLD, timeout_s=300)


def test_sections_are_timed_by_cuda_events(results):
    assert {r["timer"] for r in results} == {"EventTimer"}


def test_the_slow_rank_is_named_in_backward_within_one_report_and_nobody_else(results):
    for result in results:  # every rank gathers every summary: the same verdicts
        named = {(r, s) for _, verdicts in result["reports"] for r, s, _ in verdicts}
        assert named == {(SLOW_RANK, "backward")}
        first = next(step for step, verdicts in result["reports"] if verdicts)
        assert first < FROM_STEP + 2 * REPORT_EVERY  # the report after the one it began in
        starts = {f for _, verdicts in result["reports"] for _, _, f in verdicts}
        assert starts == {FROM_STEP}
        assert result["opened"] == [(SLOW_RANK, "backward")]
        (device,) = result["where"]  # its GPU: index and PCI bus id, as nvidia-smi shows
        assert re.fullmatch(r"cuda:0( [0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.0)?", device)


def test_gpu_sensors_are_sampled_with_the_reports(results):
    pytest.importorskip("pynvml", reason="NVML sensors need nvidia-ml-py (syncless[gpu])")
    for result in results:
        # One sample a second: the reports of a window without one carry none.
        sampled = [s for s in result["sensors"] if s]
        assert sampled, "no report carried a GPU sensor sample"
        for sample in sampled:
            clock = sample["profile/gpu_sensors/sm_clock_mhz"]
            assert 100.0 < clock < 5000.0  # MHz of a real GPU, not 0 or a unit mix-up
            assert sample["profile/gpu_sensors/sm_clock_min_mhz"] <= clock
