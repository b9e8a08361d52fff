"""Hugging Face model shapes for bench/stacks/real_models.py and
bench/stacks/compiled_models.py (and the capture and monitors cases that train a real
shape), built from configs on the device.

Random weights, no download. ``model_specs`` names the shapes; ``build_workload`` makes
the model, a fused AdamW and one fixed batch, and counts the FLOPs of a training step;
``train_step`` runs one.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from syncless.profile import OFF

VOCAB = 32000  # the same small vocabulary everywhere: the head must not dominate
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s, NVIDIA H200 datasheet


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model shape and its batch."""

    name: str
    family: str
    """``llama``, ``qwen3``, ``mixtral`` or ``qwen3_moe``: which transformers config."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    """The dense MLP's width, or each expert's in an MoE model."""
    layers: int
    batch: int
    seq_len: int
    experts: int = 0
    """Experts per MoE layer; 0 for a dense model."""
    top_k: int = 0
    tied: bool = False
    """Input embedding and output head share one matrix (Llama-3.2-1B, Qwen3-1.7B)."""
    vocab: int = VOCAB


def model_specs(layers_8b: int = 6) -> dict[str, ModelSpec]:
    """The benchmark's shapes by name; ``layers_8b``: decoder layers of the 8B slice."""
    specs = [
        ModelSpec(name="llama3-8b-layers", family="llama", hidden=4096, heads=32, kv_heads=8,
                  head_dim=128, intermediate=14336, layers=layers_8b, batch=2, seq_len=4096),
        ModelSpec(name="llama-1b", family="llama", hidden=2048, heads=32, kv_heads=8,
                  head_dim=64, intermediate=8192, layers=16, batch=4, seq_len=2048, tied=True),
        ModelSpec(name="qwen3-1.7b", family="qwen3", hidden=2048, heads=16, kv_heads=8,
                  head_dim=128, intermediate=6144, layers=12, batch=1, seq_len=8192, tied=True),
        ModelSpec(name="mixtral", family="mixtral", hidden=2048, heads=16, kv_heads=8,
                  head_dim=128, intermediate=5632, layers=8, batch=2, seq_len=4096,
                  experts=8, top_k=2),
        ModelSpec(name="qwen3-moe", family="qwen3_moe", hidden=2048, heads=32, kv_heads=4,
                  head_dim=128, intermediate=768, layers=8, batch=2, seq_len=4096,
                  experts=64, top_k=8),
        # The demo's own large step (host-bound, about 7% of the H200's bf16 peak), so
        # "nothing regresses on the demo" is measured by the same interleaved segments.
        ModelSpec(name="demo-large", family="demo", hidden=1024, heads=16, kv_heads=16,
                  head_dim=64, intermediate=2048, layers=24, batch=8, seq_len=1024,
                  experts=8, top_k=2, vocab=256),
    ]  # fmt: skip
    return {s.name: s for s in specs}


def build_demo(spec: ModelSpec, device: torch.device) -> nn.Module:
    """The syncless demo model at ``spec``'s sizes (its ``large`` preset by default)."""
    from syncless.demo.config import preset
    from syncless.demo.model import MoETransformer, init_weights

    cfg = dataclasses.replace(
        preset("large"), n_layers=spec.layers, d_model=spec.hidden, n_heads=spec.heads,
        n_experts=spec.experts, top_k=spec.top_k, expert_hidden=spec.intermediate,
        seq_len=spec.seq_len, batch_size=spec.batch,
    )  # fmt: skip
    model = MoETransformer(cfg).to(device)
    init_weights(model, cfg.seed)
    model.aux_loss_coef = cfg.aux_loss_coef
    return model.train()


def tiny(spec: ModelSpec) -> ModelSpec:
    """The same family shrunk to run on a CPU in well under a second per step."""
    return dataclasses.replace(
        spec, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=2,
        batch=2, seq_len=64, experts=min(spec.experts, 4), top_k=min(spec.top_k, 2),
        vocab=min(spec.vocab, 512),  # at 32000 the head and its optimizer state are most of a CPU step
    )  # fmt: skip


