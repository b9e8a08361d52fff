"""Import aliases of one module: which local names stand for which dotted paths."""

from __future__ import annotations

import ast


class ImportTable:
    """Maps names bound by ``import`` statements to dotted paths.

    ``import torch.distributed as dist`` binds ``dist`` to ``torch.distributed``;
    ``from torch import where`` binds ``where`` to ``torch.where``. Imports anywhere in
    the module count, because hook code often imports inside functions. ``torch`` is
    recognised even without an import so that snippets lint the same as modules.
    """

    def __init__(self, aliases: dict[str, str]) -> None:
        self._aliases = aliases

    @classmethod
    def from_tree(cls, tree: ast.AST) -> ImportTable:
        """Collect the import aliases of a parsed module."""
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        aliases[top] = top
            elif isinstance(node, ast.ImportFrom):
                prefix = "." * node.level
                base = prefix + node.module if node.module else prefix
                for alias in node.names:
                    if alias.name == "*":
                        continue
                    sep = "" if base.endswith(".") or not base else "."
                    aliases[alias.asname or alias.name] = f"{base}{sep}{alias.name}"
        return cls(aliases)

    def dotted(self, expr: ast.expr) -> str | None:
        """The dotted path ``expr`` names if it is rooted in an import, else None.

        ``th.nn.functional.softmax`` gives ``torch.nn.functional.softmax`` after
        ``import torch as th``; ``self.x`` gives None.
        """
        if isinstance(expr, ast.Name):
            if expr.id in self._aliases:
                return self._aliases[expr.id]
            return "torch" if expr.id == "torch" else None
        if isinstance(expr, ast.Attribute):
            base = self.dotted(expr.value)
            return f"{base}.{expr.attr}" if base else None
        return None
