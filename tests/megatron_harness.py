"""Megatron-core 0.16 on the CPU, for tests only: the shim and tiny GPT models.

Megatron assumes CUDA in a few places; the shim (shared/NOTES.md, measured on
megatron-core 0.16.1) points them at the CPU:

1. ``torch.cuda.current_device`` returns ``"cpu"`` (mcore passes it as ``device=``);
2. a CPU RNG tracker stands in for ``tensor_parallel.random``'s CUDA one;
3. ``moe_utils.te_general_gemm = None`` without TransformerEngine (0.16.1 defines it
   only inside ``try: import transformer_engine``);
4. the torch LayerNorm fallback accepts sequence parallelism (it asserts it off);
5. a ``TorchFunctionMode`` turns ``device="cuda"`` into the CPU for the pipeline
   schedules' ``torch.zeros(..., device="cuda")``, and ``torch.cuda.synchronize`` and
   ``torch.cuda.Stream`` become no-ops;
6. the full recompute (``recompute_granularity="full"``) saves and restores the CUDA
   RNG state around each checkpointed layer: a no-op (the CPU generator's state and the
   tracker's are saved as before).

The library never patches megatron: this lives in tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_PATCHED = False


class CpuRngTracker:
    """``CudaRNGStatesTracker`` on the CPU generator: named states, forked in turn."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            self.add(name, 1234 + len(self.states_))
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


class _CudaToCpu(TorchFunctionMode):
    """Factory calls with ``device="cuda"`` (the pipeline schedules') get the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def patch_megatron_for_cpu() -> None:
    """Apply the shim (idempotent); :func:`unpatch` puts torch and megatron back."""
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils

    _set(torch.cuda, "current_device", lambda: "cpu")
    _set(torch.cuda, "synchronize", lambda *a, **k: None)
    _set(torch.cuda, "Stream", _CpuStream)
    _set(torch.cuda, "current_stream", lambda *a, **k: _CPU_STREAM)
    _set(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    _set(mcore_random, "_CUDA_RNG_STATE_TRACKER", CpuRngTracker())
    _set(mcore_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    _set(mcore_random, "_get_cuda_rng_state", lambda *a, **k: None)
    _set(mcore_random, "_set_cuda_rng_state", lambda *a, **k: None)
    _set(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None))
    _set(torch_norm.WrappedTorchNorm, "__new__", _sequence_parallel_norm(torch_norm))
    _PATCHED = True


def unpatch() -> None:
    """Undo :func:`patch_megatron_for_cpu` (the pytest process runs other tests after)."""
    global _PATCHED
    while _SAVED:
        owner, name, old = _SAVED.pop()
        setattr(owner, name, old)
    _PATCHED = False


_SAVED: list[tuple[Any, str, Any]] = []


def _set(owner: Any, name: str, value: Any) -> None:
    _SAVED.append((owner, name, owner.__dict__.get(name, getattr(owner, name, None))))
    setattr(owner, name, value)


class _CpuEvent:
    def synchronize(self) -> None:
        pass


class _CpuStream:
    """The stream the alltoall dispatcher copies its splits on: the CPU has one."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()


_CPU_STREAM = _CpuStream()


def _sequence_parallel_norm(torch_norm: Any) -> Any:
    """The torch LayerNorm fallback asserts sequence parallelism off: build it from a
    copy of the config with it off, and tag its parameters as Megatron's own norms do
    (their gradients are then all-reduced over the tensor-parallel group)."""
    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = dataclasses.replace(config, sequence_parallel=False)
        norm = build(cls, config, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm

    return staticmethod(new)


def cuda_to_cpu() -> TorchFunctionMode:
    """The context that points ``device="cuda"`` factories at the CPU (pipeline runs)."""
    return _CudaToCpu()


@dataclasses.dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int | None = None  # virtual pipeline chunks per rank


def init_parallel(parallel: Parallel) -> None:
    """Megatron's process groups over an initialised torch.distributed world."""
    from megatron.core import parallel_state

    patch_megatron_for_cpu()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        expert_model_parallel_size=parallel.ep,
    )


@contextlib.contextmanager
def single_process(parallel: Parallel = Parallel()) -> Iterator[None]:
    """A world of one gloo rank in this process, with Megatron's groups; torn down after."""
    from megatron.core import parallel_state

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        init_parallel(parallel)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()
        unpatch()


def gpt_config(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    query_groups: int | None = None,
    experts: int | None = None,
    top_k: int = 2,
    parallel: Parallel = Parallel(),
    **overrides: Any,
):
    """A tiny ``TransformerConfig`` that trains on the CPU (float32)."""
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if experts:
        moe = dict(
            num_moe_experts=experts,
            moe_router_topk=top_k,
            moe_ffn_hidden_size=2 * hidden,
            # alltoall hands tensors to all_to_all_single as split sizes on the CPU
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
        )
    kwargs = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=query_groups,
        ffn_hidden_size=2 * hidden,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        expert_model_parallel_size=parallel.ep,
        sequence_parallel=parallel.tp > 1 and bool(experts),
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        bf16=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **moe,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt_model(
    config,
    *,
    vocab: int = 128,
    seq: int = 16,
    vp_stage: int | None = None,
    pre_process: bool = True,
    post_process: bool = True,
):
    """A ``GPTModel`` with the local (non-TransformerEngine) layer spec and RoPE."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm
    )
    kwargs = {} if vp_stage is None else {"vp_stage": vp_stage}
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        **kwargs,
    )


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's mask convention: True where attention is *not* allowed, [1, 1, s, s]."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def batch(seed: int, *, batch_size: int = 2, seq: int = 16, vocab: int = 128):
    """Random tokens, positions, labels and the causal mask of one micro-batch."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq), generator=g)
    labels = torch.randint(0, vocab, (batch_size, seq), generator=g)
    positions = torch.arange(seq)[None].expand(batch_size, seq)
    return tokens, positions, labels, causal_mask(seq)
