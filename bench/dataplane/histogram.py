"""Per-call cost of the dataplane's host-side accounting (pure Python, CPU).

Measures, per call: ``LogHistogram.record`` (one latency), ``record_many`` per element
(a 10k batch), ``quantiles`` of p50/p90/p99 (a flush-time read), ``tensor_nbytes`` on a
dense view and on a jagged nested tensor, and ``msgpack_size`` of a small metadata dict
next to ``len(msgpack.packb(...))`` of the same dict. Baseline: ``list.append`` of the
value (the cheapest possible "keep the sample" a wrapper could do instead).

Usage: ``python -m bench.dataplane histogram [--no-record]``
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

import msgpack
import numpy as np
import torch

from bench.harness import append_result
from syncless.dataplane.bytes import msgpack_size, tensor_nbytes
from syncless.dataplane.histogram import LogHistogram


def per_call_us(fn: Callable[[], object], number: int) -> float:
    """Best of 5 repeats, in microseconds per call."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)

    h = LogHistogram()
    record = h.record
    sink: list[float] = []
    append = sink.append
    batch = np.random.default_rng(0).lognormal(0.0, 1.0, 10_000)
    h.record_many(batch)
    dense = torch.randn(64, 128).t()
    nt = torch.nested.nested_tensor(
        [torch.randn(n, 16) for n in (3, 17, 9, 30)], layout=torch.jagged
    )
    meta = {"key": "sample-000123", "partition": "train", "fields": ["input_ids", "mask"], "n": 7}

    rows = [
        ("list.append (baseline)", per_call_us(lambda: append(3.3), 200_000)),
        ("LogHistogram.record", per_call_us(lambda: record(3.3), 200_000)),
        ("record_many per element", per_call_us(lambda: h.record_many(batch), 20) / batch.size),
        ("quantiles p50/p90/p99", per_call_us(lambda: h.quantiles((0.5, 0.9, 0.99)), 2_000)),
        ("tensor_nbytes dense view", per_call_us(lambda: tensor_nbytes(dense), 100_000)),
        ("tensor_nbytes jagged", per_call_us(lambda: tensor_nbytes(nt), 100_000)),
        ("msgpack_size small dict", per_call_us(lambda: msgpack_size(meta), 50_000)),
        ("len(msgpack.packb) same dict", per_call_us(lambda: len(msgpack.packb(meta)), 50_000)),
    ]
    print(f"{'operation':<32}{'us/call':>10}")
    for name, us in rows:
        print(f"{name:<32}{us:>10.3f}")
    if args.no_record:
        return
    append_result(
        "dataplane_histogram",
        "host accounting cost, us/call (best of 5): "
        + "; ".join(f"{name} {us:.3f}" for name, us in rows),
    )
