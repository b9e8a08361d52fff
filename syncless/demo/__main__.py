"""``python -m syncless.demo`` (what ``torchrun ... -m syncless.demo`` starts on each rank):
the ``syncless demo`` command. Its own parser, so that the demo does not import the
top-level CLI that imports it."""

from __future__ import annotations

import argparse
import sys

from syncless.demo import cli
from syncless.errors import UsageError


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="syncless demo", description="train a small MoE transformer with every tool on"
    )
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cli.run(args, argv)
    except UsageError as e:
        print(f"syncless: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
