"""torchtitan 0.3 models for bench/stacks/stack_models.py, built from their config
dataclasses on the device (random weights, no download), with SDPA attention in every
layer."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from bench.stacks.hf_models import ModelSpec


def without_fsdp_helpers() -> None:
    """torchtitan 0.3 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.12)
    in its FSDP helpers, which a one-GPU bench never calls; the H200 image has torch
    2.11. A placeholder class lets the model classes import."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})  # type: ignore[attr-defined]


def build_titan_model(spec: ModelSpec, device: torch.device) -> nn.Module:
    without_fsdp_helpers()
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers

    init = {"weight": partial(nn.init.normal_, std=0.02)}
    common = dict(
        dim=spec.hidden,
        vocab_size=spec.vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=spec.vocab, embedding_dim=spec.hidden, param_init=init
        ),
        norm=RMSNorm.Config(normalized_shape=spec.hidden, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=spec.hidden, out_features=spec.vocab, param_init=init),
    )
    if spec.experts:
        model_class = Qwen3Model
        layers = _build_qwen3_moe_layers(
            n_layers=spec.layers, dim=spec.hidden, n_heads=spec.heads,
            n_kv_heads=spec.kv_heads, head_dim=spec.head_dim,
            rope=CosSinRoPE.Config(dim=spec.head_dim, max_seq_len=spec.seq_len),
            attn_backend="flex", moe_hidden_dim=spec.intermediate,
            num_experts=spec.experts, top_k=spec.top_k, moe_comm_backend="standard",
        )  # fmt: skip
    else:
        model_class = Llama3Model
        layers = _build_llama3_layers(
            n_layers=spec.layers, dim=spec.hidden, n_heads=spec.heads,
            n_kv_heads=spec.kv_heads, hidden_dim=spec.intermediate,
            rope=ComplexRoPE.Config(dim=spec.head_dim, max_seq_len=spec.seq_len),
            attn_backend="flex",
        )  # fmt: skip
    for layer in layers:  # SDPA, as the Hugging Face models of real_models use
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = model_class.Config(**common, layers=layers)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    return model.train()
