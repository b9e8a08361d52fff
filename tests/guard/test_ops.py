"""Every detectable operation: raised on under no_sync(), counted once by census()."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from syncless.guard import Site, SyncError, census, no_sync

CUDA = torch.cuda.is_available()


@pytest.fixture
def t() -> SimpleNamespace:
    """Inputs prepared outside any guard, so a case's only sync is its marked line."""
    x = torch.arange(1.0, 5.0)
    return SimpleNamespace(
        x=x,
        mask=x > 2,
        mask_u8=(x > 2).to(torch.uint8),
        reps=torch.tensor([1, 2, 1, 1]),
        ints=torch.tensor([0, 2, 2, 3]),
        two=torch.ones(2),
        mat=torch.eye(3),
        other=torch.zeros(1, dtype=torch.float64),
    )


# -- positive cases: one would-be sync each, on the line marked "# SYNC" -----------


def item(t):
    t.x.sum().item()  # SYNC


def tolist(t):
    t.x.tolist()  # SYNC


def numpy_(t):
    t.x.numpy()  # SYNC


def np_asarray(t):
    np.asarray(t.x)  # SYNC


def cpu(t):
    t.x.cpu()  # SYNC


def to_cpu_str(t):
    t.x.to("cpu")  # SYNC


def to_cpu_kwarg(t):
    t.x.to(device="cpu")  # SYNC


def to_cpu_device_dtype(t):
    t.x.to("cpu", torch.float64)  # SYNC


def bool_(t):
    bool(t.x[0])  # SYNC


def if_tensor(t):
    if t.x[0] > 0:  # SYNC
        pass


def float_(t):
    float(t.x[0])  # SYNC


def int_(t):
    int(t.x[0])  # SYNC


def index_(t):
    [10, 20, 30][t.ints[1]]  # SYNC


def complex_(t):
    complex(t.x[0])  # SYNC


def is_nonzero(t):
    t.x[0].is_nonzero()  # SYNC


def contains(t):
    _ = 2.0 in t.x  # SYNC


def repr_(t):
    repr(t.x)  # SYNC


def str_(t):
    str(t.x)  # SYNC


def percent_format(t):
    _ = "%s" % (t.x,)  # noqa: UP031  # SYNC


def fstring_vector(t):
    _ = f"{t.x}"  # SYNC


def fstring_scalar(t):
    _ = f"{t.x[0]:.2f}"  # SYNC


def nonzero(t):
    torch.nonzero(t.x)  # SYNC


def nonzero_tuple(t):
    t.x.nonzero(as_tuple=True)  # SYNC


def where_one_arg(t):
    torch.where(t.mask)  # SYNC


def argwhere(t):
    torch.argwhere(t.x)  # SYNC


def unique(t):
    torch.unique(t.x)  # SYNC


def unique_dim(t):
    torch.unique(t.x.view(4, 1), dim=0)  # SYNC


def unique_consecutive(t):
    torch.unique_consecutive(t.x)  # SYNC


def masked_select(t):
    torch.masked_select(t.x, t.mask)  # SYNC


def repeat_interleave(t):
    torch.repeat_interleave(t.x, t.reps)  # SYNC


def equal(t):
    torch.equal(t.x, t.x)  # SYNC


def allclose(t):
    torch.allclose(t.x, t.x)  # SYNC


def bincount(t):
    torch.bincount(t.ints)  # SYNC


def histc(t):
    torch.histc(t.x)  # SYNC


def bool_mask_index(t):
    t.x[t.mask]  # SYNC


def uint8_mask_index(t):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uint8 masks are deprecated, still sync
        t.x[t.mask_u8]  # SYNC


def mask_assign_tensor(t):
    y = t.x.clone()
    y[t.mask] = t.two  # SYNC


def linalg_checked(t):
    torch.linalg.inv(t.mat)  # SYNC


def pin_memory(t):
    t.x.pin_memory()  # SYNC


@dataclass(frozen=True)
class Case:
    fn: Callable[[SimpleNamespace], None]
    op: str

    @property
    def id(self) -> str:
        return self.fn.__name__


POSITIVE = [
    Case(item, "Tensor.item"),
    Case(tolist, "Tensor.tolist"),
    Case(numpy_, "Tensor.numpy"),
    Case(np_asarray, "Tensor.__array__"),
    Case(cpu, "Tensor.cpu"),
    Case(to_cpu_str, "Tensor.to"),
    Case(to_cpu_kwarg, "Tensor.to"),
    Case(to_cpu_device_dtype, "Tensor.to"),
    Case(bool_, "Tensor.__bool__"),
    Case(if_tensor, "Tensor.__bool__"),
    Case(float_, "Tensor.__float__"),
    Case(int_, "Tensor.__int__"),
    Case(index_, "Tensor.__index__"),
    Case(complex_, "Tensor.__complex__"),
    Case(is_nonzero, "Tensor.is_nonzero"),
    Case(contains, "Tensor.__contains__"),
    Case(repr_, "Tensor.__repr__"),
    Case(str_, "Tensor.__repr__"),
    Case(percent_format, "Tensor.__repr__"),
    Case(fstring_vector, "Tensor.__format__"),
    Case(fstring_scalar, "Tensor.__format__"),
    Case(nonzero, "aten.nonzero"),
    Case(nonzero_tuple, "aten.nonzero"),
    Case(where_one_arg, "aten.nonzero"),
    Case(argwhere, "aten.nonzero"),
    Case(unique, "aten._unique2"),
    Case(unique_dim, "aten.unique_dim"),
    Case(unique_consecutive, "aten.unique_consecutive"),
    Case(masked_select, "aten.masked_select"),
    Case(repeat_interleave, "aten.repeat_interleave"),
    Case(equal, "aten.equal"),
    Case(allclose, "aten.allclose"),
    Case(bincount, "aten.bincount"),
    Case(histc, "aten.histc"),
    Case(bool_mask_index, "aten.index"),
    Case(uint8_mask_index, "aten.index"),
    Case(mask_assign_tensor, "aten.index_put_"),
    Case(linalg_checked, "aten._linalg_check_errors"),
    Case(pin_memory, "aten._pin_memory"),
]


