"""capture_check(): dry-run CUDA graph capture."""

from __future__ import annotations

import pytest
import torch

from syncless.guard import CaptureResult, capture_check

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_needs_cuda_says_so() -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        capture_check(lambda: None)


@pytest.mark.cuda
@needs_cuda
def test_device_only_work_is_capturable() -> None:
    x = torch.ones(1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")

    def step() -> None:
        x.copy_((w @ x).tanh())

    before = x.clone()
    result = capture_check(step)
    assert result == CaptureResult(True, None)
    torch.cuda.synchronize()
    once = (w @ before).tanh()
    assert torch.allclose(x, once)  # warm-up ran once; the captured graph never replayed


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "sync",
    [lambda x: x.sum().item(), lambda x: x.cpu(), lambda x: torch.nonzero(x)],
    ids=["item", "cpu", "nonzero"],
)
def test_a_sync_makes_it_uncapturable(sync) -> None:
    x = torch.ones(16, device="cuda")
    result = capture_check(lambda: sync(x * 2))
    assert result.capturable is False
    assert result.error
    # The device, its RNG and capture itself are usable again afterwards.
    assert torch.ones(2, device="cuda").sum().item() == 2.0
    assert torch.randn(8, device="cuda").shape == (8,)
    assert capture_check(lambda: x.mul_(1)).capturable


@pytest.mark.cuda
@needs_cuda
def test_warmup_errors_propagate() -> None:
    def broken() -> None:
        raise ValueError("bug in fn")

    with pytest.raises(ValueError, match="bug in fn"):
        capture_check(broken)
