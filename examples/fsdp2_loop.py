"""A torchtitan-style training loop with syncless: FSDP2, activation checkpointing,
torch.compile, gradient accumulation and the monitors on every rank.

    torchrun --nproc-per-node 2 examples/fsdp2_loop.py            # GPUs (NCCL) or CPUs (gloo)
    torchrun --nproc-per-node 2 examples/fsdp2_loop.py --compile-backend aot_eager

Each decoder layer of a tiny Hugging Face Llama (built from a config) is checkpointed
(non-reentrant, torchtitan's ``checkpoint_wrapper``), compiled, and sharded with
``fully_shard``; the root is sharded last. The monitors attach to the sharded model:
the norms find the shards from the DTensors, recomputes are skipped, compiled hooks add
no graph break. Rank 0 prints the run directory.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from syncless.monitors import attach, build
from syncless.run import Run


def build_model(device: torch.device, compile_backend: str | None) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layer = checkpoint_wrapper(layer)  # non-reentrant
        if compile_backend:
            layer.compile(backend=compile_backend)
        fully_shard(layer, mesh=mesh)
        layers[i] = layer
    fully_shard(model, mesh=mesh)
    return model


def main(argv: list[str] | None = None) -> str | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--compile-backend", default="inductor", help="'' to skip compile")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    model = build_model(device, args.compile_backend or None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Run(name="fsdp2-loop", run_dir=args.run_dir) as run:
        handle = attach(model, build("all", optimizer=opt), run=run)
        g = torch.Generator().manual_seed(rank)
        for step in range(args.steps):
            for micro in range(args.accumulate):
                ids = torch.randint(0, 128, (2, 32), generator=g).to(device)
                loss = model(input_ids=ids, labels=ids).loss / args.accumulate
                loss.backward()
                last = micro == args.accumulate - 1
                if last:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                handle.step(step, accumulate=not last)
        handle.close()
        if rank == 0:
            print(run.dir)
        return str(run.dir)


if __name__ == "__main__":
    main(sys.argv[1:])
