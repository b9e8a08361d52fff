"""The ``syncless`` command: demo, query, check, compact, captures, report, summary, trace,
lint."""

from __future__ import annotations

import argparse
import sys

from syncless.errors import UsageError


def _query(args: argparse.Namespace) -> int:
    from syncless.run import query_cli

    return query_cli.run(args)


def _check(args: argparse.Namespace) -> int:
    from syncless.run import check

    return check.run(args)


def _compact(args: argparse.Namespace) -> int:
    from syncless.run import compact

    return compact.run(args)


def _captures(args: argparse.Namespace) -> int:
    from syncless.run import captures_cli

    return captures_cli.run(args)


def _report(args: argparse.Namespace) -> int:
    from syncless.report import html

    return html.run(args)


def _summary(args: argparse.Namespace) -> int:
    from syncless.report import summary

    return summary.run(args)


def _trace(args: argparse.Namespace) -> int:
    from syncless.report import trace

    return trace.run(args)


def _add_view_commands(sub: argparse._SubParsersAction) -> None:
    """report, summary, trace: their arguments live here, so ``--help`` imports no
    plotting library."""
    report = sub.add_parser(
        "report",
        help="write a self-contained HTML report of a run directory",
        description="One HTML file (scripts inline: it opens without network) with the "
        "run, its curves, per-layer heatmaps, step-time breakdown, data plane, captures "
        "and what syncless cost.",
    )
    report.add_argument("run_dir", help="a run directory (runs/<time>-<name>)")
    report.add_argument("-o", "--output", help="the HTML file (default RUN_DIR/report.html)")
    summary = sub.add_parser("summary", help="print a run's essentials as tables in the terminal")
    summary.add_argument("run_dir", help="a run directory (runs/<time>-<name>)")
    trace = sub.add_parser(
        "trace",
        help="export the profiler's sections as a Chrome/Perfetto trace",
        description="One JSON trace (Chrome trace event format) with a track per rank "
        "and stream: open it in https://ui.perfetto.dev next to a torch profiler trace.",
    )
    trace.add_argument("run_dir", help="a run directory (runs/<time>-<name>)")
    trace.add_argument("-o", "--output", help="the JSON file (default RUN_DIR/trace.json)")


def build_parser() -> argparse.ArgumentParser:
    from syncless.demo import cli as demo_cli

    parser = argparse.ArgumentParser(
        prog="syncless", description="Observe PyTorch training without slowing it down."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a small MoE transformer with every tool on")
    demo_cli.add_arguments(demo)

    query = sub.add_parser(
        "query",
        help="run a read-only SQL query over a run directory's metrics",
        description="One SELECT over the tables `metrics` and (with captures) `captures`. "
        "Queries cannot read or write other files. Unreadable shards are skipped with a "
        "warning each.",
    )
    query.add_argument("run_dir", help="a run directory (runs/<time>-<name>)")
    query.add_argument("sql", help='a SELECT over `metrics`, e.g. "SELECT * FROM metrics"')
    query.add_argument("--format", choices=("table", "csv", "json"), default="table")
    query.add_argument(
        "--strict", action="store_true", help="fail (exit 1) on an unreadable shard instead"
    )

    check = sub.add_parser(
        "check",
        help="check a run directory: shards readable, records and missing steps per rank",
        description="Exit status: 0 healthy, 1 unhealthy (unreadable shards, missing "
        "steps or ranks, truncated capture files), 2 not a run directory.",
    )
    check.add_argument("run_dir", help="a run directory (runs/<time>-<name>)")
    check.add_argument("--format", choices=("table", "json"), default="table")

    compact = sub.add_parser(
        "compact",
        help="merge a run directory's small metric shards into few large ones",
        description="Per rank, consecutive shards are merged into files of about a "
        "million records, crash-safe (a kill at any point loses and doubles nothing). A "
        "live run compacts itself in the background; this does it for finished runs.",
    )
    compact.add_argument("run_dir", help="a run directory (runs/<time>-<name>)")

    from syncless.run import captures_cli

    captures = sub.add_parser(
        "captures",
        help="list what a run captured: per tag, or every tensor with --all",
        description="Tensors, steps, ranks, dtypes, shapes and bytes per capture tag, "
        "from the run's capture index (the `captures` table of `syncless query`).",
    )
    captures_cli.add_arguments(captures)

    from syncless.lint import cli as lint_cli

    lint = sub.add_parser(
        "lint",
        help="check hot-path code for host syncs and collectives",
        description=lint_cli.DESCRIPTION,
    )
    lint_cli.add_arguments(lint)
    _add_view_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from syncless.demo import cli as demo_cli

            return demo_cli.run(args, argv[argv.index("demo") + 1 :])
        if args.command == "query":
            return _query(args)
        if args.command == "check":
            return _check(args)
        if args.command == "captures":
            return _captures(args)
        if args.command == "compact":
            return _compact(args)
        if args.command == "report":
            return _report(args)
        if args.command == "summary":
            return _summary(args)
        if args.command == "trace":
            return _trace(args)
        if args.command == "lint":
            from syncless.lint import cli as lint_cli

            return lint_cli.run(args)
    except UsageError as e:
        print(f"syncless: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
