"""Demo configuration: presets and command-line overrides for every knob."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from syncless.errors import UsageError

# Where the expert-parallel dispatch takes its split lists from (docs/pacing.md). The
# default, auto, is the fastest mode bench/demo/pacing_ep.py measured that is safe for the
# router: static-paced for the fixed router (-13.3% step time against the drain on two
# H200s), lookahead for a learned one, whose counts change with every batch (a static
# plan would send tokens to the wrong experts; lookahead matched the drain, -0.4% and
# +0.3%, without its full stop of the host). docs/pacing.md, "The default".
EP_SPLITS = ("auto", "drain", "static", "static-paced", "lookahead")
# How the routed experts run (syncless.demo.experts): auto is grouped GEMMs where
# torch._grouped_mm needs no host sync (sm90/sm100 in bf16, CPU), else padded.
EXPERT_IMPLS = ("auto", "grouped", "padded", "loop")
# How the router is kept balanced (docs/demo.md, "Load balancing"): bias is DeepSeek-V3's
# auxiliary-loss-free bias with the sequence-wise loss beside it, aux the loss alone
# (the demo's default before issue 46), none neither.
BALANCE_MODES = ("bias", "aux", "none")
# The bias step per optimizer step. DeepSeek-V3 used 1e-3 over ~10^5 steps; the demo's
# runs last 120-300 steps. Measured on the CPU (bench/demo/balance.py, small preset,
# 120 steps, largest expert share of a layer's picks over steps 55-64 / 110-119;
# balanced 12.5%): 1e-3 18.6-38.1% / 14.5-16.7%, 3e-3 17.1-23.2% / 14.1-15.3%, 1e-2
# 16.5-19.7% / 14.9-16.6%; --balance aux 19.5-34.5% / 18.2-24.7%.
DEFAULT_BIAS_UPDATE_SPEED = 3e-3
# Pacing points (MoE layers) the host may run ahead under static-paced. Provisional:
# bench/demo/pacing_ep.py sweeps it on GPUs and has not been run yet.
DEFAULT_RUN_AHEAD = 2


@dataclass
class DemoConfig:
    # model
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 128
    shared_expert: bool = True
    balance: str = "bias"  # bias | aux | none (BALANCE_MODES)
    # --balance bias: the bias step per optimizer step (DeepSeek-V3's gamma)
    bias_update_speed: float = DEFAULT_BIAS_UPDATE_SPEED
    aux_loss_coef: float = 0.01  # the sequence-wise balance loss's weight (bias and aux)
    expert_impl: str = "auto"  # auto | grouped | padded | loop (syncless.demo.experts)
    capacity_factor: float = 0.0  # padded: rows per expert over the mean; 0 = exact, no drops
    # data and optimisation
    seq_len: int = 64
    batch_size: int = 8  # sequences per rank per step; the global batch is batch_size * world
    steps: int = 200
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    grad_clip: float = 1.0
    seed: int = 0
    corpus_mb: float = 4.0
    # parallelism and execution
    expert_parallel: bool = False
    ep_splits: str = "auto"  # auto | drain | static | static-paced | lookahead (docs/pacing.md)
    run_ahead: int = DEFAULT_RUN_AHEAD  # static-paced: MoE layers the host may lead by
    fix_router: bool = False  # token t -> experts (t*k + j) mod E, equal weights (benchmarks)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    # --straggle RANK:SECTION:MS: rank RANK sleeps MS ms inside SECTION (data, forward,
    # backward, grad_sync or optimizer) at every step, from the start: a straggler for
    # the profiler's straggler verdicts to name (docs/stragglers.md). It turns on
    # --profile events if no --profile was given. A host sleep: on a GPU it shows in
    # the device timings where the device waits for the host.
    straggle: str = ""
    # output
    log_every: int = 1
    flush_interval_s: float = 10.0

    def validate(self, world_size: int = 1) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise UsageError(msg)

        for name in _POSITIVE:
            need(getattr(self, name) > 0, f"--{_flag(name)} must be > 0, got {getattr(self, name)}")
        need(self.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        need(
            self.d_model % self.n_heads == 0,
            f"--d-model ({self.d_model}) must be divisible by --n-heads ({self.n_heads})",
        )
        need(
            (self.d_model // self.n_heads) % 2 == 0,
            f"the head size d_model/n_heads = {self.d_model // self.n_heads} must be even (RoPE)",
        )
        need(
            1 <= self.top_k <= self.n_experts,
            f"--top-k ({self.top_k}) must be between 1 and --n-experts ({self.n_experts})",
        )
        need(
            self.device in ("auto", "cpu", "cuda"),
            f"--device must be auto, cpu or cuda, got {self.device!r}",
        )
        need(
            self.dtype in ("auto", "fp32", "bf16"),
            f"--dtype must be auto, fp32 or bf16, got {self.dtype!r}",
        )
        need(self.corpus_mb > 0, f"--corpus-mb must be > 0, got {self.corpus_mb}")
        need(
            self.balance in BALANCE_MODES,
            f"--balance must be one of {', '.join(BALANCE_MODES)}, got {self.balance!r}",
        )
        need(
            self.bias_update_speed > 0,
            f"--bias-update-speed must be > 0, got {self.bias_update_speed}",
        )
        need(
            self.expert_impl in EXPERT_IMPLS,
            f"--expert-impl must be one of {', '.join(EXPERT_IMPLS)}, got {self.expert_impl!r}",
        )
        need(
            self.capacity_factor >= 0,
            f"--capacity-factor must be >= 0, got {self.capacity_factor}",
        )
        need(
            self.capacity_factor == 0 or self.expert_impl == "padded",
            "--capacity-factor applies to --expert-impl padded only (grouped and loop never "
            "drop rows)",
        )
        self._validate_ep_splits(need)
        if self.straggle:
            straggler(self.straggle, world_size)  # raises UsageError with the reason
        if self.expert_parallel:
            need(
                self.n_experts % world_size == 0,
                f"--expert-parallel shards {self.n_experts} experts over {world_size} ranks, "
                f"but {self.n_experts} is not divisible by {world_size}: choose --n-experts "
                f"as a multiple of the number of ranks (e.g. {world_size * max(1, self.n_experts // world_size)})",
            )

    def ep_mode(self) -> str:
        """``ep_splits`` with ``auto`` resolved: static-paced for the fixed router,
        lookahead for a learned one (see EP_SPLITS)."""
        if self.ep_splits != "auto":
            return self.ep_splits
        return "static-paced" if self.fix_router else "lookahead"

    def _validate_ep_splits(self, need: Callable[[bool, str], None]) -> None:
        need(
            self.ep_splits in EP_SPLITS,
            f"--ep-splits must be one of {', '.join(EP_SPLITS)}, got {self.ep_splits!r}",
        )
        need(self.run_ahead >= 0, f"--run-ahead must be >= 0, got {self.run_ahead}")
        mode = self.ep_mode()
        need(
            self.run_ahead == DEFAULT_RUN_AHEAD
            or (mode == "static-paced" and self.expert_parallel),
            f"--run-ahead applies to --ep-splits static-paced only (got --ep-splits {mode}"
            + ("" if self.expert_parallel else " without --expert-parallel")
            + ")",
        )
        if self.ep_splits == "auto":
            return
        need(
            self.expert_parallel,
            f"--ep-splits {self.ep_splits} changes the expert-parallel dispatch: add "
            "--expert-parallel (and run several ranks, e.g. --nproc 2)",
        )
        need(
            self.fix_router or self.ep_splits in ("drain", "lookahead"),
            f"--ep-splits {self.ep_splits} reuses one dispatch plan, which is only correct "
            "for a static router: add --fix-router (a learned router's counts change with "
            "every batch; use --ep-splits lookahead for it)",
        )


# The demo's sections (syncless.demo.train) a --straggle delay can go into.
STRAGGLE_SECTIONS = ("data", "forward", "backward", "grad_sync", "optimizer")


def straggler(spec: str, world_size: int = 1) -> tuple[int, str, float]:
    """``RANK:SECTION:MS`` as (rank, section, seconds); a UsageError says what is wrong."""
    parts = spec.split(":")
    usage = f"--straggle takes RANK:SECTION:MS, e.g. 2:backward:20; got {spec!r}"
    if len(parts) != 3:
        raise UsageError(usage)
    try:
        rank, ms = int(parts[0]), float(parts[2])
    except ValueError:
        raise UsageError(usage) from None
    if not 0 <= rank < world_size:
        raise UsageError(f"--straggle rank {rank} is not one of the {world_size} rank(s)")
    if parts[1] not in STRAGGLE_SECTIONS:
        raise UsageError(f"--straggle section {parts[1]!r}: one of {', '.join(STRAGGLE_SECTIONS)}")
    if not ms > 0:
        raise UsageError(f"--straggle delay must be > 0 ms, got {parts[2]}")
    return rank, parts[1], ms / 1e3


_POSITIVE = (
    "n_layers", "d_model", "n_heads", "n_experts", "top_k", "expert_hidden", "seq_len",
    "batch_size", "steps", "lr", "log_every", "flush_interval_s",
)  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    # seconds on 2 CPU cores
    "tiny": {},
    # a few minutes on CPU
    "small": dict(
        n_layers=4,
        d_model=192,
        n_heads=6,
        n_experts=8,
        top_k=2,
        expert_hidden=384,
        seq_len=128,
        batch_size=16,
        steps=300,
        lr=2e-3,
        warmup_steps=30,
        corpus_mb=8.0,
    ),
    # One GPU, GPU-bound, in bf16 autocast (docs/demo.md, "Presets"). Wide layers with
    # large GEMMs: the time a step spends outside matmuls (norms, rotary, residual
    # adds, the dispatch's gathers; AdamW, clipping and weight casts over every
    # parameter) shrinks against the matmuls as d_model and tokens per step grow. 8
    # experts top-2 plus a shared one keep the active share of the parameters (0.44)
    # high enough that the per-parameter work stays small; 24,576 tokens a step.
    # Memory on the GPU, estimated: 1.342 B parameters x 16 bytes (fp32 weights,
    # gradients, AdamW's two moments) = 21.5 GB; their bf16 copies saved for the
    # backward 2.7 GB; activations ~126 KB per token per layer (fp32 residual at both
    # norms, bf16 q/k/v/attention output, the grouped buffer and 4 hidden tensors of the
    # 2 chosen experts and the shared one) x 24,576 tokens x 8 layers = 24.8 GB; about
    # 50 GB at the peak, which leaves an 80 GB H100 room for --capture all's 8 GB ring.
    "large": dict(
        n_layers=8,
        d_model=2560,
        n_heads=20,
        n_experts=8,
        top_k=2,
        expert_hidden=2048,
        seq_len=2048,
        batch_size=12,
        steps=120,
        lr=3e-4,
        warmup_steps=20,
        corpus_mb=32.0,
        log_every=1,
    ),
}


def preset(name: str, **overrides: Any) -> DemoConfig:
    """The named preset with ``overrides`` applied."""
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return dataclasses.replace(DemoConfig(**PRESETS[name]), **overrides)


def _flag(field_name: str) -> str:
    return field_name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per DemoConfig field (default: the preset's value)."""
    group = parser.add_argument_group("model, data and training (override the preset)")
    for f in fields(DemoConfig):
        flag = f"--{_flag(f.name)}"
        if f.type == "bool":
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None
            )
        else:
            kind = {"int": int, "float": float, "str": str}[f.type]
            group.add_argument(flag, dest=f.name, type=kind, default=None, metavar=f.type.upper())


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    overrides = {
        f.name: getattr(args, f.name)
        for f in fields(DemoConfig)
        if getattr(args, f.name) is not None
    }
    return preset(args.preset, **overrides)
