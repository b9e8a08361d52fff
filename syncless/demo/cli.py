"""``syncless demo``: argument parsing and the entry point of every rank."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import sys
from pathlib import Path

from syncless.demo.config import PRESETS, DemoConfig, add_config_arguments, config_from_args
from syncless.demo.launch import launch, strip_nproc
from syncless.demo.signals import AGENT_PID_ENV, Stopped, die_with_parent, stop_on
from syncless.errors import UsageError
from syncless.run.rundir import DEFAULT_ROOT, check_run_dir, check_writable
from syncless.run.storage import is_remote, run_path

SINKS = ("tensorboard", "wandb")  # each the name of its extra and of its package


def check_sinks(names: list[str]) -> None:
    """A missing extra stops the demo before any rank starts."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise UsageError(f'--sink {name} needs {name}: pip install "syncless[{name}]"')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        default="tiny",
        help=f"model and training size: {', '.join(PRESETS)} (default: tiny)",
    )
    parser.add_argument(
        "--nproc", type=int, default=None, help="run N ranks on this machine via torchrun"
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        help="run directory (default: a new runs/<time>-<name>); one that holds a run is "
        "refused unless --resume",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="add a segment to the run in --run-dir: steps go on from its last stored step "
        "(the demo keeps no checkpoint: the model starts afresh)",
    )
    parser.add_argument("--name", default=None, help="run name (default: demo-<preset>)")
    parser.add_argument(
        "--quiet", action="store_true", help="no live view; print only the run directory"
    )
    parser.add_argument(
        "--report",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write RUN_DIR/report.html at the end (with the report extra: plotly)",
    )
    parser.add_argument(
        "--sink",
        action="append",
        choices=SINKS,
        default=[],
        help="also write rank 0's records to TensorBoard (RUN_DIR/tensorboard) or to an "
        "offline wandb run (RUN_DIR/wandb); repeatable; each needs the extra of its name",
    )
    tools = parser.add_argument_group("syncless tools")
    tools.add_argument(
        "--sync-census",
        type=int,
        nargs="?",
        const=3,
        default=None,
        metavar="STEPS",
        help="count every host sync in STEPS steps after step 0 (default 3): print the "
        "per-call-site table and store guard/* records",
    )
    tools.add_argument(
        "--monitors",
        default=None,
        metavar="NAMES",
        help="built-in monitors: all, or a comma list of attention, moe, activations, "
        "norms, nonfinite, gradients",
    )
    tools.add_argument(
        "--monitor-every",
        type=int,
        default=None,
        metavar="N",
        help="record at most every N steps (default: each monitor's own cadence)",
    )
    tools.add_argument(
        "--monitor-budget",
        type=float,
        default=0.01,
        metavar="FRACTION",
        help="the share of the step the monitors may cost: each monitor's cadence is set "
        "from its measured cost (default 0.01; 0: fixed cadences)",
    )
    tools.add_argument(
        "--profile",
        default=None,
        metavar="MODE",
        help="section profiler: events (CUDA events, lagged; host clock on CPU), "
        "collectives, sync or off",
    )
    tools.add_argument(
        "--profile-every", type=int, default=10, metavar="N", help="report every N steps"
    )
    tools.add_argument(
        "--profile-trace",
        action="store_true",
        help="costly: report every step, per-layer collective rows, and MoE routing ids "
        "per step under RUN_DIR/trace/routing/",
    )
    tools.add_argument(
        "--dataplane",
        action="store_true",
        help="route each step's batch through a key-value store wrapped in "
        "syncless.dataplane.MetricsClient (put, get with wire digests, clear)",
    )
    tools.add_argument(
        "--capture",
        default=None,
        metavar="LAYERS",
        help="capture the hidden states of these layers (all, or e.g. 0,3) through "
        "syncless.capture into RUN_DIR/captures/",
    )
    tools.add_argument(
        "--capture-every",
        type=int,
        default=None,
        metavar="N",
        help="capture every N steps (default 10)",
    )
    tools.add_argument(
        "--capture-point",
        default="hidden",
        choices=("hidden", "moe_input"),
        help="what --capture takes of each layer: the block's output (hidden, default) "
        "or the MoE block's input, right before its router and token dispatch",
    )
    tools.add_argument(
        "--capture-windows",
        action="store_true",
        help="with --capture and --expert-parallel: keep the capture's D2H copies out of "
        "the token all-to-alls (recurring windows between them)",
    )
    add_config_arguments(parser)


