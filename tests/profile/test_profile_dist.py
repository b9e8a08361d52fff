"""Two gloo ranks: an injected delay must land in rendezvous, not transfer."""

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
    prof = Profiler(report_every=STEPS)
    x = torch.ones(256)
    with census(cpu_as_device=True) as c:
        for s in range(STEPS):
            with prof.step(s):
                with prof.section("fast"):
                    y = x * 2.0
                with prof.section("slow"):
                    if rank == 1:
                        time.sleep(DELAY_S)
                prof.all_reduce(y, name="moe_a2a")
            c.step()
    rep = prof.report()
    assert rep is not None
    return {
        "rows": {r.name: r for r in rep.rows},
        "lates": rep.lates,
        "values": rep.values,
        "records": [r.name for r in rep.records],
        "syncs": c.total,
        "sites": [str(site) for site, _ in c.by_site()],
        "y": y[:2].tolist(),
    }


def test_delay_on_rank1_is_rendezvous_wait_on_rank0():
    r0, r1 = spawn_gloo(_skew_worker, 2)
    delay_ms = DELAY_S * 1e3
    rdv0 = r0["rows"]["moe_a2a/rendezvous"]
    # Per call: rank 0 waited for rank 1's sleep in the 1-element all_reduce...
    assert rdv0.calls_per_step == 1.0
    assert rdv0.us_per_call / 1e3 >= 0.8 * delay_ms
    # ...and the real collective did not absorb it.
    assert r0["rows"]["moe_a2a/transfer"].us_per_call / 1e3 < 0.2 * delay_ms
    # The late rank waits little in its own rendezvous.
    assert r1["rows"]["moe_a2a/rendezvous"].us_per_call / 1e3 < 0.2 * delay_ms
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
