"""``syncless lint``: a static checker for hot-path code (pure ``ast``, stdlib only).

It finds hot-path functions (hooks, ``@hot_path`` functions, what they call) and
flags host syncs, collectives, schema changes and swallowed exceptions in them. See
``docs/lint.md`` for the rules.

>>> from syncless.lint import lint_source
>>> [f.rule for f in lint_source("def grad_hook(g):\\n    return g.item()\\n")]
['SL001']
"""

from syncless.lint.config import ConfigError, LintConfig, find_pyproject, load_config
from syncless.lint.engine import lint_file, lint_paths, lint_source
from syncless.lint.findings import Finding, LintError, LintResult
from syncless.lint.rules import RULES, Rule

__all__ = [
    "RULES",
    "ConfigError",
    "Finding",
    "LintConfig",
    "LintError",
    "LintResult",
    "Rule",
    "find_pyproject",
    "lint_file",
    "lint_paths",
    "lint_source",
    "load_config",
]
