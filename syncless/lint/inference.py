"""Expression type inference: is an expression a tensor, and is it a boolean one?

:class:`Evaluator` gives the lattice type (:mod:`syncless.lint.lattice`) of an
expression from the local types in scope, the types of ``self`` attributes, the
return types of module functions it calls and what torch's API is known to return
(:mod:`syncless.lint.torchapi`). It also binds assignment targets, so a checker can
keep the local types up to date as it walks a function.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Protocol

from syncless.lint import torchapi
from syncless.lint.imports import ImportTable
from syncless.lint.lattice import Env, Shape, T, element_of, holds_tensor, is_tensor, merge_must
from syncless.lint.resolver import Resolver, Target
from syncless.lint.scopes import ClassInfo, FunctionInfo

_NOT_BUILTINS = frozenset(
    {
        "len", "isinstance", "issubclass", "hasattr", "callable", "id", "hash", "str",
        "repr", "format", "int", "float", "bool", "complex", "range", "print", "type",
        "enumerate", "zip", "dict", "set", "frozenset", "any", "all", "ord", "chr",
    }
)  # fmt: skip
_NOT_MODULES = ("math.", "numpy.", "os.", "time.", "json.", "re.")


class ModuleFacts(Protocol):
    """What the evaluator reads of the module around an expression
    (:class:`~syncless.lint.context.ModuleContext` has it all)."""

    imports: ImportTable
    resolver: Resolver
    module_env: dict[str, T]

    def attribute_type(self, cls: ClassInfo, attr: str) -> T: ...


class Evaluator:
    """Infers expression types inside one function (or at module level).

    ``returns`` gives the inferred return type of a module function called from here.
    """

    def __init__(
        self,
        ctx: ModuleFacts,
        scope: FunctionInfo | None,
        returns: Callable[[FunctionInfo], T],
    ) -> None:
        self.ctx = ctx
        self.scope = scope
        self.returns = returns
        self.binding = scope.self_binding() if scope is not None else None

    def typeof(self, node: ast.expr | None, env: Env) -> T:
        """The type of ``node`` given the local types in ``env``."""
        if node is None:
            return T.NOT
        method = getattr(self, "_t_" + type(node).__name__, None)
        return method(node, env) if method is not None else T.UNKNOWN

    def call_targets(self, call: ast.Call) -> list[Target]:
        """The module functions a call can run (``f(x)``, ``self.m(x)``, ``C.m(x)``)."""
        return self.ctx.resolver.resolve(call.func, self.scope)

    # -- binding ---------------------------------------------------------------

    def bind(self, target: ast.expr, value: Shape, env: Env) -> None:
        """Bind the names in an assignment target to ``value``'s type(s)."""
        if isinstance(target, ast.Name):
            env[target.id] = value if isinstance(value, T) else T.UNKNOWN
        elif isinstance(target, ast.Starred):
            self.bind(target.value, value if isinstance(value, T) else T.UNKNOWN, env)
        elif isinstance(target, (ast.Tuple, ast.List)):
            elts = target.elts
            if (
                isinstance(value, tuple)
                and len(value) == len(elts)
                and not any(isinstance(e, ast.Starred) for e in elts)
            ):
                for elt, part in zip(elts, value, strict=True):
                    self.bind(elt, part, env)
                return
            item = element_of(value) if isinstance(value, T) else T.UNKNOWN
            for elt in elts:
                if isinstance(elt, ast.Starred):
                    rest = T.SEQ if is_tensor(item) else item
                    self.bind(elt.value, rest, env)
                else:
                    self.bind(elt, item, env)

    def shape_of(self, node: ast.expr, env: Env) -> Shape:
        """Like :meth:`typeof`, but a tuple display keeps one type per element."""
        if isinstance(node, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return tuple(self.shape_of(e, env) for e in node.elts)
        return self.typeof(node, env)

    def iter_shape(self, iterable: ast.expr, env: Env) -> Shape:
        """The type of one item when iterating ``iterable`` (``for x in iterable``)."""
        if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name):
            name, args = iterable.func.id, iterable.args
            if name == "enumerate" and args:
                return (T.NOT, self.iter_shape(args[0], env))
            if name == "zip":
                return tuple(self.iter_shape(a, env) for a in args)
            if name == "range":
                return T.NOT
            if name in ("reversed", "sorted", "list", "tuple") and args:
                return self.iter_shape(args[0], env)
        if isinstance(iterable, (ast.Tuple, ast.List, ast.Set)):
            types = [self.typeof(e, env) for e in iterable.elts]
            if not types:
                return T.UNKNOWN
            result = types[0]
            for t in types[1:]:
                result = merge_must(result, t)
            return result
        return element_of(self.typeof(iterable, env))

    def comprehension_env(self, generators: list[ast.comprehension], env: Env) -> Env:
        """``env`` extended with the loop variables of a comprehension."""
        inner = dict(env)
        for gen in generators:
            self.bind(gen.target, self.iter_shape(gen.iter, inner), inner)
        return inner

    # -- expressions -------------------------------------------------------------

    def _t_Constant(self, node: ast.Constant, env: Env) -> T:
        return T.NOT

    def _t_JoinedStr(self, node: ast.JoinedStr, env: Env) -> T:
        return T.NOT

    def _t_Lambda(self, node: ast.Lambda, env: Env) -> T:
        return T.NOT

    def _t_Name(self, node: ast.Name, env: Env) -> T:
        if node.id in env:
            return env[node.id]
        return self.ctx.module_env.get(node.id, T.UNKNOWN)

    def _t_Attribute(self, node: ast.Attribute, env: Env) -> T:
        if node.attr in torchapi.NON_TENSOR_ATTRS:
            return T.NOT
        base = node.value
        if (
            isinstance(base, ast.Name)
            and self.binding is not None
            and base.id == self.binding[0]
            and base.id not in env
        ):
            return self.ctx.attribute_type(self.binding[1], node.attr)
        base_type = self.typeof(base, env)
        if is_tensor(base_type) and node.attr in torchapi.TENSOR_ATTRS:
            return base_type if node.attr in ("T", "mT", "data") else T.TENSOR
        if base_type is T.SEQ and node.attr in ("values", "indices"):
            return T.TENSOR
        return T.UNKNOWN

    def _t_Subscript(self, node: ast.Subscript, env: Env) -> T:
        base = self.typeof(node.value, env)
        if is_tensor(base):
            return base
        if base is T.SEQ:
            return T.SEQ if isinstance(node.slice, ast.Slice) else T.TENSOR
        return T.NOT if base is T.NOT else T.UNKNOWN

    def _t_Starred(self, node: ast.Starred, env: Env) -> T:
        return self.typeof(node.value, env)

    def _t_NamedExpr(self, node: ast.NamedExpr, env: Env) -> T:
        return self.typeof(node.value, env)

    def _t_BinOp(self, node: ast.BinOp, env: Env) -> T:
        if isinstance(node.op, ast.Mod) and is_string(node.left):
            return T.NOT
        left, right = self.typeof(node.left, env), self.typeof(node.right, env)
        if isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)) and T.BOOL in (left, right):
            other = right if left is T.BOOL else left
            return T.BOOL if other in (T.BOOL, T.UNKNOWN) else T.TENSOR
        if is_tensor(left) or is_tensor(right):
            return T.TENSOR
        if T.SEQ in (left, right) and isinstance(node.op, (ast.Add, ast.Mult)):
            return T.SEQ
        return T.NOT if left is T.NOT and right is T.NOT else T.UNKNOWN

    def _t_UnaryOp(self, node: ast.UnaryOp, env: Env) -> T:
        if isinstance(node.op, ast.Not):
            return T.NOT
        return self.typeof(node.operand, env)

    def _t_BoolOp(self, node: ast.BoolOp, env: Env) -> T:
        result = self.typeof(node.values[0], env)
        for value in node.values[1:]:
            result = merge_must(result, self.typeof(value, env))
        return result

    def _t_Compare(self, node: ast.Compare, env: Env) -> T:
        if all(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in node.ops):
            return T.NOT
        types = [self.typeof(e, env) for e in (node.left, *node.comparators)]
        if any(is_tensor(t) for t in types):
            return T.BOOL
        return T.NOT if all(t is T.NOT for t in types) else T.UNKNOWN

    def _t_IfExp(self, node: ast.IfExp, env: Env) -> T:
        return merge_must(self.typeof(node.body, env), self.typeof(node.orelse, env))

    def _t_Tuple(self, node: ast.Tuple | ast.List, env: Env) -> T:
        # SEQ promises that every element is a tensor: unpacking it yields tensors.
        types = [self.typeof(e, env) for e in node.elts]
        if types and all(is_tensor(t) for t in types):
            return T.SEQ
        return T.NOT if types and all(t is T.NOT for t in types) else T.UNKNOWN

    _t_List = _t_Tuple

    def _t_ListComp(self, node: ast.ListComp | ast.GeneratorExp, env: Env) -> T:
        inner = self.comprehension_env(node.generators, env)
        return T.SEQ if is_tensor(self.typeof(node.elt, inner)) else T.UNKNOWN

    _t_GeneratorExp = _t_ListComp

    def _t_Call(self, node: ast.Call, env: Env) -> T:
        func = node.func
        dotted = self.ctx.imports.dotted(func)
        if dotted is not None:
            if dotted == "torch" or dotted.startswith("torch."):
                return self._torch_call(dotted, node, env)
            return T.NOT if dotted.startswith(_NOT_MODULES) else T.UNKNOWN
        if isinstance(func, ast.Name):
            builtin = self._builtin_call(func.id, node, env)
            if builtin is not None:
                return builtin
        targets = self.call_targets(node)
        if targets:
            result = self.returns(targets[0].fn)
            for target in targets[1:]:
                result = merge_must(result, self.returns(target.fn))
            return result
        if isinstance(func, ast.Attribute):
            return self._method_call(func.attr, func.value, node, env)
        return T.UNKNOWN

    def _builtin_call(self, name: str, node: ast.Call, env: Env) -> T | None:
        args = node.args
        if name in _NOT_BUILTINS:
            return T.NOT
        if name in ("abs", "round") and args:
            return T.TENSOR if is_tensor(self.typeof(args[0], env)) else T.UNKNOWN
        if name in ("sum", "max", "min") and len(args) == 1:
            return T.TENSOR if holds_tensor(self.typeof(args[0], env)) else T.UNKNOWN
        if name in ("max", "min") and args:
            types = [self.typeof(a, env) for a in args]
            return T.TENSOR if all(is_tensor(t) for t in types) else T.UNKNOWN
        if name in ("tuple", "list", "sorted") and args:
            return T.SEQ if holds_tensor(self.typeof(args[0], env)) else T.UNKNOWN
        return None

    def _method_call(self, method: str, receiver: ast.expr, node: ast.Call, env: Env) -> T:
        if method in torchapi.NON_TENSOR_METHODS:
            return T.NOT
        receiver_type = self.typeof(receiver, env)
        if is_tensor(receiver_type) or (
            receiver_type is T.UNKNOWN and method in torchapi.GENERIC_TENSOR_METHODS
        ):
            if method.startswith("is_"):
                return T.NOT
            return self._tensor_result(method, node, env, first_arg=0)
        if receiver_type is T.SEQ and method in ("index", "count"):
            return T.NOT
        return T.UNKNOWN

    def _torch_call(self, dotted: str, node: ast.Call, env: Env) -> T:
        namespace, _, name = dotted.rpartition(".")
        if dotted in torchapi.TENSOR_TORCH_CONSTRUCTORS:
            return T.TENSOR
        if namespace not in torchapi.TENSOR_TORCH_NAMESPACES:
            return T.UNKNOWN
        if name.startswith("_foreach_"):
            return T.SEQ
        if name.startswith("is_") or name in torchapi.NON_TENSOR_TORCH:
            return T.NOT
        if name in torchapi.NON_TENSOR_METHODS:
            return T.NOT
        if name.startswith("_") or name[:1].isupper():
            return T.UNKNOWN
        if name == "where" and len(node.args) == 1 and not node.keywords:
            return T.SEQ
        return self._tensor_result(name, node, env, first_arg=1)

    def _tensor_result(self, name: str, node: ast.Call, env: Env, first_arg: int) -> T:
        """The type of tensor op ``name``; ``first_arg`` skips the input of ``torch.f(x, ...)``."""
        if name in torchapi.BOOL_METHODS:
            return T.BOOL
        if name in torchapi.SEQ_METHODS:
            return T.SEQ
        if name == "nonzero" and any(
            k.arg == "as_tuple" and _is_true(k.value) for k in node.keywords
        ):
            return T.SEQ
        if name in torchapi.DIM_SEQ_METHODS:
            if any(k.arg == "dim" for k in node.keywords):
                return T.SEQ
            rest = node.args[first_arg:]
            if rest and not is_tensor(self.typeof(rest[0], env)):
                return T.SEQ
        return T.TENSOR


def is_string(node: ast.expr) -> bool:
    """Whether ``node`` is a string literal or an f-string."""
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True
