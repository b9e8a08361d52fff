"""Two gloo ranks: an injected delay must land in rendezvous, not transfer."""

import statistics
import time

import pytest
import torch

from syncless.guard import census
from syncless.profile import Profiler
from syncless.testing import spawn_gloo

pytestmark = pytest.mark.dist

DELAY_S = 0.05
STEPS = 4


def _skew_worker(rank, world):
    # A report per step: the timing assertions take the median over steps, since a
    # mean over the window took in any stall of this shared 2-core host (one CI run
    # saw 19 ms of "transfer" per call for 256 floats, both ranks alike).
    prof = Profiler(report_every=1)
    x = torch.ones(256)
    syncs, sites, reports = 0, [], []
    for s in range(STEPS):
        with census(cpu_as_device=True) as c:
            with prof.step(s):
                with prof.section("fast"):
                    y = x * 2.0
                with prof.section("slow"):
                    if rank == 1:
                        time.sleep(DELAY_S)
                prof.all_reduce(y, name="moe_a2a")
            c.step()
        syncs += c.total
        sites += [str(site) for site, _ in c.by_site()]
        reports.append(prof.report())  # the gather: outside the census, not in a step
    assert all(rep is not None for rep in reports)
    rep = reports[-1]
    return {
        "rows": {r.name: r for r in rep.rows},
        "lates": rep.lates,
        "values": rep.values,
        "records": [r.name for r in rep.records],
        "syncs": syncs,
        "sites": sites,
        "y": y[:2].tolist(),
        "ms": {  # per step: row -> ms per call
            name: [r.row(name).us_per_call / 1e3 for r in reports]
            for name in ("moe_a2a/rendezvous", "moe_a2a/transfer")
        },
    }


def test_delay_on_rank1_is_rendezvous_wait_on_rank0():
    r0, r1 = spawn_gloo(_skew_worker, 2)
    delay_ms = DELAY_S * 1e3
    assert r0["rows"]["moe_a2a/rendezvous"].calls_per_step == 1.0
    # Per call, the median step: rank 0 waited for rank 1's sleep in the 1-element
    # all_reduce...
    assert statistics.median(r0["ms"]["moe_a2a/rendezvous"]) >= 0.8 * delay_ms
    # ...and the real collective did not absorb it.
    assert statistics.median(r0["ms"]["moe_a2a/transfer"]) < 0.2 * delay_ms
    # The late rank waits little in its own rendezvous.
    assert statistics.median(r1["ms"]["moe_a2a/rendezvous"]) < 0.2 * delay_ms
    for r in (r0, r1):  # every rank sees the same verdict
        (late,) = r["lates"]
        assert late.collective == "moe_a2a"
        assert late.late_rank == 1
        assert late.culprit == "slow"
        assert late.culprit_excess_ms >= 0.8 * delay_ms
        assert r["values"]["profile/moe_a2a/late_rank"] == 1.0
        # Cross-rank spread of "slow": max is on rank 1.
        slow = r["rows"]["slow"]
        assert slow.max_rank == 1 and slow.rank_max_ms >= delay_ms
        assert r["y"] == [4.0, 4.0]  # the wrapped all_reduce really ran (2 ranks x 2.0)
        # events mode: nothing in the step would sync (the profiler reads no tensor).
        assert r["syncs"] == 0, r["sites"]
    names = set(r0["records"])
    for n in ("rendezvous_ms", "transfer_ms", "enqueue_ms", "time_ms", "calls_count"):
        assert f"profile/moe_a2a/{n}" in names
    assert {"profile/self/host_ms", "profile/self/misuse_count", "profile/step/time_ms"} <= names


def _wrappers_worker(rank, world):
    from syncless.profile import OFF

    out = {}
    for label, prof in (("profiler", Profiler(report_every=1)), ("off", OFF)):
        mine = torch.full((2,), float(rank + 1))
        summed, gathered, swapped = mine.clone(), torch.empty(2 * world), torch.empty(2)
        with census(cpu_as_device=True) as c:
            with prof.step(0):
                prof.all_reduce(summed, name="sum")
                prof.all_gather_into_tensor(gathered, mine, name="gather")
                prof.all_to_all_single(swapped, torch.tensor([rank * 10.0, rank * 10.0 + 1]))
            c.step()
        rows = {r.name for r in prof.report().rows} if label == "profiler" else set()
        out[label] = {
            "sum": summed.tolist(), "gather": gathered.tolist(), "swap": swapped.tolist(),
            "syncs": c.total, "rows": rows,
        }  # fmt: skip
    return out


def test_every_wrapper_of_the_profiler_and_of_off_runs_its_collective():
    results = spawn_gloo(_wrappers_worker, 2)
    for rank, r in enumerate(results):
        for label in ("profiler", "off"):
            got = r[label]
            assert got["sum"] == [3.0, 3.0]  # 1 + 2
            assert got["gather"] == [1.0, 1.0, 2.0, 2.0]
            # all_to_all: element j of rank i goes to rank j, at position i.
            assert got["swap"] == [0.0 + rank, 10.0 + rank]
            assert got["syncs"] == 0
        timed = {"sum/transfer", "gather/transfer", "all_to_all/transfer"}
        assert timed <= r["profiler"]["rows"], r["profiler"]["rows"]
