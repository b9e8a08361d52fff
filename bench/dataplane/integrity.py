"""Cost of per-row wire digests on one RL batch: order-aware digests vs XOR fold vs crc32.

One batch = 1536 rows x 4 fp32 fields of [1536, 4360] (26.8 MB each, 107 MB in all), the
shape of a put in the data plane. Times the three digest schemes of
``syncless.dataplane.integrity`` in the same run (interleaved, median of repeats) and the
order-aware digests of the same fields as jagged nested tensors: rows of one length (what
a get returns for a dense put) and rows of varied lengths (uniform in [L/2, 3L/2), about
the same bytes; the general jagged path).

    python -m bench.dataplane integrity [--repeats 7] [--no-record]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from bench.harness import append_result, by_name, interleave
from syncless.dataplane.integrity import (
    crc32_digests,
    row_digests,
    xor_fold_digests,
)

ROWS, COLS, FIELDS = 1536, 4360, 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_batch(fn: Callable[[torch.Tensor], torch.Tensor], fields: list[torch.Tensor]) -> float:
    """Seconds to digest every field of the batch (synchronised at the end)."""
    device = fields[0].device
    _sync(device)
    t0 = time.perf_counter()
    for f in fields:
        fn(f)
    _sync(device)
    return time.perf_counter() - t0


def varied_rows(field: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``field``'s values cut into rows of lengths uniform in [L/2, 3L/2), as a jagged
    nested tensor built from a list (cached lengths, like a transfer client's get)."""
    rows, cols = field.shape
    lengths = torch.randint(cols // 2, cols + cols // 2, (rows,), generator=gen)
    flat = field.reshape(-1).repeat(2)[: int(lengths.sum())]
    pieces = torch.split(flat, lengths.tolist())
    return torch.nested.as_nested_tensor(list(pieces), layout=torch.jagged)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    dense = [torch.randn(ROWS, COLS, generator=gen).to(device) for _ in range(FIELDS)]
    jag = [torch.nested.nested_tensor(list(f), layout=torch.jagged) for f in dense]
    varied = [varied_rows(f, gen) for f in dense]
    batch_mb = sum(f.nbytes for f in dense) / 1e6

    schemes: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]] = {
        "row_digests (dense)": (row_digests, dense),
        "row_digests (jagged)": (row_digests, jag),
        "row_digests (jagged, varied)": (row_digests, varied),
        "xor_fold (hash_tensor)": (xor_fold_digests, dense),
        "crc32 (host, zlib)": (crc32_digests, dense),
    }
    for fn, fields in schemes.values():  # warm-up: allocator, first-touch pages
        time_batch(fn, fields)
    # interleaved so drift hits every scheme alike
    runs = {name: partial(time_batch, fn, fields) for name, (fn, fields) in schemes.items()}
    times = by_name(interleave(runs, args.repeats, rotate=False))

    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    xor_ms = med["xor_fold (hash_tensor)"]
    print(f"batch: {ROWS} rows x {FIELDS} fields fp32 [{ROWS}, {COLS}] = {batch_mb:.1f} MB")
    print(f"{'scheme':<30}{'ms/batch':>10}{'GB/s':>8}{'x xor':>8}")
    for name, ms in med.items():
        print(f"{name:<30}{ms:>10.1f}{batch_mb / ms:>8.2f}{ms / xor_ms:>8.1f}")

    line = (
        f"{batch_mb:.0f} MB batch ({ROWS} rows x {FIELDS} fp32 fields [{ROWS}, {COLS}]), "
        f"median of {args.repeats} interleaved: "
        + "; ".join(f"{name} {ms:.1f} ms" for name, ms in med.items())
    )
    if not args.no_record:
        print(append_result("dataplane_integrity", line))