def _run_counted(case: Case, t: SimpleNamespace) -> None:
    """Run a case whose op must execute; pinning has no accelerator on a CPU build."""
    if case.fn is pin_memory and not CUDA:
        with pytest.raises(RuntimeError, match="accelerator"):
            case.fn(t)
    else:
        case.fn(t)


@pytest.mark.parametrize("case", POSITIVE, ids=lambda c: c.id)
def test_no_sync_raises_with_op_and_user_line(case: Case, t, marked_line) -> None:
    line = marked_line(case.fn)
    with no_sync(cpu_as_device=True), pytest.raises(SyncError) as caught:
        case.fn(t)
    message = str(caught.value)
    assert case.op in message
    assert f"{__file__}:{line}" in message
    assert "fix:" in message
    assert caught.value.op == case.op
    assert caught.value.site == Site(__file__, line, case.fn.__name__)


@pytest.mark.parametrize("case", POSITIVE, ids=lambda c: c.id)
def test_census_counts_once_at_site(case: Case, t, marked_line) -> None:
    line = marked_line(case.fn)
    with census(cpu_as_device=True) as c:
        _run_counted(case, t)
    assert c.total == 1
    assert c.by_site() == {(Site(__file__, line, case.fn.__name__), case.op): 1}
    assert c.by_op() == {case.op: 1}


@pytest.mark.parametrize(
    "case", [c for c in POSITIVE if c.fn is not pin_memory], ids=lambda c: c.id
)
def test_host_tensors_pass_when_not_simulating(case: Case, t) -> None:
    """With cpu_as_device=False a CPU tensor is host data: reading it is no sync."""
    with census(cpu_as_device=False) as c, no_sync(cpu_as_device=False):
        case.fn(t)
    assert c.total == 0


def test_pinning_is_flagged_whatever_the_device(t) -> None:
    with no_sync(cpu_as_device=False), pytest.raises(SyncError, match=r"aten\._pin_memory"):
        pin_memory(t)


# -- negative cases: no sync on a GPU ------------------------------------------------


def _math(t):
    y = (t.x * 2 + 1).relu().sum() / t.x.numel()
    z = torch.softmax(t.x, dim=0) @ t.x
    return y + z + t.x.max() + t.x.argmax() + t.x.cumsum(0)[-1] + t.mat.mm(t.mat).trace()


def _shapes(t):
    return (t.x.shape[0], t.x.numel(), t.x.size(), t.x.dim(), t.x.dtype, t.x.device, len(t.x))


def _more_metadata(t):
    return (t.x.stride(), t.x.is_contiguous(), t.x.element_size(), t.x.data_ptr(), t.x.is_pinned())


def _dtype_casts(t):
    return (t.x.to(torch.float32), t.x.to(torch.float16), t.x.to(dtype=torch.float64), t.x.double())


def _to_tensor_and_nonblocking(t):
    return t.x.to(t.other), t.x.to("cpu", non_blocking=True)


def _to_another_tensors_device(t):
    # Hugging Face's rotary embedding, every forward: inv_freq.to(device=x.device), a
    # same-device no-op on a GPU; in the CPU simulation both are "the device"
    return t.x.to(device=t.other.device, dtype=torch.float), t.x.to(t.other.device)


def _factories(t):
    return torch.zeros(3), torch.ones_like(t.x), torch.empty(2, 2), torch.full((2,), 1.5)


def _in_place(t):
    y = t.x.clone()
    y.add_(1).mul_(2).clamp_(max=5)
    y.copy_(t.x, non_blocking=True)
    y.copy_(t.x)
    return y


def _masking_without_sync(t):
    y = t.x.clone()
    y[t.mask] = 0.0  # ATen turns this into masked_fill_: no nonzero
    return y, torch.where(t.mask, t.x, 0.0), t.x.masked_fill(t.mask, 0.0), (t.x * t.mask).sum()


def _static_shape_variants(t):
    return (
        torch.nonzero_static(t.x, size=2),
        torch.repeat_interleave(t.x, t.reps, output_size=5),
        torch.histc(t.x, bins=4, min=0, max=5),
        torch.isclose(t.x, t.x).all(),
        (t.x == t.x).all(),
        torch.linalg.inv_ex(t.mat),
    )


def _indexing(t):
    return t.x[0], t.x[1:3], t.x[t.ints], t.x.index_select(0, t.ints), list(t.x)


def _sort_and_friends(t):
    return torch.sort(t.x), torch.topk(t.x, 2), torch.multinomial(t.x, 2), t.x.argsort()


NEGATIVE = [
    _math,
    _shapes,
    _more_metadata,
    _dtype_casts,
    _to_tensor_and_nonblocking,
    _to_another_tensors_device,
    _factories,
    _in_place,
    _masking_without_sync,
    _static_shape_variants,
    _indexing,
    _sort_and_friends,
]


@pytest.mark.parametrize("fn", NEGATIVE, ids=lambda f: f.__name__.lstrip("_"))
def test_no_sync_ignores_device_side_work(fn, t) -> None:
    with census(cpu_as_device=True) as c, no_sync(cpu_as_device=True):
        fn(t)
    assert c.total == 0
    assert c.per_step() == {0: 0}
