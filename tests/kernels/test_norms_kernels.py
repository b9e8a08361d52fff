"""The norms kernels against a float64 recount: the fused pre-step (parameter and
gradient sums of squares per group, and the snapshot) and the post-step update sums.

Runs the compiled kernels on CUDA, the Triton interpreter elsewhere (tests/conftest.py).
``CHUNK`` is shrunk so that odd-sized tensors span several blocks in a few programs.
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
SIZES = [1, 257, 700, 129, 513, 64]  # CHUNK 256: 1, 2, 3, 1, 3, 1 blocks
GROUPS = [0, 1, 0, 2, 1, 2]
N_GROUPS = 4  # group 3 holds nothing: zero
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@pytest.fixture
def fused(monkeypatch):
    from syncless.kernels import norms

    monkeypatch.setattr(norms, "CHUNK", 256)
    monkeypatch.setattr(norms, "_BLOCK", 64)
    return norms


def _params(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Views into one buffer, laid out backwards with gaps: every offset from the first
    tensor is negative."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(SIZES) + 7 * len(SIZES), generator=g).to(dtype).to(DEVICE)
    out, at = [], flat.numel()
    for n in SIZES:
        at -= n + 7
        out.append(flat[at : at + n])
    return out


def _grads(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Separate allocations, as autograd makes them."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype).to(DEVICE) for n in SIZES]


def _recount(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-group sums of squares in float64, tensor by tensor."""
    out = torch.zeros(N_GROUPS, dtype=torch.float64)
    for t, group in zip(tensors, GROUPS, strict=True):
        out[group] += t.detach().cpu().double().square().sum()
    return out


def _offsets(fused, tensors: list[torch.Tensor]) -> torch.Tensor:
    offsets = fused.element_offsets(tensors, SIZES)
    assert offsets is not None
    return torch.tensor(offsets, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),  # gradients in another dtype than the parameters
        (torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("snapshot", [True, False])
def test_pre_step_sums_and_snapshot_match_a_float64_recount(
    fused, param_dtype, grad_dtype, snapshot
):
    params, grads = _params(param_dtype, 1), _grads(grad_dtype, 2)
    table = fused.BlockTable.build(params, GROUPS, N_GROUPS)
    assert table.tensor_of.numel() == 11
    snap = torch.full((table.total,), float("nan"), dtype=param_dtype, device=DEVICE)
    sums = fused.group_param_grad_sumsq(
        params[0],
        _offsets(fused, params),
        table,
        first_grad=grads[0],
        grad_offsets=_offsets(fused, grads),
        snap=snap if snapshot else None,
    )
    assert sums.shape == (2, N_GROUPS) and sums.dtype == torch.float64
    torch.testing.assert_close(sums[0].cpu(), _recount(params), rtol=1e-6, atol=0)
    torch.testing.assert_close(sums[1].cpu(), _recount(grads), rtol=1e-6, atol=0)
    assert sums[:, 3].tolist() == [0.0, 0.0]
    flat = torch.cat(params)
    if snapshot:  # the same bytes, tensor after tensor
        assert torch.equal(snap.view(BITS[param_dtype]), flat.view(BITS[param_dtype]))
    else:  # not written
        assert snap.isnan().all()


def test_without_gradients_the_parameters_are_summed_and_copied(fused):
    params = _params(torch.float32, 3)
    table = fused.BlockTable.build(params, GROUPS, N_GROUPS)
    snap = torch.empty(table.total, device=DEVICE)
    sums = fused.group_param_grad_sumsq(params[0], _offsets(fused, params), table, snap=snap)
    torch.testing.assert_close(sums[0].cpu(), _recount(params), rtol=1e-6, atol=0)
    assert sums[1].tolist() == [0.0] * N_GROUPS
    assert torch.equal(snap, torch.cat(params))


def test_update_sums_read_the_parameters_against_the_pre_step_snapshot(fused):
    params, grads = _params(torch.float32, 4), _grads(torch.float32, 5)
    table = fused.BlockTable.build(params, GROUPS, N_GROUPS)
    offsets = _offsets(fused, params)
    snap = torch.empty(table.total, device=DEVICE)
    before = [p.clone() for p in params]
    fused.group_param_grad_sumsq(params[0], offsets, table, grads[0], _offsets(fused, grads), snap)
    for p, g in zip(params, grads, strict=True):  # an optimizer step, in place
        p.add_(g, alpha=-0.25)
    sums = fused.group_diff_sumsq(params[0], offsets, table, snap)
    expected = _recount([a - b for a, b in zip(params, before, strict=True)])
    torch.testing.assert_close(sums.cpu(), expected, rtol=1e-5, atol=0)


def test_offsets_refuse_mixed_gradient_dtypes_and_other_sizes(fused):
    """The checks that send a bucket's gradients, or the whole bucket, to foreach."""
    grads = _grads(torch.float32, 6)
    assert fused.element_offsets(grads, SIZES) is not None
    assert fused.element_offsets([grads[0], grads[1].bfloat16(), *grads[2:]], SIZES) is None
    assert fused.element_offsets([*grads[:-1], grads[-1][:-1]], SIZES) is None
    assert (
        fused.element_offsets([grads[0], grads[1][::2], *grads[2:]], [1, 129, *SIZES[2:]]) is None
    )
