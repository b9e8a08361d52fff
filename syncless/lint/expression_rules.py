"""The hot-path rules that look at one expression: SL001-SL008 and SL010.

:class:`ExpressionRules` decides whether an expression breaks a rule: a tensor used as
a condition, a mask index, a tensor formatted into a string, and every rule on calls
(host copies, conversions, data-dependent shapes, schema changes, collectives).
:class:`~syncless.lint.checker.FunctionChecker` owns one per function: it walks the
statements and hands each expression it reaches to :meth:`ExpressionRules.check`.
"""

from __future__ import annotations

import ast
from typing import Protocol

from syncless.lint import torchapi
from syncless.lint.context import ModuleContext
from syncless.lint.inference import Evaluator, is_string
from syncless.lint.lattice import Env, T, holds_tensor, is_tensor
from syncless.lint.resolver import Target
from syncless.lint.scopes import FunctionInfo, terminal_name


class Report(Protocol):
    """Records a rule hit on ``node`` (the checker's ``_report``)."""

    def __call__(
        self, rule: str, node: ast.AST, text: str, *, header_only: bool = False, above: bool = False
    ) -> None: ...


class Edge(Protocol):
    """Records a module function the hot function runs (the checker's ``_edge``)."""

    def __call__(self, fn: FunctionInfo, params: dict[str, T] | None = None) -> None: ...


class ExpressionRules:
    """The per-expression rule checks of one hot function.

    Args:
        ctx: the module's context (its index, imports and resolver).
        fn: the function being checked.
        ev: the checker's evaluator, whose types follow the walk.
        report: records a finding.
        edge: records a hot callee.
    """

    def __init__(
        self, ctx: ModuleContext, fn: FunctionInfo, ev: Evaluator, *, report: Report, edge: Edge
    ) -> None:
        self.ctx = ctx
        self.fn = fn
        self.ev = ev
        self._report = report
        self._edge = edge

    def check(self, node: ast.expr, env: Env) -> None:
        """Apply the rules on ``node`` itself (not its children: the walk reaches them)."""
        check = getattr(self, "_c_" + type(node).__name__, None)
        if check is not None:
            check(node, env)

    def truthy(self, node: ast.expr, env: Env, what: str) -> None:
        """SL004 on ``node`` used as a condition (recursing through and/or/not)."""
        if isinstance(node, ast.BoolOp):
            for value in node.values:
                self.truthy(value, env, what)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self.truthy(node.operand, env, what)
        elif is_tensor(self.ev.typeof(node, env)):
            self._report("SL004", node, f"{what} on a tensor reads its value on the host")

    def _c_BoolOp(self, node: ast.BoolOp, env: Env) -> None:
        for value in node.values[:-1]:
            self.truthy(value, env, "`and`/`or`")

    def _c_UnaryOp(self, node: ast.UnaryOp, env: Env) -> None:
        if isinstance(node.op, ast.Not):
            self.truthy(node.operand, env, "`not`")

    def _c_IfExp(self, node: ast.IfExp, env: Env) -> None:
        self.truthy(node.test, env, "conditional expression")

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