def build_tools(args: argparse.Namespace) -> list:
    tools = []
    if args.sync_census is not None:
        from syncless.demo.sync_census import SyncCensusTool

        if args.sync_census < 1:
            raise UsageError(
                f"--sync-census takes a positive number of steps, got {args.sync_census}"
            )
        tools.append(SyncCensusTool(steps=args.sync_census))
    if args.monitors is not None:
        from syncless.demo.monitors_tool import MonitorsTool
        from syncless.monitors import parse_names

        if args.monitor_every is not None and args.monitor_every < 1:
            raise UsageError(f"--monitor-every must be >= 1, got {args.monitor_every}")
        if not 0 <= args.monitor_budget < 1:
            raise UsageError(
                f"--monitor-budget must be a fraction of the step in [0, 1), got "
                f"{args.monitor_budget} (0.01 is 1%; 0 turns the budget off)"
            )
        parse_names(args.monitors)  # a clear error before training starts
        budget = args.monitor_budget or None
        tools.append(MonitorsTool(args.monitors, every=args.monitor_every, budget=budget))
    elif args.monitor_every is not None:
        raise UsageError("--monitor-every needs --monitors")
    if args.profile is not None:
        from syncless.demo.profile_tool import ProfileTool
        from syncless.profile import MODES

        if args.profile not in MODES:
            raise UsageError(f"--profile {args.profile!r}: expected one of {', '.join(MODES)}")
        if args.profile_every < 1:
            raise UsageError(f"--profile-every must be >= 1, got {args.profile_every}")
        tools.append(
            ProfileTool(args.profile, report_every=args.profile_every, trace=args.profile_trace)
        )
    elif args.profile_trace:
        raise UsageError("--profile-trace needs --profile MODE")
    if args.dataplane:
        from syncless.demo.dataplane_tool import DataplaneTool

        tools.append(DataplaneTool())
    if args.capture is not None:
        from syncless.demo.capture_tool import CaptureTool, parse_layers

        every = 10 if args.capture_every is None else args.capture_every
        cfg = config_from_args(args)
        where = f"--preset {args.preset}" + (
            f", --n-layers {args.n_layers}" if args.n_layers is not None else ""
        )
        parse_layers(args.capture, cfg.n_layers, where)  # a clear error before training
        if args.capture_windows and not cfg.expert_parallel:
            raise UsageError(
                "--capture-windows brackets the expert-parallel all-to-alls: it needs "
                "--expert-parallel and more than one rank"
            )
        tools.append(
            CaptureTool(
                args.capture, every=every, windows=args.capture_windows, point=args.capture_point
            )
        )
    elif args.capture_every is not None or args.capture_windows or args.capture_point != "hidden":
        flag = (
            "--capture-every"
            if args.capture_every is not None
            else "--capture-windows"
            if args.capture_windows
            else "--capture-point"
        )
        raise UsageError(f"{flag} needs --capture LAYERS (all, or e.g. 0,1)")
    return tools


def _say_if_ranks_share_gpus(cfg: DemoConfig, nproc: int) -> None:
    import torch  # the launcher itself never touches the GPU

    from syncless.demo.parallel import ranks_per_gpu

    if cfg.device == "cpu" or not torch.cuda.is_available():
        return
    if ranks_per_gpu(nproc) > 1:
        print(
            f"syncless demo: {nproc} ranks on {torch.cuda.device_count()} GPU(s): ranks share "
            "GPUs and talk over gloo (NCCL needs a GPU per rank); every code path runs, at no "
            "meaningful speed",
            file=sys.stderr,
        )


