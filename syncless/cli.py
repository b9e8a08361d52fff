"""The ``syncless`` command: demo, query, check, compact, captures, report, summary, compare,
stragglers, trace, lint.

Start-up is part of the interface (issue #48): ``syncless --help`` names every command
but builds the arguments of none, and a command builds only its own, importing only
what it needs. Each command is a row of :data:`COMMANDS`; its ``add`` and ``run``
import their modules when called.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from typing import NamedTuple

from syncless.errors import UsageError

RUN_HELP = "a run directory (runs/<time>-<name>)"
RUNS_HELP = "run directories, or folders that hold runs (e.g. runs/)"


class Command(NamedTuple):
    """One subcommand: its one-line help, a description, and two functions that import
    their module only when called."""

    help: str
    description: str
    add: Callable[[argparse.ArgumentParser], None]  # adds the command's arguments
    run: Callable[[argparse.Namespace, list[str]], int]  # (arguments, raw argv after it)


def _add_demo(parser: argparse.ArgumentParser) -> None:
    from syncless.demo import cli as demo_cli

    demo_cli.add_arguments(parser)


def _run_demo(args: argparse.Namespace, rest: list[str]) -> int:
    from syncless.demo import cli as demo_cli

    return demo_cli.run(args, rest)


def _add_query(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN", help=RUNS_HELP)
    parser.add_argument("sql", help='a SELECT over `metrics`, e.g. "SELECT * FROM metrics"')
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    parser.add_argument(
        "--strict", action="store_true", help="fail (exit 1) on an unreadable shard instead"
    )


def _run_query(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.run import query_cli

    return query_cli.run(args)


def _add_run_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help=RUN_HELP)


def _add_check(parser: argparse.ArgumentParser) -> None:
    _add_run_dir(parser)
    parser.add_argument("--format", choices=("table", "json"), default="table")


def _run_check(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.run import check

    return check.run(args)


def _run_compact(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.run import compact

    return compact.run(args)


def _add_captures(parser: argparse.ArgumentParser) -> None:
    from syncless.run import captures_cli

    captures_cli.add_arguments(parser)


def _run_captures(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.run import captures_cli

    return captures_cli.run(args)


def _add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN", help=RUNS_HELP)
    parser.add_argument(
        "-o",
        "--output",
        help="the HTML file (default: RUN_DIR/report.html for one run, "
        "./syncless-compare.html for several)",
    )


def _run_report(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.report import report_cli

    return report_cli.run(args)


def _run_summary(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.report import summary

    return summary.run(args)


def _add_compare(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help=RUNS_HELP + "; the first run is the baseline"
    )
    parser.add_argument("--format", choices=("table", "json"), default="table")


def _run_compare(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.report import compare_cli

    return compare_cli.run(args)


def _add_stragglers(parser: argparse.ArgumentParser) -> None:
    _add_run_dir(parser)
    parser.add_argument("--format", choices=("table", "json"), default="table")


def _run_stragglers(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.report import stragglers

    return stragglers.run(args)


def _add_trace(parser: argparse.ArgumentParser) -> None:
    _add_run_dir(parser)
    parser.add_argument("-o", "--output", help="the JSON file (default RUN_DIR/trace.json)")


def _run_trace(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.report import trace

    return trace.run(args)


def _add_lint(parser: argparse.ArgumentParser) -> None:
    from syncless.lint import cli as lint_cli

    parser.description = lint_cli.DESCRIPTION
    lint_cli.add_arguments(parser)


def _run_lint(args: argparse.Namespace, _rest: list[str]) -> int:
    from syncless.lint import cli as lint_cli

    return lint_cli.run(args)


COMMANDS: dict[str, Command] = {
    "demo": Command("train a small MoE transformer with every tool on", "", _add_demo, _run_demo),
    "query": Command(
        "run a read-only SQL query over one run's metrics, or several runs'",
        "One SELECT over the tables `metrics`, `runs` (one row per run: its config "
        "fields as columns) and, with captures, `captures`. Several runs, or a folder "
        "of runs, are read as one: `metrics.run` is each record's run id, as in `runs`. "
        "Queries cannot read or write other files. Unreadable shards are skipped with "
        "a warning each.",
        _add_query,
        _run_query,
    ),
    "check": Command(
        "check a run directory: shards readable, records and missing steps per rank",
        "Exit status: 0 healthy, 1 unhealthy (unreadable shards, missing steps or ranks, "
        "truncated capture files), 2 not a run directory.",
        _add_check,
        _run_check,
    ),
    "compact": Command(
        "merge a run directory's small metric shards into few large ones",
        "Per rank, consecutive shards are merged into files of about a million records, "
        "crash-safe (a kill at any point loses and doubles nothing). A live run compacts "
        "itself in the background; this does it for finished runs.",
        _add_run_dir,
        _run_compact,
    ),
    "captures": Command(
        "list what a run captured: per tag, or every tensor with --all",
        "Tensors, steps, ranks, dtypes, shapes and bytes per capture tag, from the run's "
        "capture index (the `captures` table of `syncless query`).",
        _add_captures,
        _run_captures,
    ),
    "lint": Command("check hot-path code for host syncs and collectives", "", _add_lint, _run_lint),
    "report": Command(
        "write a self-contained HTML report of a run, or of several runs overlaid",
        "One HTML file (scripts inline: it opens without network). One run: its curves, "
        "per-layer heatmaps, step-time breakdown, data plane, captures and what syncless "
        "cost. Several runs: every metric they share overlaid, per-layer heatmaps side "
        "by side or as a difference from the first, their configs diffed.",
        _add_report,
        _run_report,
    ),
    "summary": Command(
        "print a run's essentials as tables in the terminal", "", _add_run_dir, _run_summary
    ),
    "compare": Command(
        "compare runs with the first: config, loss, speed, first NaN or spike, layers",
        "Side by side against the first run (the baseline): config differences, loss at "
        "matching steps and the first step it differs beyond noise, tokens/s, step time "
        "and MFU, the first NaN/Inf or spike, the worst layer by each monitor and the "
        "layer that moved first, and the profile sections that changed most.",
        _add_compare,
        _run_compare,
    ),
    "stragglers": Command(
        "name the ranks that were slow, in which section, from which step to which",
        "One line per verdict the profiler recorded: the rank, the section, its score "
        "(the fleet's median time over the rank's own: 0.5 is twice as slow), the first "
        "and the last step it was slow; gpu_clock verdicts name the rank's SM clock. "
        "--format json gives a list of objects (rank, section, score, first_step, "
        "last_step). See docs/stragglers.md.",
        _add_stragglers,
        _run_stragglers,
    ),
    "trace": Command(
        "export the profiler's sections as a Chrome/Perfetto trace",
        "One JSON trace (Chrome trace event format) with a track per rank and stream: "
        "open it in https://ui.perfetto.dev next to a torch profiler trace.",
        _add_trace,
        _run_trace,
    ),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser with every command, and the arguments of ``commands`` (None: all).

    ``--help`` needs no command's arguments; a command needs only its own, so running
    one imports nothing another needs.
    """
    parser = argparse.ArgumentParser(
        prog="syncless", description="Observe PyTorch training without slowing it down."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = set(COMMANDS if commands is None else commands)
    for name, command in COMMANDS.items():
        child = sub.add_parser(name, help=command.help, description=command.description or None)
        if name in wanted:
            command.add(child)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = command_of(argv)
    args = build_parser([name] if name in COMMANDS else []).parse_args(argv)
    try:
        return COMMANDS[args.command].run(args, argv[argv.index(args.command) + 1 :])
    except UsageError as e:
        print(f"syncless: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
