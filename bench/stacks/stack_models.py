"""Step-time overhead of syncless inside the seed users' own stacks: a Megatron-core
GPT-MoE and torchtitan's llama3 and MoE models, at GPU-bound sizes on one H200.

Measured as bench/stacks/real_models.py measures the Hugging Face models (its interleaved
segments, its ``off`` / ``stack`` / ``profile`` modes, its table and RESULTS.md line);
only the models differ. Random weights, no download, one fixed batch.

- ``megatron-gpt-moe``: megatron-core ``GPTModel``, local layer spec (TransformerEngine is
  not on the device image), bf16 parameters under Megatron's ``Float16Module``, RoPE, 8 experts top-2 (``SequentialMLP``),
  the alltoall dispatcher with capacity 1.0 and padding (no per-layer D2H sync), a torch
  fused AdamW; one rank (NCCL world of 1).
- ``torchtitan-llama3`` / ``torchtitan-moe``: torchtitan's model classes built from
  their config dataclasses, SDPA attention, bf16 autocast over fp32 parameters.

    python -m bench.stacks stack_models                      # on one H200
    python -m bench.stacks stack_models --tiny --no-append   # a CPU smoke test (small shapes)
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import traceback
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from bench.harness import append_result
from bench.stacks.hf_models import (
    ModelSpec,
    Workload,
    bench_device,
    free_memory,
    step_flops,
    write_json,
)
from bench.stacks.real_models import run_model
from bench.stacks.segments import stack_label

MEGATRON = ModelSpec(name="megatron-gpt-moe", family="megatron", hidden=1024, heads=16,
                     kv_heads=4, head_dim=64, intermediate=2816, layers=16, batch=8,
                     seq_len=2048, experts=8, top_k=2)  # fmt: skip
TITAN_LLAMA = ModelSpec(name="torchtitan-llama3", family="titan-llama3", hidden=2048,
                        heads=16, kv_heads=8, head_dim=128, intermediate=8192, layers=16,
                        batch=4, seq_len=2048)  # fmt: skip
TITAN_MOE = ModelSpec(name="torchtitan-moe", family="titan-moe", hidden=1024, heads=16,
                      kv_heads=8, head_dim=64, intermediate=1408, layers=12, batch=8,
                      seq_len=4096, experts=16, top_k=2)  # fmt: skip
SPECS = {s.name: s for s in (MEGATRON, TITAN_LLAMA, TITAN_MOE)}


def tiny(spec: ModelSpec) -> ModelSpec:
    return replace(spec, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                   layers=2, batch=2, seq_len=32, vocab=256)  # fmt: skip


def _init_world(device: torch.device) -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _finish(spec: ModelSpec, model, optimizer, params, ids, device, layers, loss, start):
    n = sum(p.numel() for p in params)
    expert = sum(p.numel() for name, p in model.named_parameters() if "expert" in name)
    n_matmul = n - expert + expert * (spec.top_k / spec.experts if spec.experts else 1.0)
    return Workload(
        spec=spec, model=model, optimizer=optimizer, params=params, ids=ids, device=device,
        bf16=device.type == "cuda", layers=layers, n_params=n, n_matmul=n_matmul,
        flops=step_flops(spec, n_matmul), experts=f"{spec.experts} top-{spec.top_k}",
        build_s=time.perf_counter() - start, loss=loss,
    )  # fmt: skip


def build_megatron(spec: ModelSpec, device: torch.device) -> Workload:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if device.type != "cuda":  # Megatron's RNG tracker needs CUDA (tests use a CPU shim)
        raise SystemExit("megatron-gpt-moe runs on CUDA only; the CPU tests cover it")
    from megatron.core.transformer.moe import moe_utils

    # 0.16.1 defines te_general_gemm only when TransformerEngine imports, and its router
    # reads it unconditionally: the one name the device image (no TE) needs.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    start = time.perf_counter()
    _init_world(device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    bf16 = device.type == "cuda"
    moe = dict(
        num_moe_experts=spec.experts, moe_router_topk=spec.top_k,
        moe_ffn_hidden_size=spec.intermediate, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss",
        # Dropping and padding to capacity: the dispatcher then needs no D2H read of the
        # token counts per layer (33 syncs a step without it, 7% MFU: host-bound).
        moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
    ) if spec.experts else {}  # fmt: skip
    config = TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        num_query_groups=spec.kv_heads, kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=False, **moe,
    )  # fmt: skip
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.experts or None, moe_grouped_gemm=False)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=spec.vocab,
        max_sequence_length=spec.seq_len, position_embedding_type="rope",
    ).to(device)  # fmt: skip
    if bf16:  # as Megatron trains in bf16: its own wrapper, not autocast (its autograd
        # Functions, the router's among them, do not follow autocast)
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq_len), generator=g).to(device)
    positions = torch.arange(spec.seq_len, device=device)[None].expand(spec.batch, -1)
    mask = torch.ones(spec.seq_len, spec.seq_len, dtype=torch.bool, device=device).triu(1)

    def loss() -> torch.Tensor:
        return model(ids, positions, mask[None, None], labels=ids).float().mean()

    layers = list((model.module if bf16 else model).decoder.layers)
    work = _finish(spec, model, optimizer, params, ids, device, layers, loss, start)
    work.bf16 = False  # no autocast: the parameters are bf16 already
    return work


def build_titan(spec: ModelSpec, device: torch.device) -> Workload:
    """torchtitan's llama3, or its MoE model (qwen3's MoE config), from config
    dataclasses (no download), SDPA attention."""
    from bench.stacks.titan_models import build_titan_model

    start = time.perf_counter()
    model = build_titan_model(spec, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq_len), generator=g).to(device)

    def loss() -> torch.Tensor:
        logits = model(ids)
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), ids.roll(-1, dims=1).flatten()
        )

    layers = list(model.layers.values())
    return _finish(spec, model, optimizer, params, ids, device, layers, loss, start)


BUILDERS = {"megatron": build_megatron, "titan-llama3": build_titan, "titan-moe": build_titan}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(SPECS), help=f"comma list of {list(SPECS)}")
    parser.add_argument("--modes", default="off,stack,profile", help="comma list, with off")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seg", type=int, default=6)
    parser.add_argument("--stack-seg", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--stack-warmup", type=int, default=10)
    parser.add_argument("--budget", type=float, default=0.01)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--max-seconds", type=float, default=480.0)
    parser.add_argument("--json", help="write raw step times and estimates here")
    parser.add_argument("--no-append", action="store_true", help="skip bench/RESULTS.md")
    args = parser.parse_args(argv)
    args.models, args.modes = args.models.split(","), args.modes.split(",")
    if args.tiny:
        args.rounds, args.seg, args.stack_seg, args.stack_warmup = 2, 2, 3, 2
    return args


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    start = time.perf_counter()
    args = parse_args(argv)
    device, matmul = bench_device(args.tiny)
    print(f"{device.type}, {stack_label(args.budget)}, {args.rounds} rounds")
    results: dict[str, Any] = {}
    for i, name in enumerate(args.models):
        elapsed = time.perf_counter() - start
        deadline = start + elapsed + (args.max_seconds - elapsed) / (len(args.models) - i)
        spec = tiny(SPECS[name]) if args.tiny else SPECS[name]
        try:
            results[name] = run_model(
                spec, args, device, deadline, matmul, build=BUILDERS[spec.family]
            )
        except (Exception, SystemExit):  # the next model still runs
            traceback.print_exc()
        free_memory()
    if args.json:
        write_json(args.json, matmul, args, results)
    if args.no_append:
        return
    for name, entry in results.items():
        rows = "; ".join(f"{k} {v}" for k, v in entry["rows"].items())
        stack = "megatron-core local spec, bf16 params" if "megatron" in name else (
            "torchtitan, bf16 autocast over fp32"
        )  # fmt: skip
        append_result(
            "stack_models",
            f"{entry['workload']}; {stack}, sdpa/local attention, AdamW, clip 1.0; overhead "
            f"per mode, median [min..max] (rounds) of per-round mean step over the off "
            f"segment's, segments {args.seg} steps (stack {args.stack_seg}) after "
            f"{args.warmup} untimed (stack {args.stack_warmup}): {rows}"
            + "".join(f"; {n}" for n in entry["notes"]),
        )
