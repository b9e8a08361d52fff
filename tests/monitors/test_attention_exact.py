"""AttentionMonitor's exact mode against the naive per-(batch, head, query) reference.

Every query row is used: the per-head max logit and mean entropy must equal the
float64 loop's (attention_helpers) for MHA, GQA, MQA, cross attention, a KV cache and
a sliding window, in low precision and under autocast, and across calls.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_helpers import (  # tests/monitors is on sys.path (no __init__.py)
    ENT,
    MAX,
    check,
    fake_site,
    flush,
    monitored,
    naive,
    qk,
)

# -- exact mode ---------------------------------------------------------------------

SHAPES = [
    # batch, heads, kv_heads, q_len, k_len, causal, window
    pytest.param(2, 4, 4, 7, 7, True, None, id="mha-causal"),
    pytest.param(2, 6, 2, 9, 9, True, None, id="gqa-causal"),
    pytest.param(3, 4, 1, 5, 11, False, None, id="mqa-cross"),
    pytest.param(1, 2, 2, 4, 10, True, None, id="causal-kv-cache"),
    pytest.param(2, 4, 2, 12, 12, True, 3, id="gqa-sliding-window"),
    pytest.param(1, 3, 3, 1, 1, True, None, id="one-token"),
]


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "q_len", "k_len", "causal", "window"), SHAPES
)
def test_exact_statistics_match_the_naive_reference(
    batch, heads, kv_heads, q_len, k_len, causal, window, kernel_backend
):
    site = fake_site(heads=heads, kv_heads=kv_heads, causal=causal, window=window)
    mon, ms = monitored([site])
    q, k = qk(batch, heads, kv_heads, q_len, k_len, seed=q_len)
    site.fire(q, k)
    check(flush(ms), naive(q, k, site.scale, causal, window), frac=1.0)
    assert mon.plans.builds == (1 if kernel_backend == "torch" else 0)  # the kernel needs none


def test_low_precision_inputs_and_autocast_are_computed_in_float32():
    site = fake_site(heads=4, kv_heads=2)
    _, ms = monitored([site])
    q, k = qk(2, 4, 2, 16, spread=6.0)
    q, k = q.bfloat16(), k.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        site.fire(q, k)
    # The reference sees the same bf16 values, in float64: a bf16 matmul/softmax would
    # miss by ~1e-2, the float32 path agrees to ~1e-6.
    check(flush(ms), naive(q.float(), k.float(), site.scale, True))


def test_float32_qk_under_autocast_are_rounded_as_sdpa_sees_them(kernel_backend):
    """HF under bf16 autocast hands float32 q/k (float32 cos/sin) and SDPA casts them
    to bf16: the logits are those of the bf16 values (the float32 ones differ)."""
    site = fake_site(heads=4, kv_heads=2)
    _, ms = monitored([site])
    q, k = qk(2, 4, 2, 16, spread=6.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        site.fire(q, k)
    readout = flush(ms)
    check(readout, naive(q.bfloat16().float(), k.bfloat16().float(), site.scale, True))
    exact = naive(q, k, site.scale, True).maxes
    assert not np.allclose(readout.get(MAX.format(0)), exact, rtol=1e-6)


def test_two_calls_accumulate_max_and_count_weighted_mean():
    site = fake_site(heads=2, kv_heads=1)
    _, ms = monitored([site])
    small, large = qk(1, 2, 1, 5, seed=1, spread=0.5), qk(3, 2, 1, 9, seed=2, spread=4.0)
    site.fire(*small)
    site.fire(*large)
    ref = naive(*small, site.scale, True).merge(naive(*large, site.scale, True))
    readout = flush(ms)
    check(readout, ref, frac=1.0)
    # Not the mean of the two calls' means: 5 rows against 27 per head.
    per_call = [naive(*x, site.scale, True) for x in (small, large)]
    naive_mean = np.mean([np.array(r.entropy_sums) / r.seen for r in per_call], axis=0)
    assert np.all(np.abs(readout.get(ENT.format(0)) - naive_mean) > 1e-3)
