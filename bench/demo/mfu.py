"""The demo on one GPU: tokens/s, MFU and step-time CV, before and after (issue 38).

    BEFORE=/path/to/old/tree python -m bench.demo mfu     # before/after, one call, <= 9 min
    python -m bench.demo mfu --impls                       # grouped vs padded vs loop experts
    python -m bench.demo mfu --sweep [--quick]             # candidate shapes for `large`
    python -m bench.demo mfu --ranks                       # 1 rank, --nproc 2, + --expert-parallel
    python -m bench.demo mfu --smoke --no-record           # every mode, tiny, on a CPU

Default mode: `syncless demo --preset large` in three configurations, off, the default
monitor stack (`--monitors all`) and everything (`--monitors all --profile events
--capture all`), for the tree in $BEFORE (a directory holding the old `syncless/`
package) and for this tree, interleaved: before-off, after-off, before-stack, ...
Then this tree's step is checked for host syncs on the GPU: `--sync-census 2`, and one
training step under `torch.cuda.set_sync_debug_mode("error")` and under torch.profiler
(CUDA runtime sync calls counted inside the step).

Each configuration is its own process (`python -m syncless.cli demo ... --log-every 1`,
PYTHONPATH set to its tree); the numbers come from its run directory: rank 0's
`demo/step/step_ms` per step and run.json's config. Over the measured steps
[--warmup, steps): tokens/s = tokens per step x steps / their summed time; MFU =
tokens/s x FLOPs per token / the GPU's bf16 peak, this tree's formula
(syncless.demo.flops) applied to each run's config, before's included; CV = standard
deviation / mean of the per-step times. Before runs --before-steps (default 50: the
old demo is host-bound and slow, and the call must fit in one 10-minute device call;
--budget-s skips, and says so, any run that would start too late).

`--ranks`: `large` on one rank, on two (`--nproc 2`, data parallel) and on two with
`--expert-parallel` (its default `--ep-splits auto`), each run's loss, backend and
`syncless check` verdict beside its numbers. MFU is per GPU. On a machine with one GPU
the two ranks share it over gloo (NCCL needs a GPU per rank) with `--batch-size 4`
(two ranks of `large` need twice its 42 GiB): a check that every multi-rank code path
runs on CUDA, not a speed.

Both trees log every step (`--log-every 1`), so every step has its own time: this
tree reads a logged step a step late without waiting (syncless.demo.steplog); the old
tree reads it at once, one more sync on top of its 24 per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

from bench.harness import append_result, metric_values

HERE = Path(__file__).resolve().parents[2]  # this tree: "after"
sys.path.insert(0, str(HERE))

from syncless.demo.config import DemoConfig  # noqa: E402  (this tree's)
from syncless.demo.flops import attention_flops_per_token, flops_per_token, peak_for  # noqa: E402

CONFIGS = {
    "off": [],
    "stack": ["--monitors", "all"],
    "full": ["--monitors", "all", "--profile", "events", "--capture", "all"],
}
# --sweep: shapes around the chosen `large` (overrides of it); tokens per step in the name.
SHAPES = {
    "large (8x2560, h2048, E8 k2, 24.6k tok)": {},
    "8x2560, h2048, E8 k2, 16.4k tok": {"batch_size": 8},
    "12x2048, h1536, E8 k2, 24.6k tok": dict(n_layers=12, d_model=2048, n_heads=16,
                                             expert_hidden=1536),
    "8x2048, h2560, E8 k2, 32.8k tok": dict(d_model=2048, n_heads=16, expert_hidden=2560,
                                            batch_size=16),
    "8x3072, h1536, E8 k2, 24.6k tok": dict(d_model=3072, n_heads=24, expert_hidden=1536),
    "16x2048, h1536, E8 k2, 16.4k tok": dict(n_layers=16, d_model=2048, n_heads=16,
                                             expert_hidden=1536, batch_size=8),
    "8x2560, h1024, E16 k4, 24.6k tok": dict(n_experts=16, top_k=4, expert_hidden=1024),
}  # fmt: skip
RANKS = {  # expert parallel before data parallel: on a shared GPU gloo makes DP the slow one
    "1 rank": [],
    "2 ranks --expert-parallel": ["--nproc", "2", "--expert-parallel"],
    "2 ranks": ["--nproc", "2"],
}
IMPLS = {
    "grouped": ["--expert-impl", "grouped"],
    "padded exact": ["--expert-impl", "padded"],
    "padded cf 1.25": ["--expert-impl", "padded", "--capacity-factor", "1.25"],
    "loop": ["--expert-impl", "loop"],
}


@dataclass
class Measured:
    tokens_per_s: float
    mfu: float | None
    mfu_causal: float | None  # the causal half of attention not counted
    cv: float
    step_ms: float
    steps: int
    memory_gib: float | None
    dropped: float | None  # share of (token, expert) rows dropped over capacity
    config: dict
    verdict: str = ""  # --ranks: losses, backend, `syncless check`

    def brief(self) -> str:
        text = f"{self.tokens_per_s / 1e3:,.1f}k tokens/s"
        if self.mfu is not None:
            text += f", MFU {self.mfu:.1%} ({self.mfu_causal:.1%} causal-halved)"
        text += f", CV {self.cv:.1%}, step {self.step_ms:.1f} ms"
        if self.memory_gib is not None:
            text += f", peak {self.memory_gib:.1f} GiB"
        if self.dropped is not None:
            text += f", {self.dropped:.2%} of rows dropped"
        if self.verdict:
            text += f"; {self.verdict}"
        return text


_PEAK = None
DEADLINE = float("inf")  # time.monotonic() by which every run must be done (--budget-s)


def _device_peak():
    """The bf16 peak of GPU 0, named by a short child process: this one stays off the
    GPU, which its demo runs have to themselves."""
    global _PEAK
    if _PEAK is None:
        probe = (
            "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
        )
        name = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        gpu = name.stdout.strip()
        _PEAK = peak_for("cuda", gpu, bf16=True) if gpu else peak_for("cpu", "", bf16=False)
    return _PEAK


def _cfg(config: dict) -> DemoConfig:
    names = {f.name for f in fields(DemoConfig)}
    return DemoConfig(**{k: v for k, v in config.items() if k in names})


def measure(run_dir: Path, warmup: int) -> Measured:
    config = json.loads((run_dir / "run.json").read_text())["config"]
    cfg = _cfg(config)
    step_ms = metric_values(run_dir, "demo/step/step_ms", warmup)
    if len(step_ms) < 2:
        raise RuntimeError(f"{len(step_ms)} step(s) logged after step {warmup} in {run_dir}")
    world = int(config.get("world_size", 1))
    gpus = int(config.get("gpus") or world)  # fewer than the ranks when they share GPUs
    tokens = cfg.batch_size * cfg.seq_len * world
    tokens_per_s = tokens * len(step_ms) / (sum(step_ms) / 1e3)
    peak = _device_peak()
    per_token = flops_per_token(cfg)
    mfu = mfu_causal = None
    if peak.flops is not None:
        mfu = tokens_per_s * per_token / gpus / peak.flops
        causal = per_token - attention_flops_per_token(cfg) / 2
        mfu_causal = tokens_per_s * causal / gpus / peak.flops
    memory = metric_values(run_dir, "demo/step/max_memory_mb", 0)
    dropped = metric_values(run_dir, "demo/step/dropped_rows_frac", warmup)
    return Measured(
        tokens_per_s, mfu, mfu_causal,
        statistics.stdev(step_ms) / statistics.mean(step_ms), statistics.mean(step_ms),
        len(step_ms), max(memory) / 1024 if memory else None,
        statistics.mean(dropped) if dropped else None, config,
    )  # fmt: skip


def _env(tree: Path) -> dict[str, str]:
    """The environment of a child on ``tree``: its package first, then whatever the
    caller put on PYTHONPATH (the device machine's duckdb, say)."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run_demo(tree: Path, argv: list[str], steps: int, tmp: Path, name: str,
             timeout_s: float) -> Path | str:  # fmt: skip
    """Run one demo in its own process; its run directory, or why it failed."""
    left = DEADLINE - time.monotonic()
    if left < 60:  # the call's budget: report what ran rather than be killed mid-way
        return "skipped: the call's --budget-s ran out"
    timeout_s = min(timeout_s, left)
    run_dir = tmp / name
    env = _env(tree)
    cmd = [sys.executable, "-m", "syncless.cli", "demo", *argv, "--steps", str(steps),
           "--log-every", "1", "--quiet", "--no-report", "--run-dir", str(run_dir)]  # fmt: skip
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True,
                           timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"
    took = time.perf_counter() - start
    print(f"  {name}: {took:.0f} s, exit {p.returncode}", flush=True)
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines()
        # torchrun ends with its own report; the rank's error is the line that names one.
        named = [line for line in lines if "Error" in line or "what():" in line]
        tail = named[-1].strip()[:300] if named else " | ".join(lines[-3:])
        return "out of memory" if "out of memory" in p.stderr.lower() else f"failed: {tail}"
    return run_dir


