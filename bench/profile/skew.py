"""How much of an injected rank delay lands in the rendezvous row (issue 5 benchmark).

Two ranks run `steps` steps of: a section "work" (rank 1 sleeps `delay_ms` more in it),
then a `size_mb` all_reduce through `Profiler.collective`. On rank 0, the injected delay
should appear as rendezvous wait, not as transfer. NCCL on CUDA, gloo on CPU.

    python -m bench.profile skew --nproc 2 --delay-ms 5 --size-mb 128 --mode events
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from bench.harness import append_result, relaunch


def worker(args: argparse.Namespace) -> None:
    from syncless.profile import Profiler

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    x = torch.ones(int(args.size_mb * 2**20) // 4, device=device)
    prof = Profiler(mode=args.mode, report_every=args.steps)
    for step in range(args.warmup + args.steps):
        with prof.step(step):
            with prof.section("work"):
                if rank == 1:
                    time.sleep(args.delay_ms / 1e3)
            prof.all_reduce(x, name="big_allreduce")
        if step == args.warmup - 1:
            prof = Profiler(mode=args.mode, report_every=args.steps)  # drop warm-up steps
    report = prof.report(args.warmup + args.steps - 1, force=True, print_table=rank == 0)
    if rank == 0 and report is not None:
        v = report.values
        rdv = v["profile/big_allreduce/rendezvous_ms"]
        transfer = v["profile/big_allreduce/transfer_ms"]
        share = rdv / args.delay_ms * 100
        line = (
            f"profiler skew split, {dist.get_world_size()} ranks, {args.size_mb} MiB all_reduce, "
            f"mode {args.mode}, rank 1 delayed {args.delay_ms} ms: rank 0 rendezvous "
            f"{rdv:.3f} ms/step ({share:.0f}% of the delay), transfer {transfer:.3f} ms/step "
            f"({args.steps} steps)"
        )
        print(line)
        if not args.no_record:
            append_result("profile_skew", line)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--size-mb", type=float, default=128.0)
    parser.add_argument("--mode", default="events")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    sys.exit(relaunch(__name__, args.nproc, argv))
