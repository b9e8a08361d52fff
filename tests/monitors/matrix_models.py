"""The model families of the monitor matrix (tests/monitors/test_matrix.py): how to
build each one tiny on the CPU, train a step, checkpoint and compile it, and what it
holds, written down from the model's own structure (never from an adapter).

Each family's truth is what a monitor should find: the layers with attention, the
layers with an MoE router and its top-k. The tokens a step routes are counted by the
test (batch shape), the norms recomputed from the blocks' parameters.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

B, L = 2, 16  # one rank's batch: sequences x tokens


@dataclass(frozen=True)
class Family:
    name: str
    n_layers: int
    attention_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    top_k: int
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int], torch.Tensor]  # (model or its compiled form, seed)
    blocks: Callable[[nn.Module], list[nn.Module]]
    checkpoint: Callable[[nn.Module], None]
    compile: Callable[[nn.Module], nn.Module]  # what the loop calls
    # A context every cell of the family runs in (Megatron's process groups).
    world: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # Which dynamo settings its compile needs (torchtitan's MoE: data-dependent shapes).
    dynamo: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    @property
    def tokens(self) -> int:
        return B * L


def ids(seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Non-reentrant activation checkpointing of each block, as a user without a
    framework flag would write it: the block's own hooks fire once, its submodules'
    twice (forward, then the recompute in the backward)."""
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def compile_whole(model: nn.Module) -> nn.Module:
    """The eager backend: graph capture is what is tested, not code generation."""
    return torch.compile(model, backend="eager")


# -- the demo ---------------------------------------------------------------------------


class DenseMLP(nn.Module):
    """A demo block's dense feed-forward in the MoE's place (no ``router``): the demo
    adapter maps such a block as a dense layer."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.down(F.silu(self.up(x))), x.new_zeros(())


def _demo(dense: bool) -> nn.Module:
    from syncless.demo.config import preset
    from syncless.demo.model import MoETransformer, init_weights

    cfg = preset("tiny")
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    init_weights(model, 0)
    if dense:
        for block in model.layers:
            block.moe = DenseMLP(cfg.d_model, cfg.expert_hidden)
    return model


def _demo_loss(model: nn.Module, seed: int) -> torch.Tensor:
    tokens = ids(seed, 256)
    logits, balance = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()) + 0.01 * balance


def _demo_family(name: str, dense: bool) -> Family:
    return Family(
        name, 2, (0, 1), () if dense else (0, 1), 2,
        functools.partial(_demo, dense), _demo_loss, lambda m: list(m.layers),
        lambda m: checkpoint_blocks(list(m.layers)), compile_whole,
    )  # fmt: skip


# -- Hugging Face -----------------------------------------------------------------------

HF_COMMON = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
)  # fmt: skip


def _hf(kind: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**HF_COMMON, num_hidden_layers=2)
        )
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            **HF_COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2
        )
        return transformers.MixtralForCausalLM(config)
    config = transformers.Qwen2MoeConfig(  # MoE every second layer: layer 1 of 0..2
        **HF_COMMON, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=2,
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


def _hf_loss(model: nn.Module, seed: int) -> torch.Tensor:
    tokens = ids(seed, 64)
    return model(tokens, labels=tokens).loss


def _hf_checkpoint(model: nn.Module) -> None:
    model.gradient_checkpointing_enable({"use_reentrant": False})


def _hf_family(name: str, kind: str, n_layers: int, moe: tuple[int, ...]) -> Family:
    return Family(
        name, n_layers, tuple(range(n_layers)), moe, 2, functools.partial(_hf, kind), _hf_loss,
        lambda m: list(m.model.layers), _hf_checkpoint, compile_whole,
    )  # fmt: skip


# -- nn.MultiheadAttention ----------------------------------------------------------------


class EncoderLM(nn.Module):
    """``nn.TransformerEncoderLayer`` blocks (their ``self_attn`` is an
    ``nn.MultiheadAttention``) under a causal mask, with a tied head."""

    def __init__(self, vocab: int = 64, d_model: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, 4, 64, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return x @ self.embed.weight.t()


def _mha() -> nn.Module:
    torch.manual_seed(0)
    return EncoderLM()


def _mha_loss(model: nn.Module, seed: int) -> torch.Tensor:
    tokens = ids(seed, 64)
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def _mha_family() -> Family:
    return Family(
        "mha", 2, (0, 1), (), 0, _mha, _mha_loss, lambda m: list(m.layers),
        lambda m: checkpoint_blocks(list(m.layers)), compile_whole,
    )  # fmt: skip


# -- torchtitan ---------------------------------------------------------------------------


def _titan(family: str) -> nn.Module:
    from torchtitan_harness import build_model

    return build_model(family)


def _titan_loss(model: nn.Module, seed: int) -> torch.Tensor:
    from torchtitan_harness import VOCAB

    tokens = ids(seed, VOCAB)
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())


def _titan_checkpoint(model: nn.Module) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC

    FullAC.Config().build().apply(model)


def _titan_compile(model: nn.Module) -> nn.Module:
    """torchtitan's apply_compile: each block compiled in place, fullgraph."""
    for block in model.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    return model


