"""The demo training loop: AdamW on stdlib bytes, single process or torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console

from syncless.demo.config import DemoConfig
from syncless.demo.data import BatchSampler, stdlib_corpus
from syncless.demo.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher
from syncless.demo.model import MoETransformer, init_weights
from syncless.demo.parallel import clip_grad_norm, init_distributed, sync_gradients
from syncless.demo.progress import progress_view
from syncless.demo.signals import Stopped, pending_stop
from syncless.demo.tools import DemoContext, DemoTool
from syncless.profile import OFF
from syncless.run import RankInfo, Run, Sink


@dataclass
class DemoResult:
    run_dir: Path
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, global loss)
    first_step: int = 0  # where a resumed run went on


def pick_device(cfg: DemoConfig, ranks: RankInfo) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from syncless.errors import UsageError

            raise UsageError("--device cuda was asked for but torch sees no CUDA device")
        torch.cuda.set_device(ranks.local_rank)
        return torch.device("cuda", ranks.local_rank)
    return torch.device("cpu")


def _autocast(cfg: DemoConfig, device: torch.device) -> contextlib.AbstractContextManager:
    bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    if bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _lr_lambda(cfg: DemoConfig):
    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return lr_at


def _optimizer(model: MoETransformer, cfg: DemoConfig, device: torch.device):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # fused (CUDA and CPU): one kernel per group, and no per-parameter `.item()` of the
    # step counter, which the foreach path does on every step.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)


def run_demo(
    cfg: DemoConfig,
    *,
    run_dir: str | Path | None = None,
    name: str = "demo",
    quiet: bool = False,
    tools: Sequence[DemoTool] = (),
    console: Console | None = None,
    resume: bool = False,
    sinks: Sequence[str] = (),
) -> DemoResult:
    """Train the demo model for ``cfg.steps`` steps, logging every number to a run.

    ``resume``: add a segment to the run in ``run_dir`` (see :class:`syncless.run.Run`).
    The demo keeps no checkpoint: a resumed run trains a fresh model, its steps
    numbered on from the last one stored, so no step is stored twice.
    ``sinks``: ``"tensorboard"``, ``"wandb"``: rank 0 also writes its records there.
    """
    device_type = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
    owns_group = not dist.is_initialized()  # a caller's process group is the caller's to end
    ranks = init_distributed(device_type)
    try:
        cfg.validate(ranks.world_size)
        return _train(cfg, ranks, run_dir, name, quiet, tools, console, resume, sinks)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def view_sinks(names: Sequence[str], run_dir: Path) -> list[Sink]:
    """The demo's ``--sink`` views, written under the run directory."""
    out: list[Sink] = []
    if "tensorboard" in names:
        from syncless.run.sink_tensorboard import TensorBoardSink

        out.append(TensorBoardSink(run_dir / "tensorboard"))
    if "wandb" in names:
        from syncless.run.sink_wandb import WandbSink

        (run_dir / "wandb").mkdir(exist_ok=True)
        out.append(WandbSink(project="syncless-demo", name=run_dir.name, dir=run_dir / "wandb"))
    return out


def _train(
    cfg: DemoConfig,
    ranks: RankInfo,
    run_dir: str | Path | None,
    name: str,
    quiet: bool,
    tools: Sequence[DemoTool],
    console: Console | None,
    resume: bool,
    sinks: Sequence[str] = (),
) -> DemoResult:
    device = pick_device(cfg, ranks)
    world = ranks.world_size
    # The run first: a directory that is not free stops the demo before it builds anything.
    config = {**dataclasses.asdict(cfg), "world_size": world, "device": str(device)}
    run = Run(
        name=name,
        config=config,
        run_dir=run_dir,
        flush_interval_s=cfg.flush_interval_s,
        resume=resume,
    )
    if ranks.is_main:
        # Per-run views: rank 0's records, the demo's step numbers being global already.
        run.sinks += view_sinks(sinks, run.dir)
    try:
        return _train_in(cfg, ranks, device, run, quiet, tools, console)
    except Stopped as stop:
        stop.run_dir = run.dir  # for the stop message
        raise
    finally:
        for tool in tools:
            tool.close()
        run.close()


