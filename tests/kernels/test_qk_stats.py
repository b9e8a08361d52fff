"""The QK stats kernel against a float64 reference, on shapes long enough for key blocks
without masks (the monitor tests' sequences fit in one key block: only the masked path).

Runs the compiled kernel on CUDA, the Triton interpreter elsewhere (tests/conftest.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from syncless import kernels

pytestmark = pytest.mark.skipif(
    not kernels.triton_importable() or not (torch.cuda.is_available() or kernels.interpreting()),
    reason="needs triton with a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(q, k, scale, causal, window, phase, stride):
    """Per head: max logit and entropy sum (nats) over rows ``phase::stride``, float64."""
    h, hkv = q.shape[1], k.shape[1]
    q_len, k_len = q.shape[2], k.shape[2]
    kk = k.double().repeat_interleave(h // hkv, dim=1)
    logits = q.double() @ kk.transpose(-1, -2) * scale
    pos = torch.arange(q_len, device=q.device)[:, None] + k_len - q_len
    key = torch.arange(k_len, device=q.device)[None, :]
    allowed = (key <= pos) if causal else torch.ones_like(key <= pos)
    if window is not None:
        allowed = allowed & (pos - key < window)
    logits = logits.masked_fill(~allowed, -math.inf)[:, :, phase::stride]
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    return logits.amax(dim=(0, 2, 3)), entropy.sum(dim=(0, 2))


def _folded(partials, batch, heads):
    p = partials.reshape(batch, -1, 2 * heads + 1).double()
    return p[..., :heads].amax(dim=(0, 1)), p[..., heads:-1].sum(dim=(0, 1)), p[..., -1].sum()


CASES = [
    # q_len, k_len, causal, window, phase, stride, dtype
    pytest.param(300, 300, True, None, 0, 1, torch.float32, id="causal-3-row-blocks"),
    pytest.param(200, 290, True, None, 0, 1, torch.bfloat16, id="causal-kv-cache-bf16"),
    pytest.param(77, 100, False, None, 0, 1, torch.float32, id="cross-ragged-tail"),
    pytest.param(300, 300, True, None, 1, 2, torch.float32, id="sampled-stride-2"),
    pytest.param(300, 300, True, 50, 2, 3, torch.float32, id="sampled-window"),
]


@pytest.mark.parametrize(("q_len", "k_len", "causal", "window", "phase", "stride", "dtype"), CASES)
def test_partials_match_the_reference(q_len, k_len, causal, window, phase, stride, dtype):
    batch, heads, kv_heads, head_dim = 2, 2, 1, 16
    g = torch.Generator().manual_seed(q_len + stride)
    # spread 3: the running max grows often, so the rescaling of S and T is exercised
    q = (torch.randn(batch, heads, q_len, head_dim, generator=g) * 3).to(DEVICE, dtype)
    k = torch.randn(batch, kv_heads, k_len, head_dim, generator=g).to(DEVICE, dtype)
    scale = head_dim**-0.5
    partials = kernels.qk_stats_partials(q, k, scale, causal, window, phase, stride)
    maxes, entropy, rows = _folded(partials, batch, heads)
    ref_maxes, ref_entropy = _reference(q, k, scale, causal, window, phase, stride)
    assert rows.item() == batch * len(range(phase, q_len, stride))
    np.testing.assert_allclose(maxes.cpu(), ref_maxes.cpu(), rtol=1e-5)
    np.testing.assert_allclose(entropy.cpu(), ref_entropy.cpu(), rtol=1e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_grouped_partials_match_the_reference_per_layer(window):
    layers, batch, heads, length, head_dim = 2, 1, 2, 200, 16
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(layers, batch, heads, length, head_dim, generator=g) * 3).to(DEVICE)
    k = torch.randn(layers, batch, heads, length, head_dim, generator=g).to(DEVICE)
    offsets = [i * q[0].numel() for i in range(layers)] + [i * k[0].numel() for i in range(layers)]
    offsets = torch.tensor(offsets, device=DEVICE)
    scale = head_dim**-0.5
    out = kernels.qk_stats_partials_grouped(q[0], k[0], offsets, layers, scale, True, window)
    width = 2 * heads + 1
    for i in range(layers):
        maxes, entropy, rows = _folded(out[:, i * width : (i + 1) * width], batch, heads)
        ref_maxes, ref_entropy = _reference(q[i], k[i], scale, True, window, 0, 1)
        assert rows.item() == batch * length
        np.testing.assert_allclose(maxes.cpu(), ref_maxes.cpu(), rtol=1e-5)
        np.testing.assert_allclose(entropy.cpu(), ref_entropy.cpu(), rtol=1e-5)
