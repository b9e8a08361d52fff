"""The hot-path rules, applied to the body of one hot function.

:class:`FunctionChecker` walks a function's statements in order, keeping the
inferred type of each local name (merged at ``if``/``for``/``try`` joins), applies
rules SL001-SL010 to every expression, and records the module functions the body
calls, or passes to a call that runs them, with the types of the arguments passed:
they are hot too.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field

from syncless.lint import torchapi
from syncless.lint.context import ModuleContext
from syncless.lint.inference import (
    Env,
    Evaluator,
    T,
    annotation_type,
    holds_tensor,
    is_string,
    is_tensor,
    merge_must,
)
from syncless.lint.scopes import FunctionInfo, Target, terminal_name

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
        self._truthy(stmt.test, env, "`if`")
        self._expr(stmt.test, env)
        body, orelse = dict(env), dict(env)
        self._block(stmt.body, body)
        self._block(stmt.orelse, orelse)
        self._merge_into(env, [body, orelse])

    def _s_While(self, stmt: ast.While, env: Env) -> None:
        self._truthy(stmt.test, env, "`while`")
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
        self._truthy(stmt.test, env, "`assert`")
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
                self._truthy(case.guard, branch, "`case` guard")
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
        check = getattr(self, "_c_" + type(node).__name__, None)
        if check is not None:
            check(node, env)
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
                self._truthy(condition, inner, "comprehension filter")
                self._expr(condition, inner)
        if isinstance(node, ast.DictComp):
            self._expr(node.key, inner)
            self._expr(node.value, inner)
        else:
            self._expr(node.elt, inner)

    def _truthy(self, node: ast.expr, env: Env, what: str) -> None:
        """SL004 on ``node`` used as a condition (recursing through and/or/not)."""
        if isinstance(node, ast.BoolOp):
            for value in node.values:
                self._truthy(value, env, what)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self._truthy(node.operand, env, what)
        elif is_tensor(self.ev.typeof(node, env)):
            self._report("SL004", node, f"{what} on a tensor reads its value on the host")

    def _c_BoolOp(self, node: ast.BoolOp, env: Env) -> None:
        for value in node.values[:-1]:
            self._truthy(value, env, "`and`/`or`")

    def _c_UnaryOp(self, node: ast.UnaryOp, env: Env) -> None:
        if isinstance(node.op, ast.Not):
            self._truthy(node.operand, env, "`not`")

    def _c_IfExp(self, node: ast.IfExp, env: Env) -> None:
        self._truthy(node.test, env, "conditional expression")

    def _c_Subscript(self, node: ast.Subscript, env: Env) -> None:
        index = node.slice
        parts = index.elts if isinstance(index, ast.Tuple) else [index]
        if any(self.ev.typeof(p, env) is T.BOOL for p in parts):
            self._report("SL006", node, "boolean-mask indexing has a data-dependent shape")

    def _c_JoinedStr(self, node: ast.JoinedStr, env: Env) -> None:
        for value in node.values:
            if isinstance(value, ast.FormattedValue) and holds_tensor(
                self.ev.typeof(value.value, env)
            ):
                self._report("SL005", value.value, "f-string formats a tensor's values on the host")

    def _c_BinOp(self, node: ast.BinOp, env: Env) -> None:
        if not (isinstance(node.op, ast.Mod) and is_string(node.left)):
            return
        values = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
        if any(holds_tensor(self.ev.typeof(v, env)) for v in values):
            self._report("SL005", node, "`%` formatting of a tensor reads its values on the host")

    def _c_Attribute(self, node: ast.Attribute, env: Env) -> None:
        # Reading `self.prop` runs the property's getter.
        binding = self.ev.binding
        if (
            isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name)
            and binding is not None
            and node.value.id == binding[0]
            and node.value.id not in env
        ):
            method = self.ctx.index.find_method(binding[1], node.attr)
            if method is not None and method.is_property:
                self._edge(method)

    def _c_Call(self, node: ast.Call, env: Env) -> None:
        for target in self.ev.call_targets(node):
            self._edge(target.fn, self._call_params(target, node, env))
        func = node.func
        name = terminal_name(func)
        if name not in torchapi.DEFERRING_CALLS:
            # A function handed to a call runs now (`tree_map(f, out)`, `sorted(key=f)`),
            # unless the call only stores it for later (`pending.append(f)`).
            for arg in (*node.args, *(k.value for k in node.keywords)):
                value = arg.value if isinstance(arg, ast.Starred) else arg
                if isinstance(value, (ast.Name, ast.Attribute, ast.Lambda, ast.Call)):
                    for target in self.ctx.resolver.resolve(value, self.fn):
                        self._edge(target.fn)
        if name is None:
            return
        dotted = self.ctx.imports.dotted(func)
        on_torch = dotted is not None and (dotted == "torch" or dotted.startswith("torch."))
        is_method = isinstance(func, ast.Attribute) and dotted is None
        tensor_op = is_method or on_torch
        if isinstance(func, ast.Name):
            self._builtin_rules(name, node, env)
        self._host_rules(name, dotted, tensor_op, node, env)
        self._shape_rules(name, is_method, on_torch, node, env)
        self._format_rules(name, func, node, env)
        self._collective_rules(name, dotted, func, node)
        if name.startswith("declare"):
            self._report("SL008", node, f"`{name}()` changes the metric schema on the hot path")

    def _host_rules(
        self, name: str, dotted: str | None, tensor_op: bool, node: ast.Call, env: Env
    ) -> None:
        if name == "item" and tensor_op and not node.args and not node.keywords:
            self._report("SL001", node, "`.item()` copies a tensor value to the host")
        elif name in torchapi.HOST_COPY_METHODS and tensor_op:
            self._report("SL002", node, f"`.{name}()` copies a tensor to the host")
        elif name == "to" and tensor_op and _targets_cpu(node, self.ctx):
            self._report("SL002", node, "`.to('cpu')` copies a tensor to the host")
        elif name == "is_nonzero" and tensor_op:
            self._report("SL003", node, "`.is_nonzero()` converts a tensor to a Python bool")
        elif name == "synchronize" and (tensor_op or dotted is None):
            self._report("SL010", node, "`synchronize()` blocks the host until the device is idle")
        elif (
            dotted in ("numpy.array", "numpy.asarray", "numpy.asanyarray")
            and node.args
            and holds_tensor(self.ev.typeof(node.args[0], env))
        ):
            self._report("SL002", node, f"`{dotted}()` of a tensor copies it to the host")
        elif (
            dotted is not None
            and dotted.startswith("math.")
            and any(is_tensor(self.ev.typeof(a, env)) for a in node.args)
        ):
            self._report("SL003", node, f"`{dotted}()` of a tensor converts it on the host")

    def _builtin_rules(self, name: str, node: ast.Call, env: Env) -> None:
        args = node.args
        types = [self.ev.typeof(a, env) for a in args]
        if name in ("int", "float", "bool", "complex") and len(args) == 1 and is_tensor(types[0]):
            self._report("SL003", node, f"`{name}()` of a tensor converts it on the host")
        elif name == "range" and any(is_tensor(t) for t in types):
            self._report("SL003", node, "`range()` of a tensor converts it on the host")
        elif name in ("max", "min", "sorted", "any", "all") and _compares_tensors(node, types):
            verb = "tests" if name in ("any", "all") else "compares"
            self._report("SL004", node, f"builtin `{name}()` {verb} tensors on the host")
        elif name == "print" and any(holds_tensor(t) for t in types):
            self._report("SL005", node, "`print()` of a tensor formats its values on the host")
        elif name in ("str", "repr", "format") and args and holds_tensor(types[0]):
            self._report("SL005", node, f"`{name}()` of a tensor formats its values on the host")

    def _format_rules(self, name: str, func: ast.expr, node: ast.Call, env: Env) -> None:
        if not isinstance(func, ast.Attribute):
            return
        values = [*node.args, *(k.value for k in node.keywords)]
        if not any(holds_tensor(self.ev.typeof(v, env)) for v in values):
            return
        receiver = func.value
        if name == "format" and (
            is_string(receiver) or (isinstance(receiver, ast.Name) and receiver.id == "str")
        ):
            self._report("SL005", node, "`str.format()` of a tensor formats its values on the host")
        elif name in torchapi.LOG_METHODS and "log" in (terminal_name(receiver) or "").lower():
            self._report("SL005", node, "logging a tensor formats its values on the host")

    def _shape_rules(
        self, name: str, is_method: bool, on_torch: bool, node: ast.Call, env: Env
    ) -> None:
        if not (is_method or on_torch):
            return
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if name in ("equal", "allclose"):
            self._report("SL006", node, f"`{name}()` returns a Python bool read from the device")
        elif name in torchapi.DATA_DEPENDENT:
            self._report("SL006", node, f"`{name}()` has a data-dependent output shape")
        elif name == "repeat_interleave" and "output_size" not in keywords:
            args = node.args if is_method else node.args[1:]
            if not is_method and not args and "repeats" not in keywords:
                repeats_tensor = True  # torch.repeat_interleave(counts)
            else:
                repeats = keywords.get("repeats", args[0] if args else None)
                repeats_tensor = repeats is not None and is_tensor(self.ev.typeof(repeats, env))
            if repeats_tensor:
                self._report(
                    "SL006",
                    node,
                    "`repeat_interleave()` with tensor repeats has a data-dependent shape",
                )
        elif name == "where" and on_torch and len(node.args) == 1 and not node.keywords:
            self._report("SL006", node, "one-argument `torch.where()` has a data-dependent shape")

    def _collective_rules(
        self, name: str, dotted: str | None, func: ast.expr, node: ast.Call
    ) -> None:
        if name in torchapi.AMBIGUOUS_COLLECTIVES:
            if not _on_process_group(dotted, func):
                return
        elif name not in torchapi.COLLECTIVES:
            return
        text = f"collective `{name}()` makes every rank wait on the hot path"
        self._report("SL007", node, text, above=True)

    def _call_params(self, target: Target, call: ast.Call, env: Env) -> dict[str, T]:
        fn = target.fn
        params = [p for p in fn.positional_params[target.offset :] if p.arg not in target.bound]
        vararg = fn.node.args.vararg
        types: dict[str, T] = {}
        for i, arg in enumerate(call.args):
            if isinstance(arg, ast.Starred):
                break
            t = self.ev.typeof(arg, env)
            if i < len(params):
                types[params[i].arg] = t
            elif vararg is not None and holds_tensor(t):
                types[vararg.arg] = T.SEQ
        names = fn.param_names - target.bound
        for keyword in call.keywords:
            if keyword.arg in names:
                types[keyword.arg] = self.ev.typeof(keyword.value, env)
        return types


def _on_process_group(dotted: str | None, func: ast.expr) -> bool:
    """Whether a call is ``torch.distributed.<f>`` or ``<group-like name>.<f>``."""
    if dotted is not None and dotted.startswith("torch.distributed"):
        return True
    receiver = terminal_name(func.value) if isinstance(func, ast.Attribute) else None
    return receiver is not None and (
        receiver in torchapi.DIST_RECEIVERS or receiver.endswith(("_pg", "_group"))
    )


def _compares_tensors(call: ast.Call, types: list[T]) -> bool:
    """Whether builtin ``max``/``min``/``sorted``/``any``/``all`` compares or tests tensors.

    With ``key=`` the keys are compared instead, and they are not typed.
    """
    if any(k.arg == "key" for k in call.keywords):
        return False
    if len(types) == 1:
        return holds_tensor(types[0])
    return any(is_tensor(t) for t in types)


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


def _targets_cpu(call: ast.Call, ctx: ModuleContext) -> bool:
    """Whether ``x.to(...)`` names the CPU as its device."""
    candidates = [*call.args[:1], *(k.value for k in call.keywords if k.arg == "device")]
    for value in candidates:
        if isinstance(value, ast.Call) and ctx.imports.dotted(value.func) == "torch.device":
            value = value.args[0] if value.args else value
        if (
            isinstance(value, ast.Constant)
            and isinstance(value.value, str)
            and value.value.split(":")[0] == "cpu"
        ):
            return True
    return False