def _train_in(
    cfg: DemoConfig,
    ranks: RankInfo,
    device: torch.device,
    run: Run,
    quiet: bool,
    tools: Sequence[DemoTool],
    console: Console | None,
) -> DemoResult:
    world = ranks.world_size
    expert_parallel = cfg.expert_parallel and world > 1
    dispatcher: Dispatcher = (
        AllToAllDispatcher.for_mode(cfg.ep_splits, run_ahead=cfg.run_ahead, device=device)
        if expert_parallel
        else LocalDispatcher()
    )
    model = MoETransformer(cfg, dispatcher).to(device)
    init_weights(model, cfg.seed)
    optimizer = _optimizer(model, cfg, device)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    corpus = stdlib_corpus(int(cfg.corpus_mb * 2**20))
    sampler = BatchSampler(corpus, cfg.seq_len, cfg.batch_size, ranks.rank, world, cfg.seed)

    console = console or Console(stderr=True, quiet=quiet or not ranks.is_main)
    first = run.next_step  # 0, or on from a resumed run's last stored step
    if ranks.is_main and not quiet:
        title = f"syncless demo ({device.type}, {world} rank(s))"
        run.sinks.append(progress_view(cfg.steps, title, console, first_step=first))
    demo_ctx = DemoContext(
        cfg, model, optimizer, run, console, expert_parallel, OFF, sampler.batch_at
    )
    for tool in tools:
        tool.attach(demo_ctx)

    result = DemoResult(run.dir, first_step=first)
    tokens_per_step = cfg.batch_size * cfg.seq_len * world
    last_time, last_step = time.perf_counter(), first - 1
    final = first + cfg.steps - 1
    for step in range(first, final + 1):
        for tool in tools:
            tool.step_begin(step)
        prof = demo_ctx.profiler  # per step: a benchmark may switch profilers between steps
        with prof.section("data"):
            batch = demo_ctx.batches(step)
            inputs, targets = (t.to(device, non_blocking=True) for t in batch)
        with prof.section("forward"), _autocast(cfg, device):
            logits, balance = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        with prof.section("backward"):
            (loss + cfg.aux_loss_coef * balance).backward()
        with prof.section("grad_sync", category="collective"):
            sync_gradients(model, expert_parallel)
            grad_norm = clip_grad_norm(model, cfg.grad_clip, expert_parallel)
        with prof.section("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        lr = schedule.get_last_lr()[0]
        schedule.step()
        demo_ctx.checked = {"loss": loss.detach(), "grad_norm": grad_norm}
        for tool in tools:
            enqueued = getattr(tool, "step_enqueued", None)  # optional (tools.py)
            if enqueued is not None:
                enqueued(step)

        if step % cfg.log_every == 0 or step == final:
            prof.begin_section("log", category="sync")
            # grad_norm is already global (equal on every rank), so the mean keeps it.
            # The last element: a stop signal deferred on this rank (signals.stop_on);
            # above 0 after the all_reduce, every rank stops after this step.
            stop = torch.full_like(grad_norm, pending_stop())
            stats = torch.stack([loss.detach().float(), balance.detach().float(), grad_norm, stop])
            if world > 1:
                dist.all_reduce(stats)
                stats /= world
            # The demo's one read-back per logged step.
            loss_v, balance_v, grad_norm_v, stop_v = stats.tolist()
            now = time.perf_counter()
            # Mean over the steps since the last log: a host timer per step would
            # measure enqueue time, not device time, wherever the host runs ahead.
            per_step_s = (now - last_time) / (step - last_step)
            last_time, last_step = now, step
            result.losses.append((step, loss_v))
            run.log(
                step,
                {
                    "demo/step/loss": loss_v,
                    "demo/step/balance_loss": balance_v,
                    "demo/step/grad_norm": grad_norm_v,
                    "demo/step/lr": lr,
                    "demo/step/step_ms": per_step_s * 1e3,
                    "demo/step/tokens_per_s": tokens_per_step / per_step_s,
                    **dispatcher.report(),  # pacing/* under --expert-parallel
                },
            )
            prof.end_section("log")
            if stop_v > 0:  # the same step on every rank: their closes match up
                raise Stopped(pending_stop() or signal.SIGTERM)
        dispatcher.end_step()
        for tool in tools:
            tool.step_end(step)
    return result
