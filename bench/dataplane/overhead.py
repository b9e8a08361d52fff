"""MetricsClient overhead per put and per get against a no-op inner client.

256 keys / ~18 MB per batch (one float32 field of 256 x 17408), dense and jagged (rows
of varying length, same total). The inner client does nothing (put) or returns the
prepared fields (get), so the difference between a wrapped call and a direct call is
the wrapper's own cost: timing, byte accounting, histogram record. Guard off (its cost
is bench/dataplane/integrity.py). Median of interleaved repeats.

    python -m bench.dataplane overhead
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.harness import append_result
from syncless.dataplane.backends.null import NullStore
from syncless.dataplane.histogram import LogHistogram
from syncless.dataplane.metrics_client import MetricsClient

KEYS = [f"key-{i:04d}" for i in range(256)]


def per_call_us(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def overhead(fields, reps: int, rounds: int) -> tuple[float, float]:
    inner = NullStore(fields)
    client = MetricsClient(inner)
    put_d, get_d = [], []
    for _ in range(rounds):  # interleave wrapped and direct calls against drift
        raw_put = per_call_us(lambda: inner.put("p", KEYS, fields), reps)
        wrapped_put = per_call_us(lambda: client.put("p", KEYS, fields), reps)
        raw_get = per_call_us(lambda: inner.get("p", KEYS), reps)
        wrapped_get = per_call_us(lambda: client.get("p", KEYS), reps)
        put_d.append(statistics.median(wrapped_put) - statistics.median(raw_put))
        get_d.append(statistics.median(wrapped_get) - statistics.median(raw_get))
        client.step()
    return statistics.median(put_d), statistics.median(get_d)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)

    dense = {"obs": torch.randn(256, 17408)}
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8704, 26112, (256,), generator=g)
    jagged = {"obs": torch.nested.nested_tensor([torch.randn(int(n)) for n in lengths],
                                                layout=torch.jagged)}  # fmt: skip
    d_put, d_get = overhead(dense, args.reps, args.rounds)
    j_put, j_get = overhead(jagged, args.reps, args.rounds)

    hist = LogHistogram()
    values = [0.1 + (i % 1000) * 0.37 for i in range(200_000)]
    t0 = time.perf_counter_ns()
    for v in values:
        hist.record(v)
    record_ns = (time.perf_counter_ns() - t0) / len(values)

    mb = dense["obs"].nbytes / 2**20
    line = (
        f"MetricsClient overhead vs no-op inner, 256 keys / {mb:.1f} MB: dense put "
        f"{d_put:.2f} us, get {d_get:.2f} us; jagged put {j_put:.2f} us, get {j_get:.2f} us "
        f"(median of {args.rounds} rounds x {args.reps} calls); LogHistogram.record "
        f"{record_ns:.0f} ns/value"
    )
    print(line)
    if not args.no_record:
        append_result("dataplane_overhead", line)
