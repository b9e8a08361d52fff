"""The attention monitor on a Hugging Face Llama under bf16 autocast, end to end.

The adapter hands q/k before their rotary embedding; the Triton path rotates them in its
kernels, the torch path with the model's own function. Ground truth: the rotated q/k
the model computed (``attach_qk``), rounded to bf16 as SDPA rounds them under autocast,
through a float64 softmax.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncless.monitors import attach, build
from syncless.monitors.adapters import find_layers

transformers = pytest.importorskip("transformers")

B, L, VOCAB = 2, 140, 64  # 140 rows: an unmasked key block before the diagonal


def reference(q, k, scale):
    """Per head: max causal logit and mean row entropy, float64, kv heads repeated."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(
        torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")
    )
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    return logits.amax(dim=(0, 2, 3)).numpy(), entropy.mean(dim=(0, 2)).numpy()


def test_statistics_of_a_llama_under_autocast_match_sdpas_inputs(kernel_backend, hook_guard):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hook_guard.snapshot(model)
    handle = attach(model, build("attention"), lagged=False)
    seen = {}
    for site in find_layers(model).layers:
        site.attention.attach_qk(lambda q, k, i=site.index: seen.__setitem__(i, (q, k)))
    assert hook_guard.guard(model) > 0  # the monitor's hooks run under no_sync
    ids = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
        loss.backward()
    opt.step()
    handle.step(0)
    (readout,) = handle.readouts
    handle.close()
    for layer, (q, k) in seen.items():
        assert q.dtype == torch.float32  # float32 cos/sin: the rotation is float32
        want_max, want_mean = reference(q.bfloat16(), k.bfloat16(), q.shape[-1] ** -0.5)
        maxes = readout.get(f"monitors/layer_{layer:02d}/attn_qk_logit_max")
        means = readout.get(f"monitors/layer_{layer:02d}/attn_entropy_nats")
        np.testing.assert_allclose(maxes, want_max, rtol=1e-5)
        np.testing.assert_allclose(means, want_mean, rtol=1e-5)
        # float32 q/k (what a monitor without the cast would use) give other maxima
        assert not np.allclose(maxes, reference(q, k, q.shape[-1] ** -0.5)[0], rtol=1e-6)
