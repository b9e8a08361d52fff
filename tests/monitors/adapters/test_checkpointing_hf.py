"""Activation checkpointing never double counts (issue #20).

Hooks inside a checkpointed layer fire again when the backward recomputes it; the
monitors recognise the recompute and skip it. Ground truth: the same model, weights and
batch without checkpointing, and an exact recount of the routed tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from syncless.monitors import attach, build

transformers = pytest.importorskip("transformers")

B, L, VOCAB, TOP_K = 2, 9, 64, 2


def _mixtral() -> torch.nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=TOP_K, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()


def _step(model: torch.nn.Module, hook_guard) -> dict[str, float]:
    hook_guard.snapshot(model)
    handle = attach(model, build("attention,moe,activations,nonfinite"), lagged=False, budget=None)
    assert hook_guard.guard(model) > 0
    ids = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()
    return records


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recompute_is_not_counted_again(reentrant, hook_guard):
    plain = _mixtral()
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable({"use_reentrant": reentrant})
    want = _step(plain, hook_guard)
    got = _step(checkpointed, hook_guard)
    layers = {n: v for n, v in want.items() if n.startswith("monitors/layer_")}
    assert layers and {n: got[n] for n in layers} == pytest.approx(layers, rel=1e-6)
    for layer in range(2):  # every token picks TOP_K experts, once
        assert got[f"monitors/layer_{layer:02d}/moe_tokens_count"] == B * L * TOP_K
    # what was skipped is said: each layer's attention and router hooks, recomputed
    assert got["monitors/self/moe_recompute_skipped_count"] >= 2
    assert "monitors/self/moe_recompute_skipped_count" not in want
