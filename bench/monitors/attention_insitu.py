"""Where the attention monitor's device time goes inside a real training step (CUDA).

bench/monitors/attention_kernel.py times the statistics kernel alone; inside a Hugging Face
training step the monitor's measured device time was about twice the sum of its
kernels' isolated times (bench/RESULTS.md, real_models at de42001). This profiles
monitored steps with ``torch.profiler`` and prints the device time of every kernel the
monitor launches (and the step's largest ones), then times the same grouped launch on
tensors of the same shapes outside the step.

    python -m bench.monitors attention_insitu --model llama-1b
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from bench.harness import append_result
from bench.stacks.hf_models import build_workload, model_specs, train_step
from syncless.kernels import attention, rope
from syncless.monitors import attach, build

OURS = ("_qk_stats", "_rotate_kernel", "_fold", "fold")


def profiled(work, steps: int) -> str:
    handle = attach(work.model, build(["attention"], every=1), budget=None)
    for s in range(3):
        train_step(work, flush=lambda s=s: handle.step(s))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in range(3, 3 + steps):
            train_step(work, flush=lambda s=s: handle.step(s))
    handle.close()
    rows = prof.key_averages()
    total = sum(r.device_time_total for r in rows) / steps / 1e3
    print(f"device time per step: {total:.1f} ms (all kernels)")
    for r in sorted(rows, key=lambda r: -r.device_time_total)[:12]:
        print(f"  {r.device_time_total / steps / 1e3:8.3f} ms  x{r.count // steps:<4} {r.key[:90]}")
    print("the monitor's kernels:")
    ours = []
    for r in rows:
        if any(k in r.key for k in OURS):
            per = r.device_time_total / steps / 1e3
            print(f"  {per:8.3f} ms/step x{r.count // steps:<4} {r.key[:90]}")
            ours.append(f"{r.key} {per:.3f} ({r.count // steps})")
    return f"{', '.join(ours)}; all kernels {total:.1f}"


def isolated(spec) -> str:
    b, h, hkv, length, d, n = (
        spec.batch,
        spec.heads,
        spec.kv_heads,
        spec.seq_len,
        spec.head_dim,
        spec.layers,
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    qs = [torch.randn(b, length, h * d, device="cuda", generator=g).bfloat16() for _ in range(n)]
    ks = [torch.randn(b, hkv, length, d, device="cuda", generator=g).bfloat16() for _ in range(n)]
    q = [x.view(b, length, h, d).transpose(1, 2) for x in qs]
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    freqs = torch.arange(length, device="cuda").float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    cos, sin = emb.cos(), emb.sin()
    offsets = [x.data_ptr() - qs[0].data_ptr() for x in qs]
    offsets = [o // 2 for o in offsets] + [(x.data_ptr() - ks[0].data_ptr()) // 2 for x in ks]
    offsets = torch.tensor(offsets + [0] * (2 * n), device="cuda")
    scale = d**-0.5

    def grouped():
        attention.qk_stats_partials_grouped(
            q[0], ks[0], offsets, n, scale, True, None, q_rope=(cos, sin),
            compute_dtype=torch.bfloat16,
        )  # fmt: skip

    def single():
        for i in range(n):
            attention.qk_stats_partials(
                q[i], ks[i], scale, True, None, q_rope=(cos, sin), compute_dtype=torch.bfloat16
            )

    def rotate():
        for i in range(n):
            rope.rotate(ks[i], cos, sin, torch.bfloat16)

    for name, fn in (("grouped", grouped), ("single x n", single), ("rope_k x n", rotate)):
        ms = [
            triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(3)
        ]
        print(f"isolated {name}: {statistics.median(ms):.3f} ms for {n} layers")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b", choices=list(model_specs()))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    spec = model_specs()[args.model]
    work = build_workload(spec, torch.device("cuda"))
    inside = profiled(work, args.steps)
    del work
    torch.cuda.empty_cache()
    alone = isolated(spec)
    print(append_result(
        "attention_insitu",
        f"{spec.name} ({spec.layers} layers, B {spec.batch} x L {spec.seq_len}, H "
        f"{spec.heads}/{spec.kv_heads}, D {spec.head_dim}), attention monitor every step, "
        f"device ms per step over {args.steps} profiled steps: {inside}; the same launches "
        f"alone (do_bench median of 3): {alone}",
    ))  # fmt: skip