def _shape(config: dict) -> str:
    c = _cfg(config)
    shared = " + shared" if c.shared_expert else ""
    tokens = c.batch_size * c.seq_len
    return (f"{c.n_layers} layers, d {c.d_model}, {c.n_heads} heads, {c.n_experts} experts "
            f"top-{c.top_k}{shared}, h {c.expert_hidden}, seq {c.seq_len}, batch {c.batch_size}"
            f" = {tokens:,} tokens/step, {flops_per_token(c) / 1e9:.3g} GFLOP/token")  # fmt: skip


def _outcome(result: Path | str, warmup: int, verify: bool = False) -> Measured | str:
    """The run's numbers; its directory is removed (captures run to gigabytes).

    ``verify``: also its losses, backend and what `syncless check` says of it.
    """
    if isinstance(result, str):
        return result
    try:
        measured = measure(result, warmup)
        if verify:
            measured.verdict = _verdict(result, measured.config)
        return measured
    except Exception as e:  # a run that logged too little says so in the line
        return f"unreadable ({type(e).__name__}: {e})"
    finally:
        shutil.rmtree(result, ignore_errors=True)


def _verdict(run_dir: Path, config: dict) -> str:
    loss = metric_values(run_dir, "demo/step/loss", 0)
    # The router's load-balance loss: 1 when every expert gets its share, E/k when all
    # tokens go to k experts.
    balance = metric_values(run_dir, "demo/step/balance_loss", 0)
    finite = all(math.isfinite(v) for v in loss)
    check = subprocess.run(
        [sys.executable, "-m", "syncless.cli", "check", str(run_dir)],
        capture_output=True,
        text=True,
        env=_env(HERE),
    )
    said = (check.stdout.strip().splitlines() or ["?"])[-1].rsplit(": ", 1)[-1][:120]
    gpus = config.get("gpus")
    on = f"{gpus} GPU(s)" if gpus else "CPU"
    return (f"{config.get('world_size')} rank(s) on {on}, backend {config.get('backend')}, "
            f"ep {config.get('ep_mode')}; loss {loss[0]:.3f} -> {loss[-1]:.3f} "
            f"({'finite' if finite else 'NOT FINITE'}), balance loss {balance[0]:.2f} -> "
            f"{balance[-1]:.2f} (max {max(balance):.2f}); syncless check: exit "
            f"{check.returncode} ({said})")  # fmt: skip


