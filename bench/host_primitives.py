"""Host cost of the calls a monitor hook and a grouped launch are made of.

The monitors' cost on a host-bound step is host time, so these are the units it is
built from: Python and torch calls a hook makes (in a tight loop: warm caches, the
floor of what a hook costs inside a forward, where it measured 2-3x more), a forward
hook's dispatch, and one grouped QK-statistics launch of the demo's ``large`` shape
after a synchronize (the GPU idle, as at the end of a host-bound forward), back to back
and behind a running matmul. It also times a trivial Triton kernel through
``JITFunction.run`` and through the compiled kernel's runner (the few microseconds a
launch cache could save: too few to keep one, see docs/monitors/README.md). It reproduces the probe lines of bench/RESULTS.md at
839d1b4.

    python bench/host_primitives.py          # CUDA only (the launches need a GPU)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from results import append_result  # bench/ is on sys.path as a script

from syncless import kernels
from syncless.demo.config import preset
from syncless.metrics import MetricSet
from syncless.monitors.base import MonitorContext
from syncless.monitors.layer_batch import LayerBatch


def per_call_us(fn: Callable[[], object], n: int = 5000) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - start) / n / 1e3


def median_us(fn: Callable[[], object], before: Callable[[], object], n: int = 50) -> float:
    """Median host time of ``fn`` with ``before`` run (untimed) ahead of each call."""
    times = []
    for _ in range(n):
        before()
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def calls(x: torch.Tensor) -> dict[str, float]:
    layers = LayerBatch(
        list(range(10**6)), _NoGroup(), view=None, grouped=None, single=None,  # type: ignore[arg-type]
        device=x.device,
    )  # fmt: skip
    counter = [0]

    def add() -> None:  # a layer index never seen twice: the batch never launches
        counter[0] += 1
        layers.add(counter[0], x)
        if counter[0] % 1000 == 0:
            layers._pending.clear()

    billed = MonitorContext(model=None, metrics=MetricSet()).timed("m", lambda h: None)  # type: ignore[arg-type]
    linear = torch.nn.Linear(16, 16, device=x.device)
    y = torch.randn(4, 16, device=x.device)
    out = {
        "empty Python call": per_call_us(lambda: None),
        "perf_counter_ns": per_call_us(time.perf_counter_ns),
        "kernels.use_triton": per_call_us(lambda: kernels.use_triton(x)),
        "torch.is_grad_enabled": per_call_us(torch.is_grad_enabled),
        "is_current_stream_capturing": per_call_us(torch.cuda.is_current_stream_capturing),
        "tensor.detach()": per_call_us(x.detach),
        "LayerBatch.add": per_call_us(add),
        "MonitorContext.timed(no-op)": per_call_us(lambda: billed(x)),
        "nn.Linear call": per_call_us(lambda: linear(y), 2000),
    }
    handle = linear.register_forward_hook(lambda m, a, o: None)
    out["with a forward hook, more"] = per_call_us(lambda: linear(y), 2000) - out["nn.Linear call"]
    handle.remove()
    return out


class _NoGroup:
    def __init__(self) -> None:
        self.metrics = MetricSet()


def launches() -> dict[str, float]:
    cfg = preset("large")
    b, h, length = cfg.batch_size, cfg.n_heads, cfg.seq_len
    d, n_layers = cfg.d_model // cfg.n_heads, cfg.n_layers
    q = torch.randn(n_layers, b, h, length, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    offsets = torch.arange(n_layers, device="cuda").repeat(2) * q[0].numel()

    def qk() -> None:
        kernels.qk_stats_partials_grouped(q[0], k[0], offsets, n_layers, d**-0.5, True, None)

    big = torch.randn(8192, 8192, device="cuda")
    for _ in range(5):
        qk()
    torch.cuda.synchronize()
    out = {
        "grouped QK launch after a synchronize": median_us(qk, torch.cuda.synchronize),
        "back to back": median_us(qk, lambda: None),
        "behind a running matmul": median_us(qk, lambda: big @ big),
    }
    torch.cuda.synchronize()
    out.update(trivial_launches())
    return out


def trivial_launches() -> dict[str, float]:
    import triton
    import triton.language as tl

    @triton.jit
    def copy(p, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(p + i, tl.load(p + i, mask=i < n), mask=i < n)

    x = torch.zeros(1024, device="cuda")
    compiled = copy[(1,)](x, 10, BLOCK=128)
    torch.cuda.synchronize()
    jit = per_call_us(lambda: copy[(1,)](x, 10, BLOCK=128), 500)
    runner = per_call_us(lambda: compiled[(1, 1, 1)](x, 10, 128), 500)
    torch.cuda.synchronize()
    return {"trivial kernel via JITFunction.run": jit, "via the compiled runner": runner}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_primitives needs a CUDA device (the launches are the point)")
    x = torch.randn(8, 1024, 1024, device="cuda", requires_grad=True) * 1
    measured = {**calls(x), **launches()}
    line = "host us per call: " + "; ".join(f"{k} {v:.2f}" for k, v in measured.items())
    print(line)
    if not args.no_record:
        append_result("host_primitives", line)


if __name__ == "__main__":
    main()
