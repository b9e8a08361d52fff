"""Host time of the monitors' hot path, per hooked module call, and of the flush.

On a host-bound step (the demo's: a drain per MoE layer) the host time the monitors
add is step time, and on a noisy host it is far easier to resolve than a step-time
difference. This prints, on the demo large dims (forward passes building the autograd
graph, bf16 autocast, fixed batch), for each monitor and kernel backend, and for Triton
with one launch per layer and with one grouped launch per forward: host microseconds
per hook call,
billed by the stack itself (``MonitorHandle.hook_host_ns_total``). Beside
them, the cost of the primitives a hook is made of on this host: an empty Python hook,
one aten op, one ``torch.empty``, one launch of a trivial Triton kernel. Then the
flush (``handle.step``) with every monitor, and its profile's top entries.

    python -m bench.monitors host_cost             # CUDA; on CPU only the torch rows
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from collections.abc import Callable

import torch

from bench.harness import append_result
from syncless import kernels
from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.monitors import MONITORS, attach, build

HOOKED = ("attention", "moe", "activations", "nonfinite")  # norms hooks the optimizer
GROUPED = HOOKED  # every hooked monitor has launch="grouped"


def per_call_us(fn: Callable[[], object], calls: int = 400, rounds: int = 5) -> float:
    """Median over rounds of host µs per call; synchronized between rounds only, and
    rounds short enough not to fill the launch queue."""
    out = []
    for _ in range(rounds):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(out)


def primitives(device: torch.device) -> dict[str, float]:
    x = torch.zeros(1024, device=device)
    out = {
        "python hook (empty)": per_call_us(lambda: None),
        "aten add_": per_call_us(lambda: x.add_(1.0)),
        "torch.empty": per_call_us(lambda: torch.empty(128, 1024, device=device)),
    }
    if device.type == "cuda" and kernels.triton_importable():
        import triton
        import triton.language as tl

        @triton.jit
        def _touch(ptr, n, BLOCK: tl.constexpr):
            o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(ptr + o, tl.load(ptr + o, mask=o < n) + 1.0, mask=o < n)

        _touch[(1,)](x, x.numel(), BLOCK=1024)  # compile
        out["triton launch (trivial)"] = per_call_us(lambda: _touch[(1,)](x, 1024, BLOCK=1024))
    return out


def hook_us(model, cfg, tokens, monitor: str, backend: str) -> float:
    """Host us per hooked module call, its share of the forward's launches included;
    ``triton``: one launch per layer (``launch="layer"``), ``triton-grouped``: one
    grouped launch per forward (the default). Forwards build the autograd graph, as in
    training (under ``no_grad`` the grouped path launches per layer: nothing would keep
    the tensors it holds), and drop it without a backward."""
    grouped = backend == "triton-grouped"
    kernels.set_backend("triton" if grouped else backend)
    os.environ["SYNCLESS_MONITOR_LAUNCH"] = "grouped" if grouped else "layer"
    try:
        handle = attach(model, build([monitor], every=1), lagged=True, budget=None)
    finally:
        os.environ.pop("SYNCLESS_MONITOR_LAUNCH", None)
    autocast = torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=tokens.is_cuda)
    with autocast:
        for step in range(2):  # compile, warm
            model(tokens)
            handle.step(step)
        for name in handle.hook_host_ns_total:
            handle.hook_host_ns_total[name] = 0
        handle.ctx.host_ns[monitor] = 0
        passes = 5
        for step in range(2, 2 + passes):
            model(tokens)
            handle.step(step)
    ns = handle.hook_host_ns_total[monitor]
    if grouped:  # the row measures what it says
        assert all(b.grouped_launches and not b.single_launches for b in handle.ctx.batches)
    handle.close()
    return ns / 1e3 / (passes * cfg.n_layers)


def flush_profile(model, tokens, opt) -> tuple[float, str]:
    handle = attach(model, build(list(MONITORS), optimizer=opt, every=1), lagged=True, budget=None)
    autocast = torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=tokens.is_cuda)
    times, prof = [], cProfile.Profile()
    for step in range(12):
        with autocast:
            logits, balance = model(tokens)
        (logits.float().square().mean() + balance).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if step >= 4:
            prof.enable()
        start = time.perf_counter()
        handle.step(step)
        times.append((time.perf_counter() - start) * 1e3)
        if step >= 4:
            prof.disable()
    handle.close()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    return statistics.median(times[4:]), text.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = (
        preset("large")
        if device.type == "cuda"
        else preset("large", n_layers=4, seq_len=64, batch_size=1)
    )
    model = MoETransformer(cfg).to(device)
    init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    tokens = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=device)

    prims = primitives(device)
    backends = ["torch"]
    if device.type == "cuda" and kernels.triton_importable():
        backends.append("triton")
    hooks = {(m, b): hook_us(model, cfg, tokens, m, b) for b in backends for m in HOOKED}
    if "triton" in backends:
        backends.append("triton-grouped")
        for m in GROUPED:
            hooks[(m, "triton-grouped")] = hook_us(model, cfg, tokens, m, "triton-grouped")
    kernels.set_backend("auto")
    flush_ms, profile_text = flush_profile(model, tokens, opt)

    print("primitives, host us/call: " + "; ".join(f"{k} {v:.1f}" for k, v in prims.items()))
    for b in backends:
        row = "; ".join(f"{m} {hooks[(m, b)]:.1f}" for m in HOOKED if (m, b) in hooks)
        print(f"{b} hooks, host us per hooked module call: {row}")
    print(f"flush (handle.step, every monitor): {flush_ms:.2f} ms")
    print(profile_text)
    if not args.no_record:
        hook_text = " | ".join(
            f"{b}: " + ", ".join(f"{m} {hooks[(m, b)]:.0f}" for m in HOOKED if (m, b) in hooks)
            for b in backends
        )
        append_result(
            "monitor_host_cost",
            f"demo large dims, host us per hooked module call: {hook_text}; primitives us/call: "
            + ", ".join(f"{k} {v:.1f}" for k, v in prims.items())
            + f"; flush (handle.step, all monitors) {flush_ms:.2f} ms",
        )
