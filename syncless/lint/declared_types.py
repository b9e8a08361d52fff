"""Types the code declares rather than the lint infers.

:func:`annotation_type` reads a parameter, return or attribute annotation
(``Tensor``, ``Optional[Tensor]``, ``tuple[Tensor, ...]``, ``int``...);
:func:`heuristic_param_type` reads a hook parameter's conventional name (``output``,
``grad_input``, ``module``...) when nothing better is known.
"""

from __future__ import annotations

import ast

from syncless.lint.lattice import T


def annotation_type(annotation: ast.expr | None) -> T | None:
    """The type an annotation states, or None when it says nothing useful.

    ``Tensor``, ``torch.Tensor``, ``Optional[Tensor]`` and ``Tensor | None`` give
    TENSOR; ``tuple[Tensor, ...]``, ``list[Tensor]``, ``Sequence[Tensor]`` give SEQ;
    builtin scalars, strings and modules give NOT; unions of several types and
    anything else give None (no information).
    """
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    members = [m for m in _union_members(annotation) if not _is_none(m)]
    if len(members) != 1:
        return None
    member = members[0]
    name = _dotted_name(member)
    if name is not None:
        last = name.rsplit(".", 1)[-1]
        if last.endswith("Tensor") or last == "Parameter":
            return T.TENSOR
        if last in _SCALAR_ANNOTATIONS or last.endswith("Module"):
            return T.NOT
        return None
    if isinstance(member, ast.Subscript):
        head = (_dotted_name(member.value) or "").rsplit(".", 1)[-1]
        if head in _CONTAINER_ANNOTATIONS:
            items = member.slice.elts if isinstance(member.slice, ast.Tuple) else [member.slice]
            items = [i for i in items if not (isinstance(i, ast.Constant) and i.value is ...)]
            if items and all(annotation_type(i) is T.TENSOR for i in items):
                return T.SEQ
    return None


_SCALAR_ANNOTATIONS = frozenset({"int", "float", "bool", "str", "bytes", "complex"})
_CONTAINER_ANNOTATIONS = frozenset(
    {"tuple", "Tuple", "list", "List", "Sequence", "Iterable", "Iterator"}
)


def _union_members(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return [*_union_members(node.left), *_union_members(node.right)]
    if isinstance(node, ast.Subscript):
        head = (_dotted_name(node.value) or "").rsplit(".", 1)[-1]
        if head == "Optional":
            return [node.slice]
        if head == "Union":
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return [m for item in items for m in _union_members(item)]
    return [node]


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


_PARAM_NAMES = {
    "output": T.TENSOR,
    "out": T.TENSOR,
    "grad": T.TENSOR,
    "tensor": T.TENSOR,
    "input": T.SEQ,
    "inputs": T.SEQ,
    "args": T.SEQ,
    "outputs": T.SEQ,
    "grads": T.SEQ,
    "grad_input": T.SEQ,
    "grad_output": T.SEQ,
    "grad_inputs": T.SEQ,
    "grad_outputs": T.SEQ,
    "module": T.NOT,
    "mod": T.NOT,
    "name": T.NOT,
    "optimizer": T.NOT,
}


def heuristic_param_type(name: str) -> T | None:
    """The type a hook parameter's conventional name suggests (``output``: TENSOR)."""
    return _PARAM_NAMES.get(name)