def before_after(args: argparse.Namespace, tmp: Path) -> list[str]:
    before = Path(os.environ["BEFORE"]).resolve() if os.environ.get("BEFORE") else None
    if before is None and not args.smoke:
        raise SystemExit("set BEFORE to a directory holding the old syncless/ package")
    before = before or HERE  # --smoke without BEFORE: the code path, this tree twice
    trees = {"before": (before, args.before_steps), "after": (HERE, args.steps)}
    results: dict[tuple[str, str], Measured | str] = {}
    for config, flags in CONFIGS.items():  # interleaved: before, after, per configuration
        for which, (tree, steps) in trees.items():
            argv = ["--preset", args.preset, *flags, *args.demo_args]
            run = run_demo(tree, argv, steps, tmp, f"{which}-{config}", args.timeout)
            results[which, config] = _outcome(run, args.warmup)
    lines = []
    for which, (tree, steps) in trees.items():
        off = results[which, "off"]
        shape = _shape(off.config) if isinstance(off, Measured) else "?"
        parts = []
        for config, flags in CONFIGS.items():
            got = results[which, config]
            label = f"{config} ({' '.join(flags)})" if flags else config
            if isinstance(got, str):
                parts.append(f"{label}: {got}")
                continue
            vs = ""
            if config != "off" and isinstance(off, Measured):
                vs = f" ({got.tokens_per_s / off.tokens_per_s - 1:+.1%} tokens/s vs off)"
            impl = got.config.get("expert_impl_used", "loop (before expert impls)")
            parts.append(f"{label}: {got.brief()}{vs}, experts {impl}")
        where = _tree_label(tree) if which == "before" else "this tree"
        lines.append(
            f"{which} ({where}): demo --preset {args.preset} ({shape}), steps "
            f"{args.warmup}..{steps - 1}, --log-every 1, MFU against {_device_peak().describe()} "
            f"with this tree's formula: " + "; ".join(parts)
        )
    lines.append(sync_check(args, tmp))
    return lines


