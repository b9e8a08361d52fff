"""Resolution of callables: which of the module's functions can an expression run?

:class:`Resolver` turns an expression used as a callable (``f``, ``self._hook``,
``partial(f, 1)``, ``self._make_hook(i)``) into :class:`Target` functions of the
module's index (:mod:`syncless.lint.scopes`), with the parameters the call binds.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from syncless.lint.imports import ImportTable
from syncless.lint.scopes import ClassInfo, FunctionInfo, ModuleIndex

_MAX_DEPTH = 6  # factories of factories of partials: deeper chains are not followed


@dataclass(frozen=True)
class Target:
    """A function an expression can call, and how the call binds its parameters.

    ``offset`` leading positional parameters are already bound (``self``, positional
    ``functools.partial`` arguments) and ``bound`` names those bound by keyword.
    ``factory`` is the function whose call returned this one, if any.
    """

    fn: FunctionInfo
    offset: int = 0
    bound: frozenset[str] = frozenset()
    factory: FunctionInfo | None = None


class Resolver:
    """Resolves callable expressions to the module's functions."""

    def __init__(self, index: ModuleIndex, imports: ImportTable) -> None:
        self.index = index
        self.imports = imports

    def resolve(
        self,
        expr: ast.expr,
        scope: FunctionInfo | None,
        *,
        generous: bool = False,
        depth: int = 0,
    ) -> list[Target]:
        """The functions ``expr`` evaluates to when used as a callable.

        With ``generous``, ``obj.name`` on an object of unknown class resolves to every
        method called ``name`` in the module (used for hook registration, where the
        intent is unmistakable); otherwise only ``self.name``, ``cls.name``,
        ``ClassName.name`` and ``super().name`` resolve.
        """
        if depth > _MAX_DEPTH:
            return []
        if isinstance(expr, ast.Lambda):
            return [Target(self.index.by_node[expr])]
        if isinstance(expr, ast.Name):
            return self._resolve_name(expr.id, scope, generous, depth)
        if isinstance(expr, ast.Attribute):
            return self._resolve_attribute(expr, scope, generous)
        if isinstance(expr, ast.Call):
            return self._resolve_call(expr, scope, generous, depth)
        if isinstance(expr, ast.IfExp):
            return [
                *self.resolve(expr.body, scope, generous=generous, depth=depth + 1),
                *self.resolve(expr.orelse, scope, generous=generous, depth=depth + 1),
            ]
        if isinstance(expr, ast.BoolOp):
            return [
                t
                for value in expr.values
                for t in self.resolve(value, scope, generous=generous, depth=depth + 1)
            ]
        return []

    def returned(self, factory: FunctionInfo, *, generous: bool = False) -> list[Target]:
        """The functions ``factory`` returns (a closure, a lambda, a partial...)."""
        return [
            Target(t.fn, t.offset, t.bound, factory)
            for value in factory.returns
            for t in self.resolve(value, factory, generous=generous, depth=1)
        ]

    def _resolve_name(
        self, name: str, scope: FunctionInfo | None, generous: bool, depth: int
    ) -> list[Target]:
        found = self.index.lookup(name, scope)
        if isinstance(found, FunctionInfo):
            return [Target(found)]
        if isinstance(found, tuple):
            values, where = found
            return [
                t
                for value in values
                for t in self.resolve(value, where, generous=generous, depth=depth + 1)
            ]
        return []

    def _resolve_attribute(
        self, expr: ast.Attribute, scope: FunctionInfo | None, generous: bool
    ) -> list[Target]:
        base = expr.value
        binding = scope.self_binding() if scope is not None else None
        if isinstance(base, ast.Name):
            if binding is not None and base.id == binding[0]:
                method = self.index.find_method(binding[1], expr.attr)
                return [Target(method, method.instance_offset)] if method else []
            found = self.index.lookup(base.id, scope)
            if isinstance(found, ClassInfo):
                method = self.index.find_method(found, expr.attr)
                if method is None:
                    return []
                # Through the class, only a classmethod has its first parameter bound.
                return [Target(method, 1 if method.is_classmethod else 0)]
        if (
            isinstance(base, ast.Call)
            and isinstance(base.func, ast.Name)
            and base.func.id == "super"
            and binding is not None
        ):
            targets = []
            for base_name in binding[1].base_names:
                cls = self.index.class_named(base_name, None)
                method = self.index.find_method(cls, expr.attr) if cls else None
                if method is not None:
                    targets.append(Target(method, method.instance_offset))
            return targets
        if generous:
            return [
                Target(cls.methods[expr.attr], cls.methods[expr.attr].instance_offset)
                for cls in self.index.classes
                if expr.attr in cls.methods
            ]
        return []

    def _resolve_call(
        self, call: ast.Call, scope: FunctionInfo | None, generous: bool, depth: int
    ) -> list[Target]:
        func = call.func
        if self._is_partial(func) and call.args:
            positional = [a for a in call.args[1:] if not isinstance(a, ast.Starred)]
            keywords = frozenset(k.arg for k in call.keywords if k.arg)
            return [
                Target(t.fn, t.offset + len(positional), t.bound | keywords, t.factory)
                for t in self.resolve(call.args[0], scope, generous=generous, depth=depth + 1)
            ]
        if isinstance(func, ast.Name):
            found = self.index.lookup(func.id, scope)
            if isinstance(found, ClassInfo):
                # An instance used as a hook runs its __call__.
                method = self.index.find_method(found, "__call__")
                return [Target(method, 1)] if method else []
        targets = []
        for factory in self.resolve(func, scope, generous=generous, depth=depth + 1):
            for value in factory.fn.returns:
                for t in self.resolve(value, factory.fn, generous=generous, depth=depth + 1):
                    targets.append(Target(t.fn, t.offset, t.bound, t.factory or factory.fn))
        return targets

    def _is_partial(self, func: ast.expr) -> bool:
        if self.imports.dotted(func) == "functools.partial":
            return True
        return isinstance(func, ast.Name) and func.id == "partial"
