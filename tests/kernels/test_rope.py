"""Key rotation for the attention statistics kernel against Hugging Face's
``apply_rotary_pos_emb`` formula in torch: ``x * cos + rotate_half(x) * sin`` in
float32, then rounded to the output dtype.

Runs the compiled kernel on CUDA, the Triton interpreter elsewhere (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from syncless import kernels

pytestmark = pytest.mark.skipif(
    not kernels.triton_importable() or not (torch.cuda.is_available() or kernels.interpreting()),
    reason="needs triton with a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _hf_rotated(x, cos, sin, dtype):
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos[:, None].float() + turned.float() * sin[:, None].float()).to(dtype)


@pytest.mark.parametrize("head_dim", [16, 80, 128])  # 80: a half (40) that is no power of 2
@pytest.mark.parametrize("cos_batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_matches_the_model_formula(head_dim, cos_batch, dtype):
    g = torch.Generator().manual_seed(head_dim + cos_batch)
    b, h, length = 2, 3, 45  # a ragged last row block
    # [B, L, H, D] transposed to [B, H, L, D]: the strided view a projection gives.
    x = torch.randn(b, length, h, head_dim, generator=g).bfloat16().to(DEVICE).transpose(1, 2)
    freqs = torch.randn(cos_batch, length, head_dim // 2, generator=g) * 3
    emb = torch.cat([freqs, freqs + 0.5], dim=-1).to(DEVICE)  # the halves differ on purpose
    cos, sin = emb.cos(), emb.sin()
    got = kernels.rope_rotate(x, cos, sin, dtype)
    want = _hf_rotated(x, cos.expand(b, -1, -1), sin.expand(b, -1, -1), dtype)
    assert got.shape == (b, h, length, head_dim) and got.is_contiguous()
    if DEVICE != "cuda":
        assert torch.equal(got, want)  # the interpreter rounds each product, as torch
        return
    # The compiled kernel fuses a multiply-add where torch rounds twice: float32 within
    # an ulp or so, and a bf16 value that sits on a rounding boundary may round the
    # other way (one bf16 ulp, seen on the H200 in 3 of 9 cases at d57017b).
    exact = torch.equal(got, want)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-6)
    else:
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(1e-30)
        off = (got.float() - want.float()).abs()
        assert exact or (bool((off <= ulp).all()) and float((off > 0).float().mean()) < 1e-3)


def test_an_odd_head_dim_is_refused():
    x = torch.zeros(1, 1, 4, 5, device=DEVICE)
    cos = torch.zeros(1, 4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="even head_dim"):
        kernels.rope_rotate(x, cos, cos, torch.float32)
