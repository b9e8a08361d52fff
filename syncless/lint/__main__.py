"""``python -m syncless.lint PATH...``: the same as ``syncless lint PATH...``."""

from syncless.lint.cli import main

raise SystemExit(main())
