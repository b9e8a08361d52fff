"""Choosing the kernel backend, and proof that the Triton runs take the fused path."""

from __future__ import annotations

import pytest
import torch

from syncless import kernels
from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.monitors import attach, build


@pytest.fixture
def backend():
    previous = kernels.backend()
    yield kernels.set_backend
    kernels.set_backend(previous)


def test_unknown_backend_names_the_choices(backend):
    with pytest.raises(ValueError, match="expected one of auto, torch, triton"):
        backend("cuda")


def test_auto_and_torch_keep_cpu_tensors_on_the_torch_path(backend):
    x = torch.ones(2)
    backend("auto")
    assert not kernels.use_triton(x)
    backend("torch")
    assert not kernels.use_triton(x)


def test_forced_triton_on_cpu_without_the_interpreter_says_what_to_do(backend, monkeypatch):
    if not kernels.triton_importable():
        pytest.skip("needs triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backend("triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.use_triton(torch.ones(2))


@pytest.mark.skipif(
    not (kernels.triton_importable() and kernels.interpreting()),
    reason="needs triton and TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("launch", ["layer", "grouped"])
def test_each_hooked_module_records_with_one_fold(backend, monkeypatch, launch):
    """One fold per hooked module per forward (per-layer launches), or one per monitor
    per forward (grouped, the default): the fused path, not the torch ops."""
    monkeypatch.setenv("SYNCLESS_MONITOR_LAUNCH", launch)
    import syncless.kernels.fold as fold_module

    calls = []
    real = fold_module.fold
    monkeypatch.setattr(fold_module, "fold", lambda *a: calls.append(a[0].shape) or real(*a))
    backend("triton")
    cfg = preset("tiny")
    model = MoETransformer(cfg)
    init_weights(model, 0)
    handle = attach(model, build(["attention", "moe", "activations", "nonfinite"]), lagged=False)
    tokens = torch.randint(0, 256, (2, 16))
    with no_sync(cpu_as_device=True):
        model(tokens)
    # grouped: attention and the router fold at the flush; the shared output read
    # (activations and nonfinite, syncless.monitors.output_read) folds in the forward,
    # where training may read the nonfinite alert
    assert len(calls) == (4 * cfg.n_layers if launch == "layer" else 1)
    with no_sync(cpu_as_device=True):  # the deferred folds and add_ones run here
        (records,) = [handle.step(0)]
    # attention, router, output x2: per module, or per monitor for every layer at once
    assert len(calls) == (4 * cfg.n_layers if launch == "layer" else 3)
    assert any(r.name.endswith("attn_qk_logit_max") for r in records)
    values = {r.name: r.value for r in records}
    assert values["monitors/step/attn_sampled_frac"] == 1.0  # exact: every row used
    handle.close()
