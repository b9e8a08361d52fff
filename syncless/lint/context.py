"""Everything the rules need to know about one module, computed once per file."""

from __future__ import annotations

import ast

from syncless.lint.declared_types import annotation_type
from syncless.lint.imports import ImportTable
from syncless.lint.inference import Evaluator
from syncless.lint.lattice import T, merge_must
from syncless.lint.resolver import Resolver
from syncless.lint.scopes import ClassInfo, ModuleIndex


class ModuleContext:
    """The parsed module with its index, imports, resolver and attribute types."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.index = ModuleIndex(tree)
        self.imports = ImportTable.from_tree(tree)
        self.resolver = Resolver(self.index, self.imports)
        self.module_env: dict[str, T] = {}
        self._attributes: dict[int, dict[str, T]] = {}
        self._computing: set[int] = set()
        evaluator = Evaluator(self, None, lambda fn: T.UNKNOWN)
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    evaluator.bind(target, evaluator.typeof(stmt.value, {}), self.module_env)

    def attribute_type(self, cls: ClassInfo, attr: str) -> T:
        """The type of ``self.<attr>`` in methods of ``cls`` (and its in-module bases).

        Taken from every ``self.attr = value`` in the class's methods, every
        ``self.register_buffer("attr", value)`` and class-level annotations; the
        values are typed without local context, so ``self.buf = torch.zeros(3)``
        counts and ``self.buf = t`` does not. Assignments of None are skipped (the
        "not yet set" idiom); disagreeing assignments give UNKNOWN.
        """
        types = self._class_attributes(cls)
        if attr in types:
            return types[attr]
        for base_name in cls.base_names:
            base = self.index.class_named(base_name, None)
            if base is not None and base is not cls and attr in self._class_attributes(base):
                return self._class_attributes(base)[attr]
        method = self.index.find_method(cls, attr)
        if method is None or method.is_property:
            return T.UNKNOWN
        return T.NOT  # a bound method

    def _class_attributes(self, cls: ClassInfo) -> dict[str, T]:
        key = id(cls)
        if key in self._attributes:
            return self._attributes[key]
        if key in self._computing:
            return {}
        self._computing.add(key)
        found: dict[str, list[T]] = {}
        for stmt in cls.node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                declared = annotation_type(stmt.annotation)
                if declared is not None:
                    found.setdefault(stmt.target.id, []).append(declared)
        for method in cls.methods.values():
            binding = method.self_binding()
            if binding is None:
                continue
            evaluator = Evaluator(self, method, lambda fn: T.UNKNOWN)
            for attr, value, annotation in _self_assignments(method.node, binding[0]):
                declared = annotation_type(annotation)
                if declared is not None:
                    found.setdefault(attr, []).append(declared)
                elif not (isinstance(value, ast.Constant) and value.value is None):
                    found.setdefault(attr, []).append(evaluator.typeof(value, {}))
        result = {}
        for attr, types in found.items():
            merged = types[0]
            for t in types[1:]:
                merged = merge_must(merged, t)
            result[attr] = merged
        self._computing.discard(key)
        self._attributes[key] = result
        return result


def _self_assignments(
    node: ast.AST, self_name: str
) -> list[tuple[str, ast.expr | None, ast.expr | None]]:
    """``(attr, value, annotation)`` for each ``self.attr = value`` in a method body."""
    found: list[tuple[str, ast.expr | None, ast.expr | None]] = []

    def is_self_attr(target: ast.expr) -> bool:
        return (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == self_name
        )

    for child in ast.walk(node):
        if isinstance(child, ast.Assign):
            for target in child.targets:
                if is_self_attr(target):
                    found.append((target.attr, child.value, None))
        elif isinstance(child, ast.AnnAssign) and is_self_attr(child.target):
            found.append((child.target.attr, child.value, child.annotation))
        elif (
            isinstance(child, ast.Call)
            and isinstance(child.func, ast.Attribute)
            and child.func.attr == "register_buffer"
            and is_self_attr(child.func)
            and len(child.args) >= 2
            and isinstance(child.args[0], ast.Constant)
            and isinstance(child.args[0].value, str)
        ):
            found.append((child.args[0].value, child.args[1], None))
    return found