def hf_config(spec: ModelSpec):
    """The transformers config of ``spec`` (sdpa attention, no KV cache, no window)."""
    import transformers

    common = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        num_hidden_layers=spec.layers,
        max_position_embeddings=max(spec.seq_len, 8192),
        tie_word_embeddings=spec.tied,
        use_cache=False,  # training: a cache would only hold references to k and v
    )
    if spec.family == "llama":
        return transformers.LlamaConfig(intermediate_size=spec.intermediate, **common)
    if spec.family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=spec.intermediate, **common)
    if spec.family == "mixtral":
        return transformers.MixtralConfig(
            intermediate_size=spec.intermediate,
            num_local_experts=spec.experts,
            num_experts_per_tok=spec.top_k,
            sliding_window=None,
            **common,
        )
    if spec.family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            moe_intermediate_size=spec.intermediate,
            num_experts=spec.experts,
            num_experts_per_tok=spec.top_k,
            norm_topk_prob=True,
            **common,
        )
    raise ValueError(f"unknown model family {spec.family!r}")


def autocast_grouped_mm() -> bool:
    """Make transformers' grouped expert matmuls follow autocast, as ``nn.Linear`` does.

    transformers casts the tokens to the weights' dtype, float32 here, and float32 takes
    torch's grouped_mm fallback: a loop of mm over the groups after ``offs.cpu()``, a
    sync per call. Cast to the autocast dtype, it keeps the bf16 kernel and no sync.
    Returns whether transformers' ``_grouped_mm`` is patched.
    """
    from transformers.integrations import moe

    original = getattr(moe, "_grouped_mm", None)
    if original is None or getattr(original, "autocast", False):
        return original is not None

    def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor):
        device = input.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            input, weight = input.to(dtype), weight.to(dtype)  # the gradient stays float32
        return original(input, weight, offs=offs)

    grouped_mm.autocast = True  # type: ignore[attr-defined]
    moe._grouped_mm = grouped_mm
    return True


def build_model(spec: ModelSpec, device: torch.device) -> tuple[nn.Module, str]:
    """The model on ``device`` in float32, and its experts implementation."""
    from transformers import AutoModelForCausalLM

    if spec.family == "demo":
        return build_demo(spec, device), "the demo's dispatch"
    config = hf_config(spec)
    with torch.device(device):
        if not spec.experts:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
            return model.train(), "n/a"
        try:
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa", experts_implementation="grouped_mm"
            )
        except (TypeError, ValueError, ImportError) as e:
            print(f"{spec.name}: grouped_mm experts refused ({e!r}); using the default")
            model = AutoModelForCausalLM.from_config(hf_config(spec), attn_implementation="sdpa")
    experts = str(getattr(model.config, "_experts_implementation", None) or "default")
    if experts == "grouped_mm":
        experts += " (bf16 under autocast)" if autocast_grouped_mm() else " (weights' dtype)"
    return model.train(), experts


def matmul_params(model: nn.Module, spec: ModelSpec) -> float:
    """Parameters one token multiplies by: all but the input embedding (a lookup), the
    output head counted even when it shares the embedding's matrix, and each expert
    weight scaled by top_k / experts (a token visits top_k of them)."""
    if spec.family == "demo":  # a tied head: the embedding's matrix counts once, as it
        embed = head = model.embed.weight  # multiplies every token's output
    else:
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
    total = 0.0
    for name, p in model.named_parameters():  # shared parameters come once
        if p is embed:
            continue
        share = spec.top_k / spec.experts if spec.experts and ".experts." in name else 1.0
        total += p.numel() * share
    return total + (head.numel() if head is embed else 0)


def step_flops(spec: ModelSpec, n_matmul: float) -> float:
    """FLOPs of one training step.

    6 * N * tokens for the weights (forward 2, backward 4), plus the attention scores
    and their weighted sum: 4 * B * L^2 * (heads * head_dim) per layer forward, times 3
    with the backward, halved for the causal mask:
    12 * layers * B * L^2 * heads * head_dim / 2.
    """
    tokens = spec.batch * spec.seq_len
    width = spec.heads * spec.head_dim  # Qwen3-MoE's attention is wider than its hidden
    attention = 12 * spec.layers * spec.batch * spec.seq_len**2 * width / 2
    return 6 * n_matmul * tokens + attention


@dataclass
class Workload:
    """A built model with its optimizer and the one batch every step trains on."""

    spec: ModelSpec
    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    ids: torch.Tensor
    device: torch.device
    bf16: bool
    layers: list[nn.Module]
    n_params: int
    n_matmul: float
    flops: float
    experts: str
    build_s: float
    loss: Callable[[], torch.Tensor] | None = None
    """The step's loss, for models that are not Hugging Face's (bench/stacks/stack_models.py)."""
    checked: dict[str, torch.Tensor] = field(default_factory=dict)
    """The last step's loss and gradient norm as device tensors: what a loop hands to
    ``handle.step(step, loss=, grad_norm=)`` (the nonfinite alarm checks them)."""