def _tree_label(tree: Path) -> str:
    label = os.environ.get("BEFORE_COMMIT")
    if label:
        return label
    p = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)  # fmt: skip
    return p.stdout.strip() or str(tree)


def sync_check(args: argparse.Namespace, tmp: Path) -> str:
    """This tree's step on the device: the census, the CUDA sync debug mode, and the
    CUDA runtime's sync calls inside one step (torch.profiler)."""
    argv = ["--preset", args.preset, *args.demo_args, "--sync-census", "2"]
    run = run_demo(HERE, argv, 4, tmp, "after-census", args.timeout)
    if isinstance(run, str):
        census = f"census run {run}"
    else:
        counts = metric_values(run, "guard/step/syncs_count", 0)
        census = f"--sync-census 2: {counts} syncs per step (steps 1, 2)"
    child = [sys.executable, "-m", "bench.demo", "mfu", "--sync-check-child",
             "--preset", args.preset, *(["--smoke"] if args.smoke else [])]  # fmt: skip
    left = DEADLINE - time.monotonic()
    if left < 60:
        check = "the step under the CUDA sync debug mode: skipped, the call's --budget-s ran out"
    else:
        try:
            p = subprocess.run(child, capture_output=True, text=True,
                               timeout=min(args.timeout, left),
                               env=_env(HERE))  # fmt: skip
        except subprocess.TimeoutExpired:
            check = "the step under the CUDA sync debug mode: timed out"
        else:
            found = [line for line in p.stdout.splitlines() if line.startswith("SYNC ")]
            check = found[-1][5:] if found else f"sync check failed: {p.stderr.strip()[-300:]}"
    return f"this tree's step, syncs on the device: {census}; {check}"


def sync_check_child(args: argparse.Namespace) -> None:
    """One training step of the preset under the CUDA sync debug mode and torch.profiler."""
    import torch
    import torch.nn.functional as F

    from syncless.demo.config import preset
    from syncless.demo.model import MoETransformer, init_weights
    from syncless.demo.parallel import clip_grad_norm

    if not torch.cuda.is_available():
        print("SYNC no CUDA device: the sync debug mode and the CUDA runtime calls need one")
        return
    device = torch.device("cuda")
    cfg = preset(args.preset, **({"batch_size": 2} if args.smoke else {}))
    with torch.device(device):
        model = MoETransformer(cfg)
    init_weights(model, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len + 1), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, balance = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        (loss + cfg.aux_loss_coef * balance).backward()
        clip_grad_norm(model, cfg.grad_clip, expert_parallel=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # lazy state (AdamW's) out of the way
        step()
    torch.cuda.synchronize()
    debug = "passed"
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as e:
        debug = f"raised: {str(e).splitlines()[0][:120]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("train_step"):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    span = next(e for e in events if e.name == "train_step").time_range
    syncing = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
               "cudaMemcpy", "aten::_local_scalar_dense")  # fmt: skip
    inside = [e.name for e in events if e.name in syncing and span.start <= e.time_range.start
              and e.time_range.end <= span.end]  # fmt: skip
    counted = {name: inside.count(name) for name in sorted(set(inside))}
    print(f"SYNC one training step (forward, backward, clip, AdamW) under "
          f"set_sync_debug_mode('error'): {debug}; CUDA runtime sync calls inside it "
          f"(torch.profiler): {counted or 'none'}")  # fmt: skip


