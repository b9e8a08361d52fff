"""The demo training loop: AdamW on stdlib bytes, single process or torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console

from syncless.demo.config import DemoConfig, straggler
from syncless.demo.data import BatchSampler, stdlib_corpus
from syncless.demo.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher
from syncless.demo.experts import Experts, resolve_impl
from syncless.demo.flops import Peak, flops_per_token, peak_for
from syncless.demo.model import ExpertBalancer, MoETransformer, init_weights
from syncless.demo.parallel import (
    clip_grad_norm,
    init_distributed,
    ranks_per_gpu,
    sync_gradients,
)
from syncless.demo.progress import progress_view
from syncless.demo.signals import Stopped, pending_stop
from syncless.demo.steplog import StepLog, Throughput
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
        index = ranks.local_rank % torch.cuda.device_count()  # shared: parallel.ranks_per_gpu
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _bf16(cfg: DemoConfig, device: torch.device) -> bool:
    return cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")


def _autocast(cfg: DemoConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if _bf16(cfg, device):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def peak_of(cfg: DemoConfig, device: torch.device) -> Peak:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return peak_for(device.type, name, _bf16(cfg, device))


def gpus_used(device: torch.device, world: int) -> int:
    """The GPUs ``world`` ranks run on (fewer than the ranks when they share GPUs), 0 on
    a CPU. MFU is per GPU."""
    return -(-world // ranks_per_gpu()) if device.type == "cuda" else 0


def run_facts(cfg: DemoConfig, device: torch.device, world: int) -> dict:
    """What run.json records beside the config: what ran, and what MFU is taken against."""
    peak = peak_of(cfg, device)
    dtype = torch.bfloat16 if _bf16(cfg, device) else torch.float32
    return {
        "world_size": world,
        "device": str(device),
        "gpus": gpus_used(device, world),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "expert_impl_used": resolve_impl(
            cfg.expert_impl, device, dtype, (cfg.d_model, cfg.expert_hidden)
        ),
        "ep_mode": cfg.ep_mode() if cfg.expert_parallel and world > 1 else None,
        "flops_per_token": flops_per_token(cfg),
        "peak_flops": peak.flops,
        "peak_flops_about": peak.about,
    }


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
    config = {**dataclasses.asdict(cfg), **run_facts(cfg, device, world)}
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
    if cfg.straggle and not any(getattr(t, "name", "") == "profile" for t in tools):
        from syncless.demo.profile_tool import ProfileTool

        tools = [*tools, ProfileTool("events")]  # the profiler names the straggler
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
        AllToAllDispatcher.for_mode(cfg.ep_mode(), run_ahead=cfg.run_ahead, device=device)
        if expert_parallel
        else LocalDispatcher()
    )
    with torch.device(device):  # built in place: no CPU init and copy of every weight
        model = MoETransformer(cfg, dispatcher)
    init_weights(model, cfg.seed)
    balancer = ExpertBalancer(model, cfg.bias_update_speed)  # no router biased: a no-op
    aux_loss_coef = 0.0 if cfg.balance == "none" else cfg.aux_loss_coef
    optimizer = _optimizer(model, cfg, device)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    corpus = stdlib_corpus(int(cfg.corpus_mb * 2**20))
    sampler = BatchSampler(corpus, cfg.seq_len, cfg.batch_size, ranks.rank, world, cfg.seed)

    console = console or Console(stderr=True, quiet=quiet or not ranks.is_main)
    first = run.next_step  # 0, or on from a resumed run's last stored step
    peak = peak_of(cfg, device)
    if ranks.is_main and not quiet:
        # MFU is shown against this peak, per GPU
        per_gpu = f", peak {peak.flops / 1e12:,.0f} TFLOP/s bf16" if peak.flops else ""
        title = f"syncless demo ({device.type}, {world} rank(s){per_gpu})"
        run.sinks.append(progress_view(cfg.steps, title, console, first_step=first))
    demo_ctx = DemoContext(
        cfg, model, optimizer, run, console, expert_parallel, OFF, sampler.batch_at
    )
    for tool in tools:
        tool.attach(demo_ctx)

    result = DemoResult(run.dir, first_step=first)
    throughput = Throughput(
        cfg.batch_size * cfg.seq_len * world, flops_per_token(cfg), peak, gpus_used(device, world)
    )
    dtype = torch.bfloat16 if _bf16(cfg, device) else torch.float32
    dropping = [
        m for m in model.modules()
        if isinstance(m, Experts) and m.capacity_factor > 0 and m.resolved(device, dtype) == "padded"
    ]  # fmt: skip
    rows_per_step = cfg.batch_size * cfg.seq_len * cfg.top_k * cfg.n_layers
    delays = _delays(cfg, ranks.rank)  # --straggle: {section: seconds} on its rank
    log = StepLog(run, throughput, device, first, dropping, rows_per_step)
    to_device = PinnedCopies(device) if device.type == "cuda" else _on(device)
    final = first + cfg.steps - 1
    # Built, attached: what lives now lives for the run. Frozen, the collector's full
    # passes skip it (a gen-2 collection over a built model is ~130 ms on 2 cores,
    # bench/RESULTS.md, gc_pause): no step pays for one.
    gc.collect()
    gc.freeze()
    try:
        for step in range(first, final + 1):
            for tool in tools:
                tool.step_begin(step)
            prof = demo_ctx.profiler  # per step: a benchmark may switch profilers between steps
            with prof.section("data"):
                inputs, targets = to_device(demo_ctx.batches(step))
                if delays:
                    _straggle(delays, "data")
            with prof.section("forward"), _autocast(cfg, device):
                logits, balance = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                if delays:
                    _straggle(delays, "forward")
            with prof.section("backward"):
                (loss + aux_loss_coef * balance if aux_loss_coef else loss).backward()
                if delays:
                    _straggle(delays, "backward")
            with prof.section("grad_sync", category="collective"):
                if delays:
                    _straggle(delays, "grad_sync")  # before the collective: the others wait
                # The routers' expert loads ride in the gradient all_reduce.
                sync_gradients(model, expert_parallel, also=balancer.loads)
                grad_norm = clip_grad_norm(model, cfg.grad_clip, expert_parallel)
            with prof.section("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                balancer.step()
                if delays:
                    _straggle(delays, "optimizer")
            lr = schedule.get_last_lr()[0]
            schedule.step()
            demo_ctx.checked = {"loss": loss.detach(), "grad_norm": grad_norm}
            for tool in tools:
                enqueued = getattr(tool, "step_enqueued", None)  # optional (tools.py)
                if enqueued is not None:
                    enqueued(step)

            logged = step % cfg.log_every == 0 or step == final
            stop = False
            if logged or log.pending is not None:
                prof.begin_section("log", category="sync")
                # The previous logged step's statistics, read now that this step is queued
                # behind it (syncless.demo.steplog). A stop signal deferred on any rank
                # (signals.stop_on) rides in them: every rank stops after the same step.
                stop = _read(log, result)
                if logged and not stop:
                    # pacing/* under --expert-parallel
                    host = {"demo/step/lr": lr, **dispatcher.report()}
                    log.issue(step, loss, balance, grad_norm, pending_stop(), host)
                prof.end_section("log")
            if stop:  # the same step on every rank: their closes match up
                raise Stopped(pending_stop() or signal.SIGTERM)
            dispatcher.end_step()
            for tool in tools:
                tool.step_end(step)
        if _read(log, result):  # the last step's, at the end
            raise Stopped(pending_stop() or signal.SIGTERM)
    finally:
        gc.unfreeze()
    return result


def _delays(cfg: DemoConfig, rank: int) -> dict[str, float]:
    """``--straggle``'s delay on this rank: {section: seconds}, or {}."""
    if not cfg.straggle:
        return {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    slow_rank, section, seconds = straggler(cfg.straggle, world)
    return {section: seconds} if rank == slow_rank else {}


def _straggle(delays: dict[str, float], section: str) -> None:
    """Sleep ``--straggle``'s delay if it is for ``section`` (a host sleep)."""
    seconds = delays.get(section)
    if seconds:
        time.sleep(seconds)


def _read(log: StepLog, result: DemoResult) -> bool:
    """Log the pending step, if any; whether a stop was asked."""
    done = log.finish()
    if done is None:
        return False
    step, loss, stop = done
    result.losses.append((step, loss))
    return stop


class PinnedCopies:
    """Host batches to a CUDA device through pinned buffers made once.

    A pageable copy waits for the device's queued work, and pinning a fresh tensor
    every step (``pin_memory()``) is an allocation the sync census counts twice a step.
    Two sets of buffers take turns; one is refilled only after the copy that last read
    it has finished: its event is two steps old, so the host waits only when it leads
    the device by two steps.
    """

    def __init__(self, device: torch.device, slots: int = 2) -> None:
        self.device = device
        self._buffers: list[list[torch.Tensor]] = []
        self._copied: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not self._buffers:
            self._buffers = [
                [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
                for _ in self._copied
            ]
        slot = self._next
        self._next = (slot + 1) % len(self._copied)
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()
        out = []
        for buffer, tensor in zip(self._buffers[slot], tensors, strict=True):
            buffer.copy_(tensor)
            out.append(buffer.to(self.device, non_blocking=True))
        self._copied[slot] = torch.cuda.Event()
        self._copied[slot].record()
        return out


def _on(device: torch.device) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
    return lambda tensors: [t.to(device) for t in tensors]