def _titan_dynamo() -> contextlib.AbstractContextManager:
    """The settings torchtitan's apply_compile makes (tests/monitors/adapters)."""
    return torch._dynamo.config.patch(
        capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True
    )


def _titan_family(name: str, family: str, moe: tuple[int, ...]) -> Family:
    return Family(
        name, 2, (0, 1), moe, 2, functools.partial(_titan, family), _titan_loss,
        lambda m: list(m.layers.values()), _titan_checkpoint, _titan_compile,
        dynamo=_titan_dynamo,
    )  # fmt: skip


# -- Megatron-core ------------------------------------------------------------------------


def _megatron(experts: int | None, recompute: bool = False) -> nn.Module:
    from megatron_harness import gpt_config, gpt_model

    overrides: dict[str, Any] = {}
    if recompute:  # Megatron's own full recompute of every layer
        overrides = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    torch.manual_seed(0)
    return gpt_model(gpt_config(layers=2, heads=4, query_groups=2, experts=experts, **overrides))


def _megatron_loss(model: nn.Module, seed: int) -> torch.Tensor:
    from megatron_harness import batch

    tokens, positions, labels, mask = batch(seed, batch_size=B, seq=L)
    return model(tokens, positions, mask, labels=labels).float().mean()


@contextlib.contextmanager
def _megatron_world() -> Iterator[None]:
    """Megatron's process groups over the world the cell runs in (one gloo rank in this
    process, or the spawned ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron_harness import Parallel, init_parallel, single_process, unpatch

    if not dist.is_initialized():
        with single_process(Parallel()):
            yield
        return
    init_parallel(Parallel())
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        unpatch()


def _megatron_compile(model: nn.Module) -> nn.Module:
    """Each TransformerLayer compiled in place, as torchtitan compiles its blocks (the
    whole GPTModel traced twice as long here: 7.3 vs 4.2 s a cell)."""
    for layer in model.decoder.layers:
        layer.compile(backend="eager")
    return model


def _megatron_family(name: str, experts: int | None) -> Family:
    return Family(
        name, 2, (0, 1), (0, 1) if experts else (), 2,
        functools.partial(_megatron, experts), _megatron_loss,
        lambda m: list(m.decoder.layers),
        lambda m: None,  # built with recompute (``build_checkpointed``)
        _megatron_compile, world=_megatron_world,
    )  # fmt: skip


def build_checkpointed(family: Family) -> nn.Module:
    """The family's model with activation checkpointing on, the way its users turn it
    on: Megatron's config at construction, everyone else's after."""
    if family.name.startswith("megatron"):
        return _megatron(2 if family.moe_layers else None, recompute=True)
    model = family.build()
    family.checkpoint(model)
    return model


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except Exception:  # an extra that is not installed, or that fails to import
        return False
    return True


def families() -> dict[str, Family]:
    """Every family whose stack is installed (CI's test extra installs all of them)."""
    out = [_demo_family("demo-moe", dense=False), _demo_family("demo-dense", dense=True)]
    if _importable("transformers"):
        out += [
            _hf_family("hf-llama", "llama", 2, ()),
            _hf_family("hf-mixtral", "mixtral", 2, (0, 1)),
            _hf_family("hf-qwen2-moe", "qwen2-moe", 3, (1,)),
        ]
    out.append(_mha_family())
    if _importable("torchtitan"):
        out += [_titan_family("titan-llama3", "llama3", ()),
                _titan_family("titan-qwen3-moe", "qwen3-moe", (0, 1))]  # fmt: skip
    if _importable("megatron.core"):
        out += [_megatron_family("megatron-gpt", None), _megatron_family("megatron-moe", 2)]
    return {f.name: f for f in out}
