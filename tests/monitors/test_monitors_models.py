"""All monitors on Hugging Face MoE models and on pipeline-style model chunks."""

import numpy as np
import pytest
import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.monitors import attach, build


def _demo_chunk(seed):
    torch.manual_seed(seed)
    model = MoETransformer(preset("tiny"))
    init_weights(model, seed)
    return model


def test_chunks_are_declared_before_one_allocate_with_global_layer_numbers():
    chunks = [_demo_chunk(0), _demo_chunk(1)]
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.0)
    handle = attach(chunks, build("all", optimizer=opt), lagged=False, layer_offsets=[0, 8])
    tokens = torch.randint(0, 256, (2, 16))
    with no_sync(cpu_as_device=True):
        for chunk in chunks:  # stand-in for stages: each chunk runs on its own input
            logits, balance = chunk(tokens)
            (logits.float().square().mean() + balance).backward()
    opt.step()
    names = {r.name for r in handle.step(0)}
    handle.close()
    layers = sorted({n.split("/")[1] for n in names if n.split("/")[1].startswith("layer_")})
    assert layers == ["layer_00", "layer_01", "layer_08", "layer_09"]
    assert handle.metrics.flushes == 1 and handle.metrics.d2h_copies == 1
    # every chunk's layer carries every per-layer monitor
    for layer in layers:
        for metric in ("attn_qk_logit_max", "moe_tokens_count", "act_absmax",
                       "nonfinite_count", "param_norm"):  # fmt: skip
            assert f"monitors/{layer}/{metric}" in names


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_all_monitors_on_hugging_face_moe_models(family):
    if family == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config)
        sparse, k = [0, 1], 2
    else:
        config = transformers.Qwen2MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, num_experts=5,
            num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, decoder_sparse_step=2,
            max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(config)
        sparse, k = [1], 2
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handle = attach(model, build("all", optimizer=opt), lagged=False)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    out = model(ids, output_hidden_states=True)
    out.logits.float().square().mean().backward()
    opt.step()
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()

    n_tokens = ids.numel()
    for layer in range(config.num_hidden_layers):
        key = f"monitors/layer_{layer:02d}/moe_tokens_count"
        if layer in sparse:  # exact recount: every token picks k experts
            assert records[key] == n_tokens * k
        else:
            assert key not in records
        assert records[f"monitors/layer_{layer:02d}/nonfinite_count"] == 0
    # block outputs: hidden_states[i + 1] for every block but the last (the model's
    # final norm is applied to the last one in output_hidden_states)
    for layer in range(config.num_hidden_layers - 1):
        hidden = out.hidden_states[layer + 1].detach()
        want = float(hidden.abs().amax())
        got = records[f"monitors/layer_{layer:02d}/act_absmax"]
        assert np.isclose(got, want, rtol=1e-6)
    assert "monitors/global/attn_qk_logit_max" in records
    assert records["monitors/step/attn_sampled_frac"] == 1.0
