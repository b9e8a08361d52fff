"""Index of one module's functions and classes.

The index is lexical: every ``def`` and ``lambda`` becomes a :class:`FunctionInfo`
that knows its enclosing function, the class whose body defines it, the functions and
classes it defines, the values it assigns to plain names, what it returns and the calls
in its own body (not in nested functions). :mod:`syncless.lint.resolver` uses it to
turn a callable expression into the functions it can run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def terminal_name(expr: ast.expr) -> str | None:
    """``f`` for ``f``, ``m`` for ``a.b.m``, ``d`` for ``a.d()``'s func; else None."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Call):
        return terminal_name(expr.func)
    return None


@dataclass(eq=False)
class ClassInfo:
    """A class definition and the functions its body defines."""

    node: ast.ClassDef
    qualname: str
    methods: dict[str, FunctionInfo] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The class name."""
        return self.node.name

    @property
    def base_names(self) -> list[str]:
        """Terminal names of the bases (``nn.Module`` gives ``Module``)."""
        return [n for n in (terminal_name(b) for b in self.node.bases) if n]


@dataclass(eq=False)
class FunctionInfo:
    """One ``def`` or ``lambda`` and what the linter needs to know about its body."""

    node: FunctionNode
    name: str
    qualname: str
    parent: FunctionInfo | None
    owner: ClassInfo | None
    local_defs: dict[str, FunctionInfo] = field(default_factory=dict)
    local_classes: dict[str, ClassInfo] = field(default_factory=dict)
    assignments: dict[str, list[ast.expr]] = field(default_factory=dict)
    returns: list[ast.expr] = field(default_factory=list)
    calls: list[ast.Call] = field(default_factory=list)

    @property
    def is_lambda(self) -> bool:
        """Whether this is a ``lambda``."""
        return isinstance(self.node, ast.Lambda)

    @property
    def decorator_names(self) -> list[str]:
        """Terminal names of the decorators (``@syncless.hot_path`` gives ``hot_path``)."""
        if isinstance(self.node, ast.Lambda):
            return []
        return [n for n in (terminal_name(d) for d in self.node.decorator_list) if n]

    @property
    def is_staticmethod(self) -> bool:
        """Whether this is a method decorated ``@staticmethod``."""
        return self.owner is not None and "staticmethod" in self.decorator_names

    @property
    def is_classmethod(self) -> bool:
        """Whether this is a method decorated ``@classmethod``."""
        return self.owner is not None and "classmethod" in self.decorator_names

    @property
    def is_property(self) -> bool:
        """Whether this is a method decorated ``@property`` or ``@cached_property``."""
        names = self.decorator_names
        return self.owner is not None and ("property" in names or "cached_property" in names)

    @property
    def positional_params(self) -> list[ast.arg]:
        """Parameters that can be passed by position, in order."""
        args = self.node.args
        return [*args.posonlyargs, *args.args]

    @property
    def param_names(self) -> set[str]:
        """Every parameter name, including ``*args``, keyword-only and ``**kwargs``."""
        args = self.node.args
        names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        names.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
        return names

    @property
    def instance_offset(self) -> int:
        """Leading parameters bound when called through an instance (1 for ``self``)."""
        return 0 if self.owner is None or self.is_staticmethod else 1

    def self_binding(self) -> tuple[str, ClassInfo] | None:
        """The name that means "the instance" here and its class.

        A method binds its first parameter; a closure defined in a method sees the
        method's binding unless it rebinds the name.
        """
        if self.owner is not None and not self.is_staticmethod:
            params = self.positional_params
            return (params[0].arg, self.owner) if params else None
        if self.parent is None:
            return None
        binding = self.parent.self_binding()
        if binding is None or binding[0] in self.param_names:
            return None
        return binding

    def is_inside(self, other: FunctionInfo) -> bool:
        """Whether this function is defined (at any depth) inside ``other``."""
        scope = self.parent
        while scope is not None:
            if scope is other:
                return True
            scope = scope.parent
        return False


class ModuleIndex:
    """Every function and class of one parsed module, by scope."""

    def __init__(self, tree: ast.Module) -> None:
        self.functions: list[FunctionInfo] = []
        self.by_node: dict[ast.AST, FunctionInfo] = {}
        self.classes: list[ClassInfo] = []
        self.defs: dict[str, FunctionInfo] = {}
        self.module_classes: dict[str, ClassInfo] = {}
        self.assignments: dict[str, list[ast.expr]] = {}
        self.calls: list[ast.Call] = []
        for child in tree.body:
            self._visit(child, None, None, "")

    def iter_calls(self) -> Iterator[tuple[ast.Call, FunctionInfo | None]]:
        """Every call with the function whose own body contains it (None: module)."""
        for call in self.calls:
            yield call, None
        for fn in self.functions:
            for call in fn.calls:
                yield call, fn

    def class_named(self, name: str, scope: FunctionInfo | None) -> ClassInfo | None:
        """The class ``name`` refers to in ``scope``, falling back to any class so named."""
        found = self.lookup(name, scope)
        if isinstance(found, ClassInfo):
            return found
        return next((c for c in self.classes if c.name == name), None)

    def find_method(self, cls: ClassInfo, name: str) -> FunctionInfo | None:
        """``name`` on ``cls`` or, depth first, on its bases defined in this module."""
        seen: set[int] = set()
        stack = [cls]
        while stack:
            current = stack.pop(0)
            if id(current) in seen:
                continue
            seen.add(id(current))
            if name in current.methods:
                return current.methods[name]
            stack.extend(
                base
                for base in (self.class_named(b, None) for b in current.base_names)
                if base is not None
            )
        return None

    def lookup(
        self, name: str, scope: FunctionInfo | None
    ) -> FunctionInfo | ClassInfo | tuple[list[ast.expr], FunctionInfo | None] | None:
        """What ``name`` is bound to in ``scope``, searching enclosing scopes outwards.

        Returns a function, a class, or the expressions assigned to the name with the
        scope they belong to; None for parameters and unknown names.
        """
        current = scope
        while current is not None:
            if name in current.local_defs:
                return current.local_defs[name]
            if name in current.local_classes:
                return current.local_classes[name]
            if name in current.assignments:
                return current.assignments[name], current
            if name in current.param_names:
                return None
            current = current.parent
        if name in self.defs:
            return self.defs[name]
        if name in self.module_classes:
            return self.module_classes[name]
        if name in self.assignments:
            return self.assignments[name], None
        return None

    def _visit(
        self,
        node: ast.AST,
        fn: FunctionInfo | None,
        cls: ClassInfo | None,
        prefix: str,
    ) -> None:
        if isinstance(node, (*_DEFS, ast.Lambda)):
            self._add_function(node, fn, cls, prefix)
            return
        if isinstance(node, ast.ClassDef):
            self._add_class(node, fn, prefix)
            return
        if cls is None:
            self._record(node, fn)
        for child in ast.iter_child_nodes(node):
            self._visit(child, fn, cls, prefix)

    def _record(self, node: ast.AST, fn: FunctionInfo | None) -> None:
        assignments = fn.assignments if fn is not None else self.assignments
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assignments.setdefault(target.id, []).append(node.value)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
            if isinstance(node.target, ast.Name) and node.value is not None:
                assignments.setdefault(node.target.id, []).append(node.value)
        elif isinstance(node, ast.Return) and fn is not None and node.value is not None:
            fn.returns.append(node.value)
        elif isinstance(node, ast.Call):
            (fn.calls if fn is not None else self.calls).append(node)

    def _add_function(
        self,
        node: FunctionNode,
        fn: FunctionInfo | None,
        cls: ClassInfo | None,
        prefix: str,
    ) -> None:
        name = "<lambda>" if isinstance(node, ast.Lambda) else node.name
        owner = None if isinstance(node, ast.Lambda) else cls
        info = FunctionInfo(node, name, prefix + name, parent=fn, owner=owner)
        self.functions.append(info)
        self.by_node[node] = info
        if not isinstance(node, ast.Lambda):
            if cls is not None:
                cls.methods[name] = info
            elif fn is not None:
                fn.local_defs[name] = info
            else:
                self.defs[name] = info
        # Decorators and defaults run in the enclosing scope, not in the new function.
        outer: list[ast.AST] = [*node.args.defaults, *node.args.kw_defaults]
        if not isinstance(node, ast.Lambda):
            outer.extend(node.decorator_list)
        for child in outer:
            if child is not None:
                self._visit(child, fn, cls, prefix)
        inner_prefix = info.qualname + ".<locals>."
        if isinstance(node, ast.Lambda):
            info.returns.append(node.body)
        body = [node.body] if isinstance(node, ast.Lambda) else node.body
        for child in body:
            self._visit(child, info, None, inner_prefix)

    def _add_class(self, node: ast.ClassDef, fn: FunctionInfo | None, prefix: str) -> None:
        info = ClassInfo(node, prefix + node.name)
        self.classes.append(info)
        if fn is not None:
            fn.local_classes[node.name] = info
        else:
            self.module_classes[node.name] = info
        for child in [*node.bases, *node.decorator_list]:
            self._visit(child, fn, None, prefix)
        for child in node.body:
            self._visit(child, fn, info, info.qualname + ".")