def impls(args: argparse.Namespace, tmp: Path) -> list[str]:
    results = {}
    for name, flags in IMPLS.items():
        argv = ["--preset", args.preset, *flags, *args.demo_args]
        run = run_demo(HERE, argv, args.steps, tmp, name.replace(" ", "-"), args.timeout)
        results[name] = _outcome(run, args.warmup)
    shape = next((_shape(m.config) for m in results.values() if isinstance(m, Measured)), "?")
    parts = [f"{n}: {m.brief() if isinstance(m, Measured) else m}" for n, m in results.items()]
    return [f"expert impls, demo --preset {args.preset} ({shape}), steps {args.warmup}.."
            f"{args.steps - 1}, off: " + "; ".join(parts)]  # fmt: skip


def _gpu_count() -> int:
    probe = "import torch; print(torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def ranks(args: argparse.Namespace, tmp: Path) -> list[str]:
    gpus = _gpu_count()
    shared = gpus == 1
    extra = ["--batch-size", "4"] if shared and not args.smoke else []
    parts = []
    for name, flags in RANKS.items():
        argv = ["--preset", args.preset, *flags, *extra, *args.demo_args]
        run = run_demo(HERE, argv, args.steps, tmp, name.replace(" ", "-"), args.timeout)
        got = _outcome(run, args.warmup, verify=True)
        parts.append(f"{name}: {got.brief() if isinstance(got, Measured) else got}")
        print(f"    {parts[-1]}", flush=True)
    where = (f"{gpus} GPU(s)" + (": the two ranks share it over gloo, a check of the CUDA "
             "code paths, not a speed" if shared else "")) if gpus else "CPU, gloo"  # fmt: skip
    return [
        f"--ranks, demo --preset {args.preset} {' '.join(extra + args.demo_args)}".rstrip()
        + f", steps {args.warmup}..{args.steps - 1}, off, {where}: "
        + "; ".join(parts)
    ]


def sweep(args: argparse.Namespace, tmp: Path) -> list[str]:
    parts = []
    for name, overrides in SHAPES.items():
        argv = ["--preset", args.preset, *args.demo_args]
        for key, value in overrides.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        if args.smoke:  # the code path only: every shape shrunk to seconds on a CPU
            argv += ["--n-layers", "1", "--d-model", "64", "--n-heads", "2", "--expert-hidden",
                     "64", "--seq-len", "32", "--batch-size", "2"]  # fmt: skip
        run = run_demo(HERE, argv, args.steps, tmp, f"shape-{len(parts)}", args.timeout)
        got = _outcome(run, args.warmup)
        parts.append(f"{name}: {got.brief() if isinstance(got, Measured) else got}")
        print(f"    {parts[-1]}", flush=True)
    return [f"--sweep around demo --preset {args.preset}, steps {args.warmup}..{args.steps - 1},"
            f" off: " + "; ".join(parts)]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--impls", action="store_true", help="grouped vs padded vs loop")
    mode.add_argument("--sweep", action="store_true", help="candidate shapes for `large`")
    mode.add_argument("--ranks", action="store_true", help="1 rank, 2, 2 expert-parallel")
    mode.add_argument("--sync-check-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="--sweep: 30 steps a shape")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny preset and a few steps: the code paths, on a CPU")  # fmt: skip
    parser.add_argument("--preset", default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps of this tree's runs")
    parser.add_argument("--before-steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None, help="first measured step")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for the whole call: runs that would start later are "
                        "skipped and say so (default 540: one 10-minute device call)")  # fmt: skip
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args, args.demo_args = parser.parse_known_args(argv)
    small, one_tree = args.smoke, args.sweep or args.impls or args.ranks
    args.preset = args.preset or ("tiny" if small else "large")
    if args.sync_check_child:
        sync_check_child(args)
        return
    if args.steps is None:
        args.steps = 12 if small else (30 if args.quick or args.ranks else 60) if one_tree else 120
    if args.before_steps is None:
        args.before_steps = 12 if small else 50
    if args.warmup is None:
        args.warmup = 4 if small else 10 if one_tree else 20
    global DEADLINE
    DEADLINE = time.monotonic() + args.budget_s
    with tempfile.TemporaryDirectory() as tmp:
        if args.impls:
            lines = impls(args, Path(tmp))
        elif args.sweep:
            lines = sweep(args, Path(tmp))
        elif args.ranks:
            lines = ranks(args, Path(tmp))
        else:
            lines = before_after(args, Path(tmp))
    for line in lines:
        print(line if args.no_record else append_result("demo_mfu", line), flush=True)
