"""The ``syncless lint`` command line.

``add_arguments`` and ``run`` plug into the ``syncless`` subcommand parser;
``main`` is the standalone entry point behind ``python -m syncless.lint``.
"""

from __future__ import annotations

import argparse
import sys

from syncless.lint.config import ConfigError, load_config
from syncless.lint.engine import lint_paths
from syncless.lint.report import format_json, format_text, summary

DESCRIPTION = (
    "Statically check PyTorch hot-path code (hooks, @hot_path functions and what they "
    "call) for host syncs, collectives and schema changes. Exit status: 0 clean, "
    "1 findings, 2 usage error or a path that could not be linted."
)


def _globs(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``syncless lint`` arguments to ``parser``."""
    parser.add_argument(
        "paths", nargs="+", metavar="PATH", help="files or directories (walked for *.py)"
    )
    parser.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text: path:line:col: CODE message (hint); json: a list of objects",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read [tool.syncless.lint] from FILE instead of the nearest pyproject.toml",
    )
    parser.add_argument(
        "--hot-path-pattern",
        action="append",
        type=_globs,
        default=[],
        metavar="GLOB",
        help="extra fnmatch glob of hot-path function names (repeatable, comma-separated)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        type=_globs,
        default=[],
        metavar="GLOB",
        help="extra glob of paths to skip (repeatable, comma-separated)",
    )
    parser.add_argument(
        "--ignore",
        action="append",
        type=_globs,
        default=[],
        metavar="CODE",
        help="rule codes or code prefixes to drop, e.g. SL009 (repeatable, comma-separated)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the linter for parsed ``args``; returns the exit status (0, 1 or 2)."""
    try:
        config = load_config(args.config)
    except ConfigError as error:
        print(f"syncless lint: error: {error}", file=sys.stderr)
        return 2
    config = config.extended(
        hot_path_patterns=tuple(g for group in args.hot_path_pattern for g in group),
        exclude=tuple(g for group in args.exclude for g in group),
        ignore=tuple(g for group in args.ignore for g in group),
    )
    result = lint_paths(args.paths, config)
    if args.format == "json":
        sys.stdout.write(format_json(result.findings))
    else:
        sys.stdout.write(format_text(result.findings))
    sys.stdout.flush()
    for error in result.errors:
        print(f"{error.path}: error: {error.message}", file=sys.stderr)
    print(summary(result), file=sys.stderr)
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run; returns the exit status."""
    parser = argparse.ArgumentParser(prog="syncless lint", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
