"""Finding hot-path functions: hooks, their factories' closures, and marked functions.

Seeds (ranked; a function found several ways keeps the best reason):

0. functions passed to a hook registration (``register_forward_hook`` & co., any
   ``.register_hook``), resolved through lambdas, ``functools.partial``, bound
   methods, instances with ``__call__`` and factory calls (the closures the factory
   returns are the hook; the factory body runs once, at registration, and is cold);
1. functions decorated ``@hot_path`` / ``@syncless.hot_path``;
2. closures returned by a hook factory (``_make_*_hook``, ``make_*_hook``, or a
   function matched by name whose returns are functions it defines), and functions
   named like a hot path (``*_hook``, ``_compute_*``) that do not register hooks
   themselves (registration code runs once);
3. functions matching the configured ``hot-path-patterns`` (same exceptions).

Functions that hot functions call (or pass to calls that run them) are added
transitively by the analysis driver (:mod:`syncless.lint.engine`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from fnmatch import fnmatchcase

from syncless.lint.context import ModuleContext
from syncless.lint.declared_types import heuristic_param_type
from syncless.lint.lattice import T, holds_tensor
from syncless.lint.resolver import Target
from syncless.lint.scopes import FunctionInfo, terminal_name

RANK_REGISTERED = 0
RANK_DECORATED = 1
RANK_NAMED = 2
RANK_CONFIGURED = 3
RANK_CALLED = 4

BUILTIN_PATTERNS = ("*_hook", "_compute_*")
FACTORY_PATTERNS = ("_make_*_hook", "make_*_hook", "_make_hook", "make_hook")
_NOT, _SEQ, _TENSOR, _UNKNOWN = T.NOT, T.SEQ, T.TENSOR, T.UNKNOWN


@dataclass(frozen=True)
class HookKind:
    """What a kind of hook is called with: a type per positional argument."""

    label: str
    params: tuple[T, ...]
    params_with_kwargs: tuple[T, ...] | None = None


FORWARD = HookKind("forward hook", (_NOT, _SEQ, _TENSOR), (_NOT, _SEQ, _UNKNOWN, _TENSOR))
FORWARD_PRE = HookKind("forward pre-hook", (_NOT, _SEQ), (_NOT, _SEQ, _UNKNOWN))
BACKWARD = HookKind("backward hook", (_NOT, _SEQ, _SEQ))
BACKWARD_PRE = HookKind("backward pre-hook", (_NOT, _SEQ))
TENSOR_HOOK = HookKind("tensor hook", (_TENSOR,))
MULTI_GRAD = HookKind("multi-grad hook", (_SEQ,))
OPTIMIZER_STEP = HookKind("optimizer step hook", (_NOT, _UNKNOWN, _UNKNOWN))
COMM = HookKind("communication hook", (_UNKNOWN, _UNKNOWN))

# Registration function name -> (kind, position of the hook argument, its keyword).
REGISTRARS: dict[str, tuple[HookKind, int, str]] = {
    "register_forward_hook": (FORWARD, 0, "hook"),
    "register_module_forward_hook": (FORWARD, 0, "hook"),
    "register_forward_pre_hook": (FORWARD_PRE, 0, "hook"),
    "register_module_forward_pre_hook": (FORWARD_PRE, 0, "hook"),
    "register_full_backward_hook": (BACKWARD, 0, "hook"),
    "register_backward_hook": (BACKWARD, 0, "hook"),
    "register_module_full_backward_hook": (BACKWARD, 0, "hook"),
    "register_module_backward_hook": (BACKWARD, 0, "hook"),
    "register_full_backward_pre_hook": (BACKWARD_PRE, 0, "hook"),
    "register_module_full_backward_pre_hook": (BACKWARD_PRE, 0, "hook"),
    "register_hook": (TENSOR_HOOK, 0, "hook"),
    "register_post_accumulate_grad_hook": (TENSOR_HOOK, 0, "hook"),
    "register_multi_grad_hook": (MULTI_GRAD, 1, "fn"),
    "register_step_pre_hook": (OPTIMIZER_STEP, 0, "hook"),
    "register_step_post_hook": (OPTIMIZER_STEP, 0, "hook"),
    "register_comm_hook": (COMM, 1, "hook"),
}


@dataclass(frozen=True)
class Seed:
    """A function found hot on its own, why, and what its parameters are."""

    fn: FunctionInfo
    why: str
    rank: int
    params: dict[str, T]


def registration(call: ast.Call) -> tuple[HookKind, ast.expr, bool] | None:
    """``(kind, hook expression, with_kwargs)`` if ``call`` registers a hook."""
    name = terminal_name(call.func)
    if name not in REGISTRARS or isinstance(call.func, ast.Call):
        return None
    kind, position, keyword = REGISTRARS[name]
    hook = next((k.value for k in call.keywords if k.arg == keyword), None)
    if hook is None and len(call.args) > position:
        hook = call.args[position]
    if hook is None or isinstance(hook, ast.Starred):
        return None
    with_kwargs = any(
        k.arg == "with_kwargs" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )
    return kind, hook, with_kwargs


def supplied_params(target: Target, supplied: tuple[T, ...]) -> dict[str, T]:
    """Parameter types of ``target`` when called with arguments of types ``supplied``."""
    params = [p for p in target.fn.positional_params[target.offset :] if p.arg not in target.bound]
    types = {p.arg: t for p, t in zip(params, supplied, strict=False)}
    rest = supplied[len(params) :]
    vararg = target.fn.node.args.vararg
    if rest and vararg is not None:
        types[vararg.arg] = _SEQ if any(holds_tensor(t) for t in rest) else _UNKNOWN
    return types


def conventional_params(fn: FunctionInfo, offset: int) -> dict[str, T]:
    """Parameter types guessed from conventional hook names, for hooks of unknown kind.

    Only unannotated parameters are guessed: an annotation, even one the inference
    does not understand, says more than a name.
    """
    args = fn.node.args
    params = [*fn.positional_params[offset:], *args.kwonlyargs]
    types = {}
    for param in params:
        if param.annotation is not None:
            continue
        guess = heuristic_param_type(param.arg)
        if guess is not None:
            types[param.arg] = guess
    return types


def find_seeds(ctx: ModuleContext, patterns: tuple[str, ...] = ()) -> list[Seed]:
    """Every function of the module that is hot on its own (see the module docstring)."""
    seeds: list[Seed] = []
    registering: set[int] = set()
    for call, scope in ctx.index.iter_calls():
        found = registration(call)
        if found is None:
            continue
        if scope is not None:
            registering.add(id(scope))
        kind, hook, with_kwargs = found
        supplied = (
            kind.params_with_kwargs if with_kwargs and kind.params_with_kwargs else kind.params
        )
        for target in ctx.resolver.resolve(hook, scope, generous=True):
            why = f"{kind.label} `{target.fn.qualname}`"
            seeds.append(Seed(target.fn, why, RANK_REGISTERED, supplied_params(target, supplied)))

    for fn in ctx.index.functions:
        if fn.is_lambda:
            continue
        offset = fn.instance_offset
        if _is_decorated_hot(ctx, fn):
            why = f"@hot_path function `{fn.qualname}`"
            seeds.append(Seed(fn, why, RANK_DECORATED, conventional_params(fn, offset)))
            continue
        builtin = _first_match(fn.name, BUILTIN_PATTERNS)
        configured = _first_match(fn.name, patterns) or _first_match(fn.qualname, patterns)
        if _is_factory(ctx, fn, builtin is not None or configured is not None):
            for target in ctx.resolver.returned(fn, generous=True):
                why = f"hook `{target.fn.qualname}` returned by `{fn.qualname}`"
                params = conventional_params(target.fn, target.offset)
                seeds.append(Seed(target.fn, why, RANK_NAMED, params))
        elif id(fn) in registering:
            continue  # registration code runs once, like a factory
        elif builtin is not None:
            why = f"`{fn.qualname}`, hot by its name (`{builtin}`)"
            # Hook parameter names are a convention; a `_compute_*` helper's are not.
            params = conventional_params(fn, offset) if builtin == "*_hook" else {}
            seeds.append(Seed(fn, why, RANK_NAMED, params))
        elif configured is not None:
            why = f"`{fn.qualname}`, hot by configured pattern `{configured}`"
            seeds.append(Seed(fn, why, RANK_CONFIGURED, {}))
    return seeds


def _is_decorated_hot(ctx: ModuleContext, fn: FunctionInfo) -> bool:
    """``@hot_path``, ``@syncless.hot_path``, or an imported alias of either."""
    for decorator in fn.node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        dotted = ctx.imports.dotted(target) or ""
        if terminal_name(target) == "hot_path" or dotted.rsplit(".", 1)[-1] == "hot_path":
            return True
    return False


def _first_match(name: str, patterns: tuple[str, ...]) -> str | None:
    return next((p for p in patterns if fnmatchcase(name, p)), None)


def _is_factory(ctx: ModuleContext, fn: FunctionInfo, hot_by_name: bool) -> bool:
    """A hook factory: named like one, or hot by name and returning its own closures.

    Its body runs once, at registration; the closures it returns are the hot path.
    """
    if _first_match(fn.name, FACTORY_PATTERNS) is not None:
        return True
    if not hot_by_name or not fn.returns:
        return False
    returned = ctx.resolver.returned(fn)
    return bool(returned) and all(t.fn.is_inside(fn) for t in returned)
