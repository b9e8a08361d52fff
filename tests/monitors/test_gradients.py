"""The gradient at each block's output (issue #46): RMS, max |g| and NaN/Inf count per
layer, recorded in the backward, against a recount.

Ground truth: a second copy of the model, with the same weights and batch and nothing
of syncless attached, whose block outputs keep their gradients (``retain_grad``); the
statistics are recomputed from them with plain torch. Activation checkpointing and
torch.compile run on the monitored copy only: the reference is the plain eager model.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from syncless.guard import no_sync
from syncless.monitors import attach
from syncless.monitors.gradients import GradientsMonitor

transformers = pytest.importorskip("transformers")

LAYERS = 3
VOCAB = 64


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(n)]


def _reference_grads(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer's block-output gradients over ``batches`` (one step's micro-batches),
    flattened and concatenated, from a plain copy of ``model``."""
    ref = copy.deepcopy(model)
    outputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(LAYERS)}

    def keep(i: int):
        def hook(module, args, out):
            hidden = out[0] if isinstance(out, tuple) else out
            hidden.retain_grad()
            outputs[i].append(hidden)

        return hook

    for i, block in enumerate(ref.model.layers):
        block.register_forward_hook(keep(i))
    for ids in batches:
        ref(ids, labels=ids).loss.backward()
    return [torch.cat([h.grad.flatten() for h in outputs[i]]) for i in range(LAYERS)]


def _step_records(records, step: int = 0) -> dict[str, float]:
    return {r.name: r.value for r in records if r.step == step}


def _assert_matches(
    values: dict[str, float], grads: list[torch.Tensor], layers: list[int] | None = None
) -> None:
    for i, g in zip(layers or range(len(grads)), grads, strict=True):
        scope = f"monitors/layer_{i:02d}"
        # over the finite elements, the mean over all of them (the count says the rest)
        finite = torch.where(torch.isfinite(g), g, 0).double()
        rms = math.sqrt(float(finite.square().sum()) / g.numel())
        assert math.isclose(values[f"{scope}/grad_out_rms"], rms, rel_tol=1e-5), i
        absmax = float(finite.abs().max())
        assert math.isclose(values[f"{scope}/grad_out_absmax"], absmax, rel_tol=1e-6), i
        bad = int((~torch.isfinite(g)).sum())
        assert values[f"{scope}/grad_out_nonfinite_count"] == bad, i


def _run(model, batches, accumulate=False, guard_forward=True):
    """``guard_forward=False``: the forward outside no_sync (Hugging Face's own mask code
    syncs under activation checkpointing, a packed-sequence check); the backward, where
    the gradient hooks run and checkpointing recomputes, always under it."""
    handle = attach(model, [GradientsMonitor()], lagged=False, budget=None)
    records = []
    for k, ids in enumerate(batches):
        with no_sync(cpu_as_device=True) if guard_forward else contextlib.nullcontext():
            loss = model(ids, labels=ids).loss
        with no_sync(cpu_as_device=True):
            loss.backward()
            if accumulate and k < len(batches) - 1:
                records += handle.step(0, accumulate=True)
    with no_sync(cpu_as_device=True):
        records += handle.step(0)
    records += handle.close()
    return records


def test_each_layer_records_the_gradient_at_its_output():
    model = _llama()
    (ids,) = _batches(1)
    grads = _reference_grads(model, [ids])
    _assert_matches(_step_records(_run(model, [ids])), grads)


def test_an_accumulated_step_covers_every_micro_batch():
    model = _llama()
    batches = _batches(3)
    grads = _reference_grads(model, batches)
    _assert_matches(_step_records(_run(model, batches, accumulate=True)), grads)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_each_gradient_once(reentrant):
    """Non-reentrant: the forward's outputs are in the graph the backward walks.
    Reentrant: the forward runs without grad and the recompute with it. Once each."""
    model = _llama()
    (ids,) = _batches(1)
    grads = _reference_grads(model, [ids])
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    model.train()
    _assert_matches(_step_records(_run(model, [ids], guard_forward=False)), grads)


def test_under_torch_compile():
    model = _llama()
    (ids,) = _batches(1)
    grads = _reference_grads(model, [ids])
    compiled = copy.deepcopy(model)
    for block in compiled.model.layers:
        block.compile(backend="aot_eager")
    _assert_matches(_step_records(_run(compiled, [ids])), grads)


def test_a_nan_gradient_is_counted_in_the_layers_below():
    model = _llama()
    poison = torch.ones(())
    hidden_at: dict[str, torch.Tensor] = {}

    def plant(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        hidden_at["h"] = hidden
        hidden.register_hook(lambda g: g * poison)

    model.model.layers[1].register_forward_hook(plant)  # before attach: monitors see it
    poison.fill_(float("nan"))
    values = _step_records(_run(model, _batches(1)))
    n = hidden_at["h"].numel()
    # layer 1's output gradient is all NaN, and so is everything the backward reaches
    # below it; layer 2, above, is clean
    assert values["monitors/layer_01/grad_out_nonfinite_count"] == n
    assert values["monitors/layer_00/grad_out_nonfinite_count"] == n
    assert values["monitors/layer_02/grad_out_nonfinite_count"] == 0


def test_a_few_nonfinite_elements_leave_the_rms_and_max_of_the_rest_readable():
    model = _llama()
    seen: list[torch.Tensor] = []

    def plant(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out
        poison = torch.ones_like(hidden)
        poison[0, 0, 0], poison[1, 3, 5], poison[1, 4, 6] = (
            float("nan"),
            float("inf"),
            -float("inf"),
        )

        def hook(g: torch.Tensor) -> torch.Tensor:
            seen.append(g * poison)
            return seen[-1]

        hidden.register_hook(hook)

    top = LAYERS - 1  # its own gradient has the three; the backward spreads them below
    model.model.layers[top].register_forward_hook(plant)
    values = _step_records(_run(model, _batches(1)))
    (g,) = seen
    assert values[f"monitors/layer_{top:02d}/grad_out_nonfinite_count"] == 3
    _assert_matches(values, [g], layers=[top])


def test_an_evaluation_forward_records_nothing():
    model = _llama()
    handle = attach(model, [GradientsMonitor()], lagged=False, budget=None)
    with no_sync(cpu_as_device=True), torch.no_grad():
        ids = _batches(1)[0]
        model(ids)
        records = handle.step(0)
    handle.close()
    assert not any(r.name.endswith("grad_out_rms") for r in records)
