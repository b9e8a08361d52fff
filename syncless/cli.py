"""The ``syncless`` command: demo, query, lint."""

from __future__ import annotations

import argparse
import sys

from syncless.errors import UsageError


def _query(args: argparse.Namespace) -> int:
    from syncless.run.query_cli import print_query

    print_query(args.run_dir, args.sql, args.format)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from syncless.demo import cli as demo_cli

    parser = argparse.ArgumentParser(
        prog="syncless", description="Observe PyTorch training without slowing it down."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a small MoE transformer with every tool on")
    demo_cli.add_arguments(demo)

    query = sub.add_parser("query", help="run SQL over a run directory's metrics")
    query.add_argument("run_dir", help="a run directory (runs/<time>-<name>)")
    query.add_argument("sql", help='SQL over the view `metrics`, e.g. "SELECT * FROM metrics"')
    query.add_argument("--format", choices=("table", "csv", "json"), default="table")

    from syncless.lint import cli as lint_cli

    lint = sub.add_parser(
        "lint",
        help="check hot-path code for host syncs and collectives",
        description=lint_cli.DESCRIPTION,
    )
    lint_cli.add_arguments(lint)
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