def build_workload(spec: ModelSpec, device: torch.device) -> Workload:
    """Model, fused AdamW (CUDA) and a fixed random batch on ``device``."""
    start = time.perf_counter()
    model, experts = build_model(spec, device)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(params, lr=1e-5, **fused)
    g = torch.Generator().manual_seed(0)
    length = spec.seq_len + (spec.family == "demo")  # the demo's targets are the next tokens
    ids = torch.randint(0, spec.vocab, (spec.batch, length), generator=g).to(device)
    n_matmul = matmul_params(model, spec)
    return Workload(
        spec=spec,
        model=model,
        optimizer=optimizer,
        params=params,
        ids=ids,
        device=device,
        bf16=device.type == "cuda",
        layers=list(model.layers if spec.family == "demo" else model.model.layers),
        n_params=sum(p.numel() for p in params),
        n_matmul=n_matmul,
        flops=step_flops(spec, n_matmul),
        experts=experts,
        build_s=time.perf_counter() - start,
    )


def train_step(work: Workload, prof: Any = OFF, flush: Callable[[], None] | None = None) -> float:
    """One training step; returns after the loss read-back, the step's one sync."""
    autocast = torch.autocast(work.device.type, dtype=torch.bfloat16, enabled=work.bf16)
    with prof.section("forward"), autocast:
        loss = step_loss(work)
    with prof.section("backward"):
        loss.backward()
    with prof.section("optimizer"):
        norm = torch.nn.utils.clip_grad_norm_(work.params, 1.0)
        work.optimizer.step()
    work.checked = {"loss": loss.detach(), "grad_norm": norm}
    if flush is not None:
        flush()  # where a real loop flushes its monitors; the gradients are still there
    work.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def step_loss(work: Workload) -> torch.Tensor:
    """The loss of one forward on the workload's batch (no backward)."""
    if work.loss is not None:
        return work.loss()
    if work.spec.family != "demo":
        return work.model(input_ids=work.ids, labels=work.ids).loss
    inputs, targets = work.ids[:, :-1], work.ids[:, 1:]
    logits, balance = work.model(inputs)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return ce + work.model.aux_loss_coef * balance


def count_syncs(work: Workload) -> int:
    """Host-device syncs in one training step (CUDA): 1 is the loss read."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(work)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def matmul_rate(n: int = 8192, repeats: int = 20) -> float:
    """Measured bf16 FLOP/s of an n^3 torch.matmul on the current GPU."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def free_memory() -> None:
    """Collect, and give the caching allocator's free blocks back (between models)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def params_text(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def throughput(work: Workload, step_s: float, matmul: float | None, label: str = "off") -> str:
    """A step time, its tokens/s and, on CUDA, its MFU (``step_flops``)."""
    spec = work.spec
    tokens_per_s = spec.batch * spec.seq_len / step_s
    text = f"{label} {step_s * 1e3:.1f} ms/step, {tokens_per_s / 1e3:.1f}k tokens/s"
    if work.device.type == "cuda":
        text += f", MFU {work.flops / step_s / H200_BF16_PEAK * 100:.1f}% of 989 TFLOP/s"
        if matmul:
            text += f" ({work.flops / step_s / matmul * 100:.1f}% of the measured matmul rate)"
    return text


def bench_device(tiny: bool) -> tuple[torch.device, float | None]:
    """The device a bench runs on (the GPU unless ``tiny``) and, on a GPU, its measured
    bf16 matmul rate (printed: the MFU lines are read against it)."""
    use_cuda = torch.cuda.is_available() and not tiny
    matmul = matmul_rate() if use_cuda else None
    if matmul:
        print(f"bf16 8192^3 matmul: {matmul / 1e12:.0f} TFLOP/s ({matmul / H200_BF16_PEAK:.0%} "
              "of the datasheet)")  # fmt: skip
    return torch.device("cuda" if use_cuda else "cpu"), matmul


def write_json(path: str, matmul: float | None, args: Any, results: dict[str, Any]) -> None:
    """The raw results of a bench run, with the versions and arguments it ran with."""
    import transformers

    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "matmul_flops": matmul, "args": vars(args)}  # fmt: skip
    Path(path).write_text(json.dumps({"meta": meta, "models": results}, indent=1))
