"""``python -m bench.stacks CASE [ARGS...]``: one case of the suite; alone, its list of cases."""

from bench.harness import suite_main

suite_main(__package__)
