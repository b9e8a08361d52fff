"""Linting a module: find the hot functions, check them to a fixpoint, suppress.

Checking is iterative because types flow between functions: a helper's parameters
take the types of the arguments hot callers pass (a parameter that receives a tensor
anywhere is a tensor), and a caller sees the helper's inferred return type. Each
round re-checks every hot function with the current facts; when a round changes no
parameter type, return type or hot set, its findings are final.
"""

from __future__ import annotations

import ast
import os
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass

from syncless.lint.checker import FunctionChecker, RawFinding
from syncless.lint.config import LintConfig
from syncless.lint.context import ModuleContext
from syncless.lint.files import collect_files
from syncless.lint.findings import Finding, LintError, LintResult
from syncless.lint.hotpath import RANK_CALLED, find_seeds
from syncless.lint.lattice import T, merge_may
from syncless.lint.rules import RULES
from syncless.lint.scopes import FunctionInfo
from syncless.lint.suppress import KNOWN, Suppressions, scan_directives

_MAX_ROUNDS = 12  # types only widen, so this is a safety net, not a budget


@dataclass
class HotFunction:
    """A function on the hot path, why it is there, and its parameter types."""

    fn: FunctionInfo
    why: str
    rank: int
    params: dict[str, T]
    returns: T = T.UNKNOWN


def lint_source(
    source: str, path: str = "<string>", config: LintConfig | None = None
) -> list[Finding]:
    """Lint Python ``source``; ``path`` is only used in the findings.

    Raises :class:`SyntaxError` (or :class:`ValueError` for null bytes on Python
    3.11) when ``source`` does not parse.
    """
    config = config or LintConfig()
    tree = ast.parse(source, filename=path)
    ctx = ModuleContext(tree)
    hot = _hot_functions(ctx, config)
    findings: list[Finding] = []
    directives = scan_directives(source)
    suppressions = Suppressions(directives)
    for item, raw in hot:
        if suppressions.allows(raw.rule, raw.lines, raw.line_above):
            continue
        findings.append(
            _finding(
                path, raw.rule, raw.line, raw.col, f"{raw.text} in {item.why}", item.fn.qualname
            )
        )
    for directive in directives:
        where = _enclosing(ctx, directive.line)
        if not directive.name:
            text = "`# syncless:` comment without a directive"
            findings.append(_finding(path, "SL101", directive.line, directive.col, text, where))
        elif directive.name not in KNOWN:
            text = f"unknown directive `# syncless: {directive.name}`"
            findings.append(_finding(path, "SL101", directive.line, directive.col, text, where))
        elif not directive.reason:
            text = f"`# syncless: {directive.name}` without a reason suppresses nothing"
            findings.append(_finding(path, "SL100", directive.line, directive.col, text, where))
    return sorted(f for f in set(findings) if not config.ignores(f.rule))


def lint_file(path: str | os.PathLike[str], config: LintConfig | None = None) -> list[Finding]:
    """Lint one file. Raises OSError, SyntaxError, ValueError or UnicodeDecodeError."""
    with tokenize.open(path) as handle:  # honours a PEP 263 encoding cookie
        source = handle.read()
    return lint_source(source, str(path), config)


def lint_paths(
    paths: Iterable[str | os.PathLike[str]], config: LintConfig | None = None
) -> LintResult:
    """Lint files and directories (walked for ``*.py``), honouring ``config.exclude``.

    A path that is missing, unreadable or not valid Python becomes an entry in
    ``errors`` and the others are still linted. ``config=None`` uses the defaults; to
    read ``pyproject.toml`` pass :func:`syncless.lint.load_config`'s result.
    """
    config = config or LintConfig()
    files, errors = collect_files(paths, config)
    result = LintResult(errors=errors)
    for file in files:
        try:
            result.findings.extend(lint_file(file, config))
        except SyntaxError as error:
            where = f":{error.lineno}:{error.offset or 0}" if error.lineno else ""
            result.errors.append(LintError(str(file), f"cannot parse{where}: {error.msg}"))
            continue
        except (OSError, UnicodeDecodeError, ValueError) as error:
            result.errors.append(LintError(str(file), f"cannot read: {error}"))
            continue
        except RecursionError:
            result.errors.append(LintError(str(file), "code nested too deeply to lint"))
            continue
        result.files_checked += 1
    return result


def _finding(path: str, rule: str, line: int, col: int, message: str, function: str) -> Finding:
    return Finding(path, line, col, rule, message, function, RULES[rule].hint)


def _enclosing(ctx: ModuleContext, line: int) -> str:
    """The qualified name of the innermost function containing ``line``."""
    best: FunctionInfo | None = None
    for fn in ctx.index.functions:
        node = fn.node
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        if start <= line <= (node.end_lineno or node.lineno) and (
            best is None or start >= best.node.lineno
        ):
            best = fn
    return best.qualname if best is not None else "<module>"


def _hot_functions(ctx: ModuleContext, config: LintConfig) -> list[tuple[HotFunction, RawFinding]]:
    """Check every hot function until the facts settle; the last round's findings."""
    hot: dict[FunctionInfo, HotFunction] = {}

    def add(fn: FunctionInfo, why: str, rank: int, params: dict[str, T]) -> bool:
        current = hot.get(fn)
        if current is None:
            hot[fn] = HotFunction(fn, why, rank, dict(params))
            return True
        changed = False
        if rank < current.rank:
            current.why, current.rank = why, rank
            changed = True
        for name, t in params.items():
            merged = merge_may(current.params[name], t) if name in current.params else t
            if merged is not current.params.get(name):
                current.params[name] = merged
                changed = True
        return changed

    for seed in find_seeds(ctx, config.hot_path_patterns):
        add(seed.fn, seed.why, seed.rank, seed.params)

    def returns(fn: FunctionInfo) -> T:
        found = hot.get(fn)
        return found.returns if found is not None else T.UNKNOWN

    findings: list[tuple[HotFunction, RawFinding]] = []
    for _ in range(_MAX_ROUNDS):
        changed = False
        findings = []
        queue = list(hot.values())
        while queue:
            item = queue.pop(0)
            analysis = FunctionChecker(ctx, item.fn, item.params, returns).run()
            findings.extend((item, raw) for raw in analysis.findings)
            if analysis.returns is not item.returns:
                item.returns = analysis.returns
                changed = True
            for edge in analysis.edges:
                is_new = edge.fn not in hot
                why = f"`{edge.fn.qualname}`, called from `{item.fn.qualname}`"
                if add(edge.fn, why, RANK_CALLED, edge.params):
                    changed = True
                    if is_new:
                        queue.append(hot[edge.fn])
        if not changed:
            break
    return findings
