"""Split-list modes of the expert-parallel dispatch, interleaved in one run (issue 8).

Two ranks train the demo model with expert parallelism and the fixed router (every
mode routes the same tokens to the same experts, so they do the same work), NCCL on
GPUs, gloo on CPU. One model and optimizer are shared; each mode is a dispatcher
swapped into every MoE layer. Configurations: drain (the baseline), static (no
pacing), static-paced at each depth of the sweep, lookahead.

The loop is the demo's step (forward, backward, gradient sync and clipping, AdamW at
lr 0 so every step is the same work) with no read-back inside a block, so the host may
run ahead across steps as a trainer that logs every N steps does. Per block: switch
the dispatcher, synchronize, `--warmup` steps, then `--block` timed steps ended by
one loss read. Per configuration, over `--rounds` rounds (the order rotates each
round):

* step time: block wall time / steps, the slower rank's, median over rounds;
* host blocked: time the host spent waiting, per step: drains, run-ahead and
  lookahead waits (the dispatcher's own counters) plus the block's final read, which
  is where a host that ran ahead waits for the device;
* peak memory: torch.cuda.max_memory_allocated over the block (warm-up included),
  the larger rank, the maximum over rounds.

It names the configurations that beat drain with peak memory within 5% of it, and the
depth that does best among them (the `--run-ahead` default it backs).

    python -m bench.demo pacing_ep --nproc 2                     # demo large on 2 GPUs
    python -m bench.demo pacing_ep --nproc 2 --preset tiny --rounds 2 --block 3 --no-record
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.harness import append_result, by_name, interleave, relaunch
from syncless.demo.config import DemoConfig, preset
from syncless.demo.dispatch import AllToAllDispatcher
from syncless.demo.model import MoETransformer, init_weights
from syncless.demo.parallel import clip_grad_norm, sync_gradients
from syncless.pacing import RunAheadLimiter, StaticPlanCache

MEMORY_BUDGET = 1.05  # the goal: peak memory within 5% of the drain baseline


@dataclass
class Block:
    step_ms: float
    blocked_ms: float  # per step
    peak_bytes: float
    waits: float  # run-ahead or lookahead waits per step


class Workload:
    """The demo's EP training step on fixed device batches, dispatcher swappable."""

    def __init__(self, cfg: DemoConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.model = MoETransformer(cfg, AllToAllDispatcher()).to(device)
        init_weights(self.model, cfg.seed)
        fused = {"fused": True} if device.type == "cuda" else {}
        # lr 0: AdamW does all its work but the weights never change.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.0, **fused)
        g = torch.Generator().manual_seed(cfg.seed + dist.get_rank())
        batch = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len + 1), generator=g)
        self.batch = batch.to(device)
        self.bf16 = device.type == "cuda"

    def use(self, dispatcher: AllToAllDispatcher) -> None:
        for block in self.model.layers:
            block.moe.dispatcher = dispatcher

    def step(self) -> torch.Tensor:
        cfg = self.cfg
        inputs, targets = self.batch[:, :-1], self.batch[:, 1:]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits, balance = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        (loss + cfg.aux_loss_coef * balance).backward()
        sync_gradients(self.model, True)
        clip_grad_norm(self.model, cfg.grad_clip, True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def configurations(
    depths: list[int], validate_every: int, device: torch.device
) -> dict[str, Callable[[], AllToAllDispatcher]]:
    def static(depth: int | None) -> Callable[[], AllToAllDispatcher]:
        def make() -> AllToAllDispatcher:
            limiter = None if depth is None else RunAheadLimiter(depth, device=device)
            cache = StaticPlanCache(enabled=True, validate_every=validate_every)
            return AllToAllDispatcher(plan_cache=cache, limiter=limiter)

        return make

    configs: dict[str, Callable[[], AllToAllDispatcher]] = {
        "drain": AllToAllDispatcher,
        "static": static(None),
    }
    for depth in depths:
        configs[f"static-paced/{depth}"] = static(depth)
    configs["lookahead"] = lambda: AllToAllDispatcher(lookahead=True)
    return configs


def run_block(work: Workload, dispatcher: AllToAllDispatcher, warmup: int, steps: int) -> Block:
    cuda = work.device.type == "cuda"
    work.use(dispatcher)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        loss = work.step()
        dispatcher.end_step()
    if warmup:
        loss.item()  # idle device, idle host: the timed part starts clean
    dispatcher.report()  # zero the dispatcher's counters
    start = time.perf_counter()
    for _ in range(steps):
        loss = work.step()
        dispatcher.end_step()
    enqueued = time.perf_counter()
    loss.item()  # the block's one read: a host that ran ahead waits here
    end = time.perf_counter()
    counters = dispatcher.report()
    waits = counters.get("pacing/step/run_ahead_waits_count", 0.0)
    waits += counters.get("pacing/step/lookahead_waits_count", 0.0)
    blocked_ms = counters["pacing/step/blocked_ms"] + (end - enqueued) * 1e3
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return Block((end - start) / steps * 1e3, blocked_ms / steps, peak, waits / steps)


def worker(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    cfg = preset(args.preset, expert_parallel=True, fix_router=True)
    cfg.validate(world)
    work = Workload(cfg, device)
    depths = [int(d) for d in args.depths.split(",") if d]
    configs = configurations(depths, args.validate_every, device)
    if args.modes:
        wanted = args.modes.split(",")
        unknown = sorted(set(wanted) - set(configs))
        if unknown:
            raise SystemExit(f"unknown --modes {unknown}; known: {', '.join(configs)}")
        configs = {name: make for name, make in configs.items() if name in wanted}
    dispatchers = {name: make() for name, make in configs.items()}
    names = list(dispatchers)

    for name in names:  # first use: plans computed, kernels and allocator warm
        run_block(work, dispatchers[name], 0, 2)

    def block(name: str) -> Block:
        try:
            return run_block(work, dispatchers[name], args.warmup, args.block)
        except torch.cuda.OutOfMemoryError:
            print(f"rank {rank}: {name} ran out of memory (the failure issue 8 describes); "
                  f"rerun with --modes leaving it out", file=sys.stderr)  # fmt: skip
            raise

    rounds = interleave({name: partial(block, name) for name in names}, args.rounds)
    blocks: dict[str, list[Block]] = {name: [] for name in names} | by_name(rounds)

    mine = torch.tensor(
        [[astuple(b) for b in blocks[name]] for name in names], dtype=torch.float64, device=device
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        per_rank = [
            {name: [Block(*row) for row in t[i].tolist()] for i, name in enumerate(names)}
            for t in gathered
        ]
        report(args, cfg, device, names, per_rank)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter finalization: a gloo worker thread may still be releasing the
    # tensors of the last collectives (a finished barrier holds on to the work before
    # it), and a thread that needs the GIL during finalization aborts the process
    # ("terminate called without an active exception", about 1 run in 20 on CPU).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report(
    args: argparse.Namespace,
    cfg: DemoConfig,
    device: torch.device,
    names: list[str],
    ranks: list[dict[str, list[Block]]],
) -> None:
    rows = {}
    for name in names:
        per_round = list(zip(*(r[name] for r in ranks), strict=True))  # [round][rank]
        rows[name] = (
            statistics.median(max(b.step_ms for b in blocks) for blocks in per_round),
            statistics.median(max(b.blocked_ms for b in blocks) for blocks in per_round),
            max(b.peak_bytes for blocks in per_round for b in blocks),
            statistics.median(max(b.waits for b in blocks) for blocks in per_round),
        )
    base_ms, _, base_peak, _ = rows.get("drain", next(iter(rows.values())))
    print(
        f"\npacing_ep: demo {args.preset}, {len(ranks)} ranks, EP, fixed router, {device.type}; "
        f"{args.rounds} rounds x ({args.warmup} + {args.block} steps) per configuration"
    )
    print(f"{'configuration':<18}{'step ms':>10}{'vs drain':>10}{'blocked ms':>12}"
          f"{'peak GiB':>10}{'vs drain':>10}{'waits/step':>12}")  # fmt: skip
    good = []
    for name, (ms, blocked, peak, waits) in rows.items():
        d_ms = (ms / base_ms - 1) * 100
        d_peak = (peak / base_peak - 1) * 100 if base_peak else 0.0
        print(f"{name:<18}{ms:>10.2f}{d_ms:>+9.1f}%{blocked:>12.2f}{peak / 2**30:>10.2f}"
              f"{d_peak:>+9.1f}%{waits:>12.2f}")  # fmt: skip
        if (
            name != "drain"
            and ms < base_ms
            and (not base_peak or peak <= MEMORY_BUDGET * base_peak)
        ):
            good.append((ms, name))
    paced = [(ms, n) for ms, n in good if n.startswith("static-paced/")]
    verdict = (
        f"faster than drain with peak within 5%: {', '.join(n for _, n in sorted(good))}"
        if good
        else "no configuration is faster than drain with peak within 5%"
    )
    if paced:
        verdict += f"; fastest such depth {min(paced)[1].split('/')[1]}"
    print(verdict)
    if args.no_record:
        return
    table = "; ".join(
        f"{n} {ms:.1f} ms ({(ms / base_ms - 1) * 100:+.1f}%), blocked {b:.1f} ms, "
        f"peak {p / 2**30:.2f} GiB"
        for n, (ms, b, p, _) in rows.items()
    )
    append_result(
        "pacing_ep",
        f"demo {args.preset} EP {len(ranks)} fixed router, {args.rounds} rounds x "
        f"({args.warmup}+{args.block}) steps, validate_every {args.validate_every}: {table}; "
        f"{verdict}",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--preset", default="large")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=6, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per block")
    parser.add_argument("--depths", default="0,1,2,4,8", help="static-paced run-ahead sweep")
    parser.add_argument("--modes", default="", help="comma list of configurations (default all)")
    parser.add_argument("--validate-every", type=int, default=0, help="static plan validation")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    sys.exit(relaunch(__name__, args.nproc, argv))
