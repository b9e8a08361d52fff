"""CUDA-only behaviour: real devices and torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from syncless.guard import SyncError, allow_sync, census, no_sync

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ERROR = 2  # torch.cuda.get_sync_debug_mode() for "error"


def test_default_flags_device_tensors_not_host_tensors() -> None:
    host, dev = torch.ones(4), torch.ones(4, device="cuda")
    with no_sync() as guard:
        assert guard.cpu_as_device is False
        host.tolist()
        torch.nonzero(host)
        with pytest.raises(SyncError, match=r"Tensor\.item"):
            dev.sum().item()
        with pytest.raises(SyncError, match=r"aten\.nonzero"):
            torch.nonzero(dev)
        with pytest.raises(SyncError, match=r"Tensor\.cpu"):
            dev.cpu()


def test_copies_into_host_memory() -> None:
    dev = torch.ones(4, device="cuda")
    pinned = torch.empty(4, pin_memory=True)
    pageable = torch.empty(4)
    with no_sync():
        pinned.copy_(dev, non_blocking=True)
        dev.to("cpu", non_blocking=True)
        dev.to(torch.float16)
        with pytest.raises(SyncError, match=r"Tensor\.copy_"):
            pageable.copy_(dev)
        with pytest.raises(SyncError, match=r"Tensor\.to"):
            dev.to(pageable)
    torch.cuda.synchronize()
    assert pinned.tolist() == [1.0] * 4


def test_sync_debug_mode_is_set_relaxed_and_restored() -> None:
    previous = torch.cuda.get_sync_debug_mode()
    with no_sync():
        assert torch.cuda.get_sync_debug_mode() == ERROR
        with no_sync():
            assert torch.cuda.get_sync_debug_mode() == ERROR
        assert torch.cuda.get_sync_debug_mode() == ERROR  # inner exit keeps it on
        with allow_sync("checked on purpose"):
            assert torch.cuda.get_sync_debug_mode() == previous
            torch.ones(1, device="cuda").item()
        assert torch.cuda.get_sync_debug_mode() == ERROR
    assert torch.cuda.get_sync_debug_mode() == previous
    with census():
        assert torch.cuda.get_sync_debug_mode() == previous


def test_a_sync_only_cuda_sees_becomes_a_sync_error() -> None:
    dev = torch.ones(4, device="cuda")
    # Hide the op from syncless's modes so only CUDA's debug mode can catch it.
    with (
        pytest.raises(SyncError, match="synchronizing CUDA operation") as caught,
        no_sync(),
        _disable_current_modes(),
        torch._C.DisableTorchFunction(),
    ):
        dev.sum().item()
    assert caught.value.site.file == __file__


def test_backward_hooks_on_device_threads_are_guarded() -> None:
    model = torch.nn.Linear(4, 4).cuda()

    def hook(module, grad_input, grad_output):
        grad_output[0].tolist()

    model.register_full_backward_hook(hook)
    x = torch.randn(2, 4, device="cuda", requires_grad=True)
    with no_sync(), pytest.raises(SyncError, match=r"Tensor\.tolist"):
        model(x).sum().backward()
    with census() as c:
        model(x).sum().backward()
    assert c.by_op() == {"Tensor.tolist": 1}
