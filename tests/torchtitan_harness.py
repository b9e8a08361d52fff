"""Tiny torchtitan models on the CPU, for tests only: llama3, qwen3, qwen3 MoE and
deepseek_v3 built from their config dataclasses (no download), with SDPA in place of
flex attention (flex and varlen attention have no CPU backward). Also what the stock
``Trainer`` needs to run on a CPU: a model spec, a tokenizer and data that download
nothing, and ``trainer_on_cpu``'s shims."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
from torchtitan.models.qwen3 import (
    Qwen3Model,
    _build_qwen3_layers,
    _build_qwen3_moe_layers,
)
from torchtitan.protocols.model_spec import ModelSpec

B, L, DIM, VOCAB = 2, 16, 64, 128
_INIT = {"weight": partial(nn.init.normal_, std=0.05)}
MOE = dict(moe_hidden_dim=32, num_experts=4, top_k=2, moe_comm_backend="standard")


def _common() -> dict[str, Any]:
    return dict(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_INIT),
    )


def _layers(family: str) -> list:
    if family == "llama3":
        return _build_llama3_layers(
            n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, hidden_dim=128,
            rope=ComplexRoPE.Config(dim=16, max_seq_len=64), attn_backend="flex",
        )  # fmt: skip
    if family == "qwen3":  # head_dim 32 != DIM / n_heads: an explicit scale
        return _build_qwen3_layers(
            n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=128,
            rope=CosSinRoPE.Config(dim=32, max_seq_len=64), attn_backend="flex",
        )  # fmt: skip
    if family == "qwen3-moe":
        return _build_qwen3_moe_layers(
            n_layers=2, dim=DIM, n_heads=4, n_kv_heads=1, head_dim=16,
            rope=CosSinRoPE.Config(dim=16, max_seq_len=64), attn_backend="flex", **MOE,
        )  # fmt: skip
    # deepseek_v3: MLA, one dense layer, sigmoid router limited to 1 of 2 expert groups
    return _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        mscale=0.7, dense_hidden_dim=128, moe_hidden_dim=32, num_experts=4,
        num_shared_experts=1, router_top_k=2, router_score_func="sigmoid",
        router_num_expert_groups=2, router_num_limited_groups=1,
        attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64),
    )  # fmt: skip


MODELS = {"llama3": Llama3Model, "qwen3": Qwen3Model, "qwen3-moe": Qwen3Model,
          "deepseek_v3": DeepSeekV3Model}  # fmt: skip
FAMILIES = list(MODELS)


def model_config(family: str) -> Any:
    """``family``'s model config dataclass (what ``build_model`` builds)."""
    layers = _layers(family)
    for layer in layers:  # flex and varlen attention have no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return MODELS[family].Config(**_common(), layers=layers)


def build_model(family: str, seed: int = 0) -> nn.Module:
    config = model_config(family)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
        for name, p in model.named_parameters():
            if "norm" in name:  # random norms: a skipped QK-norm would show
                p.uniform_(0.5, 1.5)
        for block in model.layers.values():
            moe = getattr(block, "moe", None)
            if moe is not None and moe.expert_bias_E is not None:
                # what the load-balancing update leaves: the choice is not top-k of scores
                moe.expert_bias_E.copy_(torch.tensor([0.3, -0.2, 0.1, -0.4]))
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))


# -- the stock Trainer on a CPU ---------------------------------------------------------


def model_spec(family: str = "llama3", parallelize_fn: Callable | None = None) -> ModelSpec:
    """``family``'s tiny model as a ``ModelSpec`` (llama3 or qwen3 / qwen3-moe;
    ``parallelize_fn``: torchtitan's for the family unless given)."""
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.qwen3 import parallelize_qwen3

    name = family.split("-")[0]
    default = {"llama3": parallelize_llama, "qwen3": parallelize_qwen3}[name]
    return ModelSpec(
        name=name, flavor="tiny", model=model_config(family),
        parallelize_fn=parallelize_fn or default, pipelining_fn=None,
        post_optimizer_build_fn=None, state_dict_adapter=None,
    )  # fmt: skip


class NoDeviceMemory:
    """Stands in for torchtitan's DeviceMemoryMonitor, which asks the CUDA module."""

    device_name = "cpu"

    def get_peak_stats(self) -> Any:
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


class NoTokenizer(BaseTokenizer):
    """The Trainer builds a tokenizer from files; the data below needs none."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        return []

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return ""

    def get_vocab_size(self) -> int:
        return VOCAB


class RandomTokens(BaseDataLoader):
    """Endless batches of random tokens, the same for the same ``seed``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0

    def __init__(self, config: Config, *, local_batch_size: int, seq_len: int, **kwargs: Any):
        self.batch, self.seq_len, self.seed = local_batch_size, seq_len, config.seed

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            ids = torch.randint(0, VOCAB, (self.batch, self.seq_len + 1), generator=generator)
            yield {"input": ids[:, :-1]}, ids[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def trainer_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test shims for the stock ``Trainer`` on one CPU rank (torch.distributed already
    initialized, ``LOCAL_RANK`` set): torchtitan takes "cuda" as the device where
    there is no accelerator; its device memory monitor asks CUDA; and after step 1 it
    sets NCCL timeouts with a barrier on a CUDA device index."""
    import torchtitan.components.metrics as titan_metrics
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.distributed.utils as titan_dist
    import torchtitan.tools.utils as titan_utils

    monkeypatch.setattr(titan_utils, "device_type", "cpu")
    monkeypatch.setattr(titan_utils, "device_module", torch.cpu)
    monkeypatch.setattr(titan_dims, "device_type", "cpu")  # the meshes' device
    monkeypatch.setattr(titan_metrics, "build_device_memory_monitor", NoDeviceMemory)
    monkeypatch.setattr(titan_dist, "set_pg_timeouts", lambda **kwargs: None)
    monkeypatch.setenv("LOCAL_RANK", "0")
