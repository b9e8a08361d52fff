"""The walk over the body of one hot function.

:class:`FunctionChecker` walks a function's statements in order, keeping the
inferred type of each local name (merged at ``if``/``for``/``try`` joins), applies
rules SL001-SL010 to every expression (through the :class:`ExpressionRules` it owns,
:mod:`syncless.lint.expression_rules`; SL009 is checked here, on ``try`` and ``with``
statements), and records the module functions the body calls, or passes to a call
that runs them, with the types of the arguments passed: they are hot too.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from syncless.lint.context import ModuleContext
from syncless.lint.declared_types import annotation_type
from syncless.lint.expression_rules import ExpressionRules
from syncless.lint.inference import Evaluator
from syncless.lint.lattice import Env, T, merge_must
from syncless.lint.scopes import FunctionInfo, terminal_name

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
_NESTED_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True)
class RawFinding:
    """A rule hit before suppression.

    ``lines`` is the span of the flagged code, where ``# syncless: ok`` counts;
    ``line_above`` is where ``# syncless: collective-ok`` also counts (collectives only).
    """

    rule: str
    line: int
    col: int
    text: str
    lines: tuple[int, ...]
    line_above: int | None = None


@dataclass(frozen=True)
class Edge:
    """A module function the hot function runs, with the argument types it passes."""

    fn: FunctionInfo
    params: dict[str, T]


@dataclass
class Analysis:
    """What checking one hot function produced."""

    findings: list[RawFinding] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    returns: T = T.NOT


class FunctionChecker:
    """Applies the hot-path rules to one function, given its parameter types."""

    def __init__(
        self,
        ctx: ModuleContext,
        fn: FunctionInfo,
        params: dict[str, T],
        returns: Callable[[FunctionInfo], T],
    ) -> None:
        self.ctx = ctx
        self.fn = fn
        self.params = params
        self.ev = Evaluator(ctx, fn, returns)
        self.rules = ExpressionRules(ctx, fn, self.ev, report=self._report, edge=self._edge)
        self.result = Analysis()
        self._returns: list[T] = []
        self._seen: set[tuple[str, int, int]] = set()
        self._statement: tuple[int, int] | None = None

    def run(self) -> Analysis:
        """Check the function body; returns findings, callees and the return type."""
        env = self._initial_env()
        node = self.fn.node
        if isinstance(node, ast.Lambda):
            self._expr(node.body, env)
            self._returns.append(self.ev.typeof(node.body, env))
        else:
            self._block(node.body, env)
        declared = None if isinstance(node, ast.Lambda) else annotation_type(node.returns)
        if declared is not None:
            self.result.returns = declared
        elif self._returns:
            returns = self._returns[0]
            for t in self._returns[1:]:
                returns = merge_must(returns, t)
            self.result.returns = returns
        return self.result

    def _initial_env(self) -> Env:
        args = self.fn.node.args
        binding = self.fn.self_binding()
        own_self = binding[0] if binding is not None and self.fn.owner is not None else None
        env: Env = {}
        for param in (*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs, args.kwarg):
            if param is None or param.arg == own_self:
                continue
            declared = annotation_type(param.annotation)
            env[param.arg] = declared or self.params.get(param.arg, T.UNKNOWN)
        return env

    # -- reporting -------------------------------------------------------------

    def _report(
        self, rule: str, node: ast.AST, text: str, *, header_only: bool = False, above: bool = False
    ) -> None:
        line, col = node.lineno, node.col_offset
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            # Point at the method name: `x.abs().max().item()` reports `item`.
            line = node.func.end_lineno or line
            col = (node.func.end_col_offset or col) - len(node.func.attr)
        key = (rule, line, col)
        if key in self._seen:
            return
        self._seen.add(key)
        start = node.lineno
        end = start if header_only else (getattr(node, "end_lineno", None) or start)
        if self._statement is not None and not header_only:
            # A suppression anywhere on the statement counts: `)  # syncless: ok ...`.
            start, end = min(start, self._statement[0]), max(end, self._statement[1])
        lines = tuple(range(start, end + 1))
        above_line = start - 1 if above else None
        self.result.findings.append(RawFinding(rule, line, col + 1, text, lines, above_line))

    def _edge(self, fn: FunctionInfo, params: dict[str, T] | None = None) -> None:
        self.result.edges.append(Edge(fn, params or {}))

    # -- statements --------------------------------------------------------------

    def _block(self, stmts: list[ast.stmt], env: Env) -> None:
        for stmt in stmts:
            outer = self._statement
            self._statement = _header_lines(stmt)
            handler = getattr(self, "_s_" + type(stmt).__name__, None)
            if handler is not None:
                handler(stmt, env)
            else:
                for child in ast.iter_child_nodes(stmt):
                    if isinstance(child, ast.expr):
                        self._expr(child, env)
            self._statement = outer

    def _merge_into(self, env: Env, branches: list[Env]) -> None:
        names = set().union(*branches)
        for name in names:
            types = [b.get(name, T.UNKNOWN) for b in branches]
            merged = types[0]
            for t in types[1:]:
                merged = merge_must(merged, t)
            env[name] = merged

    def _s_Return(self, stmt: ast.Return, env: Env) -> None:
        self._expr(stmt.value, env)
        self._returns.append(self.ev.typeof(stmt.value, env))

    def _s_Assign(self, stmt: ast.Assign, env: Env) -> None:
        self._expr(stmt.value, env)
        shape = self.ev.shape_of(stmt.value, env)
        for target in stmt.targets:
            self._target(target, env)
            self.ev.bind(target, shape, env)

    def _s_AugAssign(self, stmt: ast.AugAssign, env: Env) -> None:
        self._expr(stmt.value, env)
        self._target(stmt.target, env)
        if isinstance(stmt.target, ast.Name):
            current = ast.Name(stmt.target.id, ast.Load())
            env[stmt.target.id] = self.ev.typeof(ast.BinOp(current, stmt.op, stmt.value), env)

    def _s_AnnAssign(self, stmt: ast.AnnAssign, env: Env) -> None:
        self._expr(stmt.value, env)
        self._target(stmt.target, env)
        if isinstance(stmt.target, ast.Name):
            declared = annotation_type(stmt.annotation)
            inferred = self.ev.typeof(stmt.value, env) if stmt.value is not None else T.UNKNOWN
            env[stmt.target.id] = declared or inferred

    def _s_If(self, stmt: ast.If, env: Env) -> None:
        self.rules.truthy(stmt.test, env, "`if`")
        self._expr(stmt.test, env)
        body, orelse = dict(env), dict(env)
        self._block(stmt.body, body)
        self._block(stmt.orelse, orelse)
        self._merge_into(env, [body, orelse])

    def _s_While(self, stmt: ast.While, env: Env) -> None:
        self.rules.truthy(stmt.test, env, "`while`")
        self._expr(stmt.test, env)
        body = dict(env)
        self._block(stmt.body, body)
        self._merge_into(env, [env, body])
        self._block(stmt.orelse, env)

    def _s_For(self, stmt: ast.For | ast.AsyncFor, env: Env) -> None:
        self._expr(stmt.iter, env)
        body = dict(env)
        self._target(stmt.target, body)
        self.ev.bind(stmt.target, self.ev.iter_shape(stmt.iter, env), body)
        self._block(stmt.body, body)
        self._merge_into(env, [env, body])
        self._block(stmt.orelse, env)

    _s_AsyncFor = _s_For

    def _s_With(self, stmt: ast.With | ast.AsyncWith, env: Env) -> None:
        for item in stmt.items:
            self._expr(item.context_expr, env)
            context = item.context_expr
            if isinstance(context, ast.Call) and (
                self.ctx.imports.dotted(context.func) == "contextlib.suppress"
                or terminal_name(context.func) == "suppress"
            ):
                self._report(
                    "SL009", context, "`contextlib.suppress` swallows exceptions", header_only=True
                )
            if item.optional_vars is not None:
                self._target(item.optional_vars, env)
                self.ev.bind(item.optional_vars, T.UNKNOWN, env)
        self._block(stmt.body, env)

    _s_AsyncWith = _s_With

    def _s_Try(self, stmt: ast.Try, env: Env) -> None:
        body = dict(env)
        self._block(stmt.body, body)
        self._block(stmt.orelse, body)
        branches = [body]
        for handler in stmt.handlers:
            self._expr(handler.type, env)
            if not _raises(handler.body):
                self._report(
                    "SL009",
                    handler,
                    "`except` without `raise` swallows the exception",
                    header_only=True,
                )
            branch = dict(env)
            if handler.name:
                branch[handler.name] = T.NOT
            self._block(handler.body, branch)
            branches.append(branch)
        self._merge_into(env, branches)
        self._block(stmt.finalbody, env)

    _s_TryStar = _s_Try

    def _s_Assert(self, stmt: ast.Assert, env: Env) -> None:
        self.rules.truthy(stmt.test, env, "`assert`")
        self._expr(stmt.test, env)
        self._expr(stmt.msg, env)

    def _s_Match(self, stmt: ast.Match, env: Env) -> None:
        self._expr(stmt.subject, env)
        branches = []
        for case in stmt.cases:
            branch = dict(env)
            for node in ast.walk(case.pattern):
                # Capture patterns bind names whose types are not tracked.
                for bound in (getattr(node, "name", None), getattr(node, "rest", None)):
                    if isinstance(bound, str):
                        branch[bound] = T.UNKNOWN
            if case.guard is not None:
                self.rules.truthy(case.guard, branch, "`case` guard")
                self._expr(case.guard, branch)
            self._block(case.body, branch)
            branches.append(branch)
        self._merge_into(env, [env, *branches])

    def _s_FunctionDef(self, stmt: ast.FunctionDef | ast.AsyncFunctionDef, env: Env) -> None:
        # The nested body is its own function: hot only if this one uses it.
        for expr in (*stmt.decorator_list, *stmt.args.defaults, *stmt.args.kw_defaults):
            self._expr(expr, env)
        # Not a local value: calls and references resolve it to the function.
        env.pop(stmt.name, None)

    _s_AsyncFunctionDef = _s_FunctionDef

    def _s_ClassDef(self, stmt: ast.ClassDef, env: Env) -> None:
        env[stmt.name] = T.NOT

    def _s_Delete(self, stmt: ast.Delete, env: Env) -> None:
        for target in stmt.targets:
            self._target(target, env)
            if isinstance(target, ast.Name):
                env.pop(target.id, None)

    def _target(self, target: ast.expr, env: Env) -> None:
        """Check the expressions inside an assignment target (``x[mask] = 0``)."""
        if isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self._target(elt, env)
        elif isinstance(target, ast.Starred):
            self._target(target.value, env)
        elif isinstance(target, (ast.Subscript, ast.Attribute)):
            self._expr(target, env)

    # -- expressions -------------------------------------------------------------

    def _expr(self, node: ast.expr | None, env: Env) -> None:
        if node is None:
            return
        if isinstance(node, ast.Lambda):
            # Its body is its own function: hot when called or passed to a call.
            for default in (*node.args.defaults, *node.args.kw_defaults):
                self._expr(default, env)
            return
        if isinstance(node, _COMPREHENSIONS):
            self._comprehension(node, env)
            return
        if isinstance(node, ast.NamedExpr):
            self._expr(node.value, env)
            env[node.target.id] = self.ev.typeof(node.value, env)
            return
        self.rules.check(node, env)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.keyword):
                child = child.value
            if isinstance(child, ast.expr):
                self._expr(child, env)

    def _comprehension(self, node: ast.expr, env: Env) -> None:
        inner = dict(env)
        for gen in node.generators:
            self._expr(gen.iter, inner)
            self.ev.bind(gen.target, self.ev.iter_shape(gen.iter, inner), inner)
            for condition in gen.ifs:
                self.rules.truthy(condition, inner, "comprehension filter")
                self._expr(condition, inner)
        if isinstance(node, ast.DictComp):
            self._expr(node.key, inner)
            self._expr(node.value, inner)
        else:
            self._expr(node.elt, inner)


def _header_lines(stmt: ast.stmt) -> tuple[int, int]:
    """The lines of a simple statement, or of a compound statement's header."""
    body = getattr(stmt, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        return stmt.lineno, max(stmt.lineno, body[0].lineno - 1)
    return stmt.lineno, stmt.end_lineno or stmt.lineno


def _raises(stmts: list[ast.stmt]) -> bool:
    """Whether a ``raise`` appears in ``stmts`` outside nested functions and classes."""
    stack: list[ast.AST] = list(stmts)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Raise):
            return True
        if not isinstance(node, _NESTED_SCOPES):
            stack.extend(ast.iter_child_nodes(node))
    return False
