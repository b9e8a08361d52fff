"""syncless in a Megatron-core training loop: a small GPT-MoE, tensor / pipeline /
expert parallel as torchrun and the flags ask, every monitor, the profiler over
Megatron's schedule, and capture windows between pipeline communications.

    pip install "syncless[megatron]"
    torchrun --nproc-per-node 4 examples/megatron_gpt.py --tp 2 --pp 2
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --ep 2

On GPUs with NCCL (Megatron-core needs CUDA; the CPU tests run it through a test-only
shim, tests/megatron_harness.py). The run directory lands under runs/.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist

from syncless.capture import CaptureEngine, SafetensorsSink
from syncless.integrations.megatron import SynclessMegatron
from syncless.profile import Profiler
from syncless.run import Run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--validate-every", type=int, default=10)
    parser.add_argument("--run-dir", default=None)
    return parser.parse_args(argv)


def build(args: argparse.Namespace, device: torch.device):
    """Megatron's groups, the model (local layer spec) and a torch optimizer."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            expert_model_parallel_size=args.ep,
        )
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
        num_query_groups=4, ffn_hidden_size=4 * args.hidden, num_moe_experts=args.experts,
        moe_router_topk=2, moe_ffn_hidden_size=2 * args.hidden,
        moe_token_dispatcher_type="alltoall", add_bias_linear=False,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep, sequence_parallel=args.tp > 1,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu", gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        batch_p2p_comm=False,
    )  # fmt: skip
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.experts),
        vocab_size=1024,
        max_sequence_length=args.seq,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
    ).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def micro_batches(args: argparse.Namespace, step: int, device: torch.device):
    g = torch.Generator().manual_seed(step)
    mask = torch.ones(args.seq, args.seq, dtype=torch.bool, device=device).triu(1)[None, None]
    positions = torch.arange(args.seq, device=device)[None].expand(2, -1)
    for _ in range(args.micro_batches):
        tokens = torch.randint(0, 1024, (2, args.seq), generator=g).to(device)
        yield tokens, positions, tokens.roll(-1, dims=1), mask


def forward_step(engine: CaptureEngine, data_iterator, model):
    tokens, positions, labels, mask = next(data_iterator)
    output = model(tokens, positions, mask, labels=labels)
    # Each micro-batch's stage output (per-token losses on the last stage) leaves through
    # the engine's ring: in the windows between pipeline communications when training.
    engine.capture("stage_output", output.detach())

    def loss_func(output_tensor: torch.Tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def main(argv: list[str] | None = None, device: torch.device | None = None) -> SynclessMegatron:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = parse_args(argv)
    if device is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    model, optimizer = build(args, device)
    run = Run(name="megatron", run_dir=args.run_dir)
    engine = CaptureEngine(64 << 20, 16 << 20, SafetensorsSink(run.dir, run.ranks.rank))
    syncless = SynclessMegatron(
        [model], optimizer, run=run, profiler=Profiler(mode="events"), capture=engine
    )
    forward_backward = syncless.forward_backward(get_forward_backward_func())
    schedule = partial(
        forward_backward, forward_step_func=partial(forward_step, engine), model=[model],
        num_microbatches=args.micro_batches, seq_length=args.seq, micro_batch_size=2,
    )  # fmt: skip
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        schedule(data_iterator=micro_batches(args, step, device))
        syncless.optimizer_step(optimizer)
        syncless.step(step)
        if args.validate_every and (step + 1) % args.validate_every == 0:
            with torch.no_grad():  # no windows, no monitors, no flush charged to training
                schedule(
                    data_iterator=micro_batches(args, 10_000 + step, device), forward_only=True
                )
    syncless.close()
    engine.close()
    run.close()
    return syncless


if __name__ == "__main__":
    main()
