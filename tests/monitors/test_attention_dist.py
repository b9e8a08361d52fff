"""AttentionMonitor across two gloo ranks: max over ranks, count-weighted entropy.

Each rank measures its own rows; every rank then reads the cluster view, with a rank
that samples weighted by its stride.
"""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import (  # tests/monitors is on sys.path (no __init__.py)
    ENT,
    FRAC,
    MAX,
    fake_site,
    flush,
    monitored,
    naive,
    qk,
)

from syncless.testing import spawn_gloo

# -- two gloo ranks -----------------------------------------------------------------

# Unequal query counts per rank (rank 1 has 6x the rows) and different logit spreads,
# so the mean of per-rank means is far from the count-weighted mean.
RANK_BATCH, RANK_SPREAD, DIST_LEN = (1, 3), (0.3, 4.0), 8


def _rank_inputs(rank: int):
    return qk(RANK_BATCH[rank], 4, 2, 2 * DIST_LEN if rank else DIST_LEN, seed=10 + rank,
              spread=RANK_SPREAD[rank])  # fmt: skip


def _dist_worker(rank, world):
    out = []
    # exact everywhere; then a budget under which rank 1 samples (stride 2) and rank 0 not
    for budget in (2**24, 3 * 4 * 16 * 8):
        site = fake_site(heads=4, kv_heads=2)
        _, ms = monitored([site], max_elements=budget)
        site.fire(*_rank_inputs(rank))
        readout = flush(ms)
        out.append({key: readout.get(key) for key in (MAX.format(0), ENT.format(0), FRAC)})
    return out


@pytest.mark.dist
def test_two_ranks_aggregate_max_and_count_weighted_entropy():
    results = spawn_gloo(_dist_worker, 2)
    scale = 8**-0.5
    refs = [naive(*_rank_inputs(r), scale, True) for r in range(2)]
    exact = refs[0].merge(refs[1])
    # rank 1 sampled with stride 2 at phase 0: rows 0, 2, ..., its sum scaled by 2
    q1, k1 = _rank_inputs(1)
    sampled1 = naive(q1, k1, scale, True, rows=range(0, 2 * DIST_LEN, 2))
    mixed = refs[0].merge(sampled1, entropy_weight=2.0)
    for exact_values, mixed_values in results:  # every rank sees the cluster view
        np.testing.assert_allclose(exact_values[MAX.format(0)], exact.maxes, rtol=1e-5)
        weighted = np.array(exact.entropy_sums) / exact.seen
        np.testing.assert_allclose(exact_values[ENT.format(0)], weighted, rtol=1e-5)
        np.testing.assert_allclose(exact_values[FRAC], [1.0])
        per_rank_means = np.mean([np.array(r.entropy_sums) / r.seen for r in refs], axis=0)
        assert np.all(np.abs(weighted - per_rank_means) > 0.05)

        np.testing.assert_allclose(mixed_values[MAX.format(0)], mixed.maxes, rtol=1e-5)
        np.testing.assert_allclose(
            mixed_values[ENT.format(0)], np.array(mixed.entropy_sums) / mixed.seen, rtol=1e-5
        )
        used = refs[0].seen + sampled1.rows
        np.testing.assert_allclose(mixed_values[FRAC], [used / mixed.seen])