def run(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = config_from_args(args)  # validates the preset before anything starts
    name = args.name or f"demo-{args.preset}"
    if args.resume and args.run_dir is None:
        raise UsageError("--resume needs --run-dir: the directory of the run to resume")
    if args.run_dir is not None and is_remote(run_path(args.run_dir)):
        # Its TensorBoard view, routing trace and report are local files.
        raise UsageError(
            f"--run-dir {args.run_dir}: the demo writes its run to a local directory; "
            "a run in an object store is written by your own training through "
            "Run(run_dir=URL), and read by syncless query/summary/report URL (docs/run.md)"
        )
    check_sinks(args.sink)
    if args.nproc is not None:
        if args.nproc < 1:
            raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
        cfg.validate(world_size=args.nproc)
        build_tools(args)  # reject bad tool flags before starting the ranks
        # Refused before the ranks start: one line, not one per rank and torchrun's report.
        if args.run_dir is not None:
            check_run_dir(Path(args.run_dir), args.resume)
        check_writable(Path(args.run_dir or DEFAULT_ROOT))
        _say_if_ranks_share_gpus(cfg, args.nproc)
        # Rank 0 claims the directory and prints the summary (or, with --quiet, the run
        # directory) itself.
        return launch(args.nproc, [*strip_nproc(argv), "--name", name])
    is_main = int(os.environ.get("RANK", "0")) == 0
    try:
        with _stopping():
            result = _run_rank(args, cfg, name)
    except Stopped as stop:
        if is_main:
            where = f"; run: {stop.run_dir}" if stop.run_dir is not None else ""
            print(f"syncless: {stop}: logged steps are flushed{where}", file=sys.stderr)
        return stop.exit_code
    if is_main:
        report = _write_report(result.run_dir) if args.report else None
        if args.quiet:
            print(result.run_dir)
        else:
            first, last = result.losses[0][1], result.losses[-1][1]
            steps = f"{cfg.steps} steps" + (
                f" from step {result.first_step}" if result.first_step else ""
            )
            print(
                f"loss {first:.3f} -> {last:.3f} over {steps}; run: {result.run_dir}\n"
                f'query it: syncless query {result.run_dir} "SELECT * FROM metrics LIMIT 10"',
                file=sys.stderr,
            )
            if report:
                print(report, file=sys.stderr)
    return 0


def _write_report(run_dir: Path) -> str:
    """RUN_DIR/report.html; returns where it is, or how to get one."""
    try:
        from syncless.report import html
    except ImportError:  # plotly is the report extra's
        return f'an HTML report: pip install "syncless[report]"; syncless report {run_dir}'
    try:
        return f"report: {html.write(run_dir)}"
    except Exception as e:  # the report must never fail the run it describes
        return f"syncless: the report was not written ({type(e).__name__}: {e})"


def _run_rank(args: argparse.Namespace, cfg, name: str):
    from syncless.demo.train import run_demo  # torch import only when training

    cfg.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    tools = build_tools(args)
    return run_demo(
        cfg,
        run_dir=args.run_dir,
        name=name,
        quiet=args.quiet,
        tools=tools,
        resume=args.resume,
        sinks=args.sink,
    )


def _stopping() -> contextlib.AbstractContextManager:
    """SIGTERM (and, under torchrun, SIGINT) stops the demo with its data flushed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        # One process: SIGINT stays KeyboardInterrupt, so a second Ctrl-C still
        # interrupts a flush that hangs.
        return stop_on([signal.SIGTERM])
    # A rank: stop when torchrun dies, however it dies (syncless.demo.signals).
    agent = os.environ.get(AGENT_PID_ENV)
    die_with_parent(signal.SIGTERM, parent=int(agent) if agent else None)
    # Deferred: the ranks stop together at a logged step (syncless.demo.train).
    return stop_on([signal.SIGINT, signal.SIGTERM], deferred=True)
