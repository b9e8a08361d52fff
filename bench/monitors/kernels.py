"""GPU kernels each monitor launches per hooked module per step, counted by the profiler.

One demo training step (forward, backward, optimizer, flush) on CUDA under bf16
autocast, profiled with torch.profiler; every device activity (kernels, memsets,
memcpys) counts as a launch. A monitor's launches per hooked module are the extra
activities of the step with that monitor attached over the step without, divided by
the modules it hooks (one per layer; norms hooks the optimizer, reported per layer).
Both kernel backends (syncless.kernels: fused Triton, torch ops) run in the same
process. The issue's target is at most 3 per hooked module.

    python -m bench.monitors kernels            # demo large dims, 4 layers
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.harness import append_result
from syncless import kernels
from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.monitors import MONITORS, attach, build


def device_activities(monitor: str | None, n_layers: int, backend: str) -> int:
    kernels.set_backend(backend)
    torch.manual_seed(0)
    cfg = preset("large", n_layers=n_layers)
    model = MoETransformer(cfg).cuda()
    init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    handle = None
    if monitor is not None:
        handle = attach(model, build([monitor], optimizer=opt, every=1), lagged=True)
    tokens = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device="cuda")

    def one_step(step: int) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, balance = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()) + balance
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if handle is not None:
            handle.step(step)

    for step in range(3):  # warm-up: Triton compiles, lazy optimizer state, first flush
        one_step(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_step(3)
        torch.cuda.synchronize()
    if handle is not None:
        handle.close()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def qk_device_ms(n_layers: int = 24) -> dict[str, float]:
    """Device ms of the attention statistics for ``n_layers`` layers of demo large
    shapes (bf16 q, k [8, 16, 1024, 64], causal): exact in one grouped launch, exact per
    layer, and every 8th query row per layer (what the torch path's 2**24 budget
    samples). What the fused path's exact default costs the device."""
    cfg = preset("large")
    shape = (n_layers, cfg.batch_size, cfg.n_heads, cfg.seq_len, cfg.d_model // cfg.n_heads)
    qs = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    ks = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    per_layer = qs[0].numel()
    offsets = torch.arange(n_layers, device="cuda").repeat(2) * per_layer
    scale = shape[-1] ** -0.5

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 10

    def per_layer_launches(stride: int):
        return lambda: [
            kernels.qk_stats_partials(qs[i], ks[i], scale, True, None, 0, stride, stride)
            for i in range(n_layers)
        ]

    return {
        "exact grouped": timed(
            lambda: kernels.qk_stats_partials_grouped(
                qs[0], ks[0], offsets, n_layers, scale, True, None
            )
        ),
        "exact per layer": timed(per_layer_launches(1)),
        "every 8th row per layer": timed(per_layer_launches(8)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("monitor_kernels counts GPU launches: it needs CUDA")
    backends = ["triton", "torch"] if kernels.triton_importable() else ["torch"]
    rows: dict[str, dict[str, float]] = {}
    for backend in backends:
        base = device_activities(None, args.layers, backend)
        for name in MONITORS:
            extra = device_activities(name, args.layers, backend) - base
            rows.setdefault(name, {})[backend] = extra / args.layers
        print(f"{backend}: baseline step {base} device activities")
    print(
        f"{'monitor':<12}"
        + "".join(f"{b:>10}" for b in backends)
        + "   (launches per hooked module per step)"
    )
    for name, per in rows.items():
        print(f"{name:<12}" + "".join(f"{per[b]:>10.1f}" for b in backends))
    qk = qk_device_ms() if kernels.triton_importable() else {}
    qk_text = ", ".join(f"{k} {v:.2f}" for k, v in qk.items())
    if qk:
        print(f"attention statistics, device ms for 24 layers of demo large: {qk_text}")
    if args.no_record:
        return
    summary = "; ".join(
        f"{name} " + " / ".join(f"{per[b]:.1f}" for b in backends) for name, per in rows.items()
    )
    append_result(
        "monitor_kernels",
        f"GPU launches (profiler device activities) per hooked module per step, demo large dims "
        f"{args.layers} layers, bf16, backends {' / '.join(backends)}: {summary}"
        + (
            f"; attention statistics, device ms for 24 layers of demo large: {qk_text}"
            if qk
            else ""
        ),
    )
