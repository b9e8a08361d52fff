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
    # wider than a row block plus a key block: unmasked blocks between the window's
    # lower edge and the diagonal
    pytest.param(420, 420, True, 200, 0, 1, torch.float32, id="wide-window"),
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


@pytest.mark.parametrize("head_dim", [17, 40, 80])
def test_head_dims_that_do_not_fill_a_power_of_two(head_dim):
    """head_dim is padded by masks to a power of two (17 of 32, 40 of 64, 80 of 128):
    the masked columns must add nothing to the dot, an odd D included."""
    batch, heads, kv_heads, length = 1, 2, 1, 150
    g = torch.Generator().manual_seed(head_dim)
    q = (torch.randn(batch, heads, length, head_dim, generator=g) * 3).to(DEVICE)
    k = torch.randn(batch, kv_heads, length, head_dim, generator=g).to(DEVICE)
    scale = head_dim**-0.5
    partials = kernels.qk_stats_partials(q, k, scale, True, None)
    maxes, entropy, _ = _folded(partials, batch, heads)
    ref_maxes, ref_entropy = _reference(q, k, scale, True, None, 0, 1)
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


def _rotate(x, cos, sin):
    """The rotate-half rotation in float32 (as HF computes it with float32 cos/sin)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x.float() * cos[:, None] + turned.float() * sin[:, None]


def _cos_sin(batch, length, head_dim, g):
    # per-sequence positions (batch > 1 rows differ), as with packed or offset position ids
    pos = torch.randint(0, 4 * length, (batch, length, 1), generator=g).float()
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = pos * torch.cat([inv, inv])[None, None, :]
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


@pytest.mark.parametrize(
    ("window", "cos_batch", "head_dim"),
    [(None, 1, 32), (None, 2, 32), (40, 1, 32), (40, 2, 32), (None, 2, 80)],
)
def test_unrotated_q_and_rotated_k_match_the_reference(window, cos_batch, head_dim):
    """q straight from its projection ([B, L, H*D] viewed as [B, H, L, D]), rotated in
    the kernel; k rotated by kernels.rope_rotate; both rounded to bf16 like SDPA's
    inputs under autocast. Reference: the float32 rotation, rounded to bf16, in float64.
    head_dim 80: the kernel's 80 of 128 and the rotation's halves of 40 of 64 padded by
    masks (on the H200 it caught the rotation's fused multiply-add, 1 bf16 ulp off)."""
    batch, heads, kv_heads, length = 2, 4, 2, 150
    g = torch.Generator().manual_seed(11 + cos_batch)
    q_proj = (torch.randn(batch, length, heads * head_dim, generator=g) * 3).to(torch.bfloat16)
    k_proj = torch.randn(batch, length, kv_heads * head_dim, generator=g).to(torch.bfloat16)
    q = q_proj.to(DEVICE).view(batch, length, heads, head_dim).transpose(1, 2)
    k = k_proj.to(DEVICE).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    cos, sin = _cos_sin(cos_batch, length, head_dim, g)
    k_rot = kernels.rope_rotate(k, cos, sin, torch.bfloat16)
    want_k = _rotate(k, cos, sin).to(torch.bfloat16)
    assert k_rot.is_contiguous() and k_rot.dtype == torch.bfloat16
    assert torch.equal(k_rot.cpu(), want_k.cpu())  # rounded to nearest, exactly as torch

    scale = head_dim**-0.5
    partials = kernels.qk_stats_partials(
        q, k_rot, scale, True, window, q_rope=(cos, sin), compute_dtype=torch.bfloat16
    )
    maxes, entropy, rows = _folded(partials, batch, heads)
    want_q = _rotate(q, cos, sin).to(torch.bfloat16)
    ref_maxes, ref_entropy = _reference(want_q, want_k, scale, True, window, 0, 1)
    assert rows.item() == batch * length
    np.testing.assert_allclose(maxes.cpu(), ref_maxes.cpu(), rtol=1e-5)
    np.testing.assert_allclose(entropy.cpu(), ref_entropy.cpu(), rtol=1e-5)


def test_float32_inputs_are_rounded_to_the_compute_dtype():
    """Under bf16 autocast HF hands float32 q/k (float32 cos/sin) and SDPA multiplies
    them in bf16: the statistics are those of the bf16-rounded inputs, not of float32."""
    batch, heads, length, head_dim = 1, 2, 130, 16
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(batch, heads, length, head_dim, generator=g) * 4).to(DEVICE)
    k = torch.randn(batch, heads, length, head_dim, generator=g).to(DEVICE)
    scale = head_dim**-0.5
    partials = kernels.qk_stats_partials(q, k, scale, True, None, compute_dtype=torch.bfloat16)
    maxes, entropy, _ = _folded(partials, batch, heads)
    ref_maxes, ref_entropy = _reference(
        q.to(torch.bfloat16), k.to(torch.bfloat16), scale, True, None, 0, 1
    )
    np.testing.assert_allclose(maxes.cpu(), ref_maxes.cpu(), rtol=1e-5)
    np.testing.assert_allclose(entropy.cpu(), ref_entropy.cpu(), rtol=1e-5)
    fp32_maxes, _ = _reference(q, k, scale, True, None, 0, 1)
    assert not np.allclose(maxes.cpu(), fp32_maxes.cpu(), rtol=1e-6)  # the rounding shows


def test_grouped_partials_with_unrotated_q():
    layers, batch, heads, length, head_dim = 2, 1, 2, 140, 16
    g = torch.Generator().manual_seed(9)
    q = (torch.randn(layers, batch, heads, length, head_dim, generator=g) * 3).to(DEVICE)
    k = torch.randn(layers, batch, heads, length, head_dim, generator=g).to(DEVICE)
    cos, sin = _cos_sin(1, length, head_dim, g)
    k_rot = torch.stack([kernels.rope_rotate(k[i], cos, sin, torch.float32) for i in range(2)])
    # cos/sin are the same tensors for every layer (offset 0), as HF passes them
    offsets = [i * q[0].numel() for i in range(layers)]
    offsets += [i * k_rot[0].numel() for i in range(layers)] + [0] * (2 * layers)
    offsets = torch.tensor(offsets, device=DEVICE)
    scale = head_dim**-0.5
    out = kernels.qk_stats_partials_grouped(
        q[0], k_rot[0], offsets, layers, scale, True, None, q_rope=(cos, sin)
    )
    width = 2 * heads + 1
    for i in range(layers):
        maxes, entropy, _ = _folded(out[:, i * width : (i + 1) * width], batch, heads)
        want_q, want_k = _rotate(q[i], cos, sin), _rotate(k[i], cos, sin)
        ref_maxes, ref_entropy = _reference(want_q, want_k, scale, True, None, 0, 1)
        np.testing.assert_allclose(maxes.cpu(), ref_maxes.cpu(), rtol=1e-5)
        np.testing.assert_allclose(entropy.cpu(), ref_entropy.cpu(), rtol=1e-5)
