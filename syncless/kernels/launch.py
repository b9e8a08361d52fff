"""Launch a compiled Triton kernel without binding its arguments again every call.

``kernel[grid](*args)`` goes through ``JITFunction.run``: it binds and specialises
every argument, builds a cache key, looks the compiled kernel up, then calls its
launcher. ``cached_launch`` keeps, per specialisation, the compiled kernel
``JITFunction.run`` returned, and launches it through the compiled kernel's own runner
(``compiled[grid](*args)``). Measured on the H200's host it saves little: a trivial
kernel took 11.8 us through ``JITFunction.run`` and 8.1 us through the runner, and the
grouped monitor kernels' 77-229 us per launch in a training step turned out to be the
driver's, most of it from launching onto an idle GPU (bench/RESULTS.md, probe lines at
839d1b4). It stays as a small saving that grows with the argument count (the key it
builds per launch is part of its own cost; not measured apart).

The key is at least as strict as Triton's own: every tensor's dtype, device and
16-byte alignment (all Triton specialises a pointer on), the integer width of an
argument marked ``do_not_specialize`` (its value is not compiled in), and every other
argument's exact value. Equal keys therefore mean equal specialisations: the compiled
kernel is the one Triton would pick. A kernel keeps at most ``MAX_KEYS`` of them.

What the runner takes differs between Triton versions (every argument, or only the
non-constexpr ones), so nothing is assumed: the second launch of a specialisation
goes through ``JITFunction.run`` once more while watching the arguments it hands the
compiled kernel's launcher; the runner is used from the third launch on, and only if
they were this call's arguments in one of those two forms. Otherwise (another
Triton, the interpreter, a Triton launch hook) every launch takes ``JITFunction.run``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

_JIT = object()  # this specialisation always goes through JITFunction.run
MAX_KEYS = 64


def _int_width(v: int) -> tuple[str, int]:
    """The integer type Triton gives an unspecialised int: i32, i64 or u64."""
    return ("int", 0 if -(2**31) <= v < 2**31 else 2 if v >= 2**63 else 1)


class CachedLaunch:
    """``fn[grid](*args, **kwargs)`` as Triton launches it, cheaper from the third
    launch of a specialisation (see the module docstring)."""

    def __init__(self, fn: Any, options: dict[str, Any] | None = None) -> None:
        self.fn = fn
        # Triton launch options (num_warps, ...): fixed per kernel, so they are not part
        # of the key; the compiled kernel carries them, its runner takes none.
        self.options = options or {}
        params = getattr(fn, "params", None)
        self.names: list[str] = [p.name for p in params] if params else []
        self._constexpr = [bool(getattr(p, "is_constexpr", False)) for p in params or ()]
        self._loose = [
            bool(getattr(p, "do_not_specialize", False)) and not c
            for p, c in zip(params or (), self._constexpr, strict=True)
        ]
        # The interpreter's functions keep no compiled kernels: nothing to cache.
        self.enabled = bool(self.names) and hasattr(fn, "device_caches")
        self._seen: dict[tuple, Any] = {}  # launched once: the compiled kernel
        self._ready: dict[tuple, Any] = {}  # key -> (compiled, every argument?) or _JIT
        self.direct_launches = 0

    def _jit(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Triton's own launch (``JITFunction.run``); returns the compiled kernel."""
        return self.fn[grid](*args, **kwargs, **self.options)

    def _runtime(self, values: list) -> list:
        """The non-constexpr arguments (what older Triton launchers take)."""
        return [v for v, c in zip(values, self._constexpr, strict=True) if not c]

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(tuple(grid), args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        if not self.enabled or len(args) + len(kwargs) != len(self.names):
            self._jit(grid, args, kwargs)
            return
        try:
            values = [*args, *(kwargs[n] for n in self.names[len(args) :])]
        except KeyError:  # a keyword out of signature order: Triton binds it
            self._jit(grid, args, kwargs)
            return
        key = tuple(
            (v.dtype, v.get_device(), v.data_ptr() % 16 == 0)
            if isinstance(v, torch.Tensor)
            else _int_width(v)
            if loose and type(v) is int
            else v
            for v, loose in zip(values, self._loose, strict=True)
        )
        try:
            ready = self._ready.get(key)
        except TypeError:  # an unhashable argument: Triton's path, uncached
            self._jit(grid, args, kwargs)
            return
        if ready is not None and ready is not _JIT:
            compiled, every = ready
            compiled[(*grid, 1, 1)[:3]](*(values if every else self._runtime(values)))
            self.direct_launches += 1
            return
        if ready is _JIT:
            self._jit(grid, args, kwargs)
            return
        compiled = self._seen.pop(key, None)
        if compiled is None:
            compiled = self._jit(grid, args, kwargs)
            if len(self._seen) + len(self._ready) < MAX_KEYS:
                self._seen[key] = compiled
            return
        self._ready[key] = self._watch(compiled, grid, args, kwargs, values)

    def _watch(
        self, compiled: Any, grid: tuple[int, ...], args: tuple, kwargs: dict, values: list
    ) -> Any:
        """Launch through Triton, noting what it passes ``compiled``'s launcher; the
        runner's argument form, or ``_JIT`` when it is neither known form."""
        attr = next((a for a in ("_run", "run") if vars(compiled).get(a) is not None), None)
        if attr is None:
            self._jit(grid, args, kwargs)
            return _JIT
        original = vars(compiled)[attr]
        calls: list[tuple] = []

        def watched(*launcher_args: Any) -> Any:
            calls.append(launcher_args)
            return original(*launcher_args)

        setattr(compiled, attr, watched)
        try:
            self._jit(grid, args, kwargs)
        finally:
            setattr(compiled, attr, original)
        if len(calls) != 1:  # another compiled kernel ran: Triton's key is not ours
            return _JIT
        for every, expected in ((True, values), (False, self._runtime(values))):
            passed = calls[0][len(calls[0]) - len(expected) :]
            if len(calls[0]) > len(expected) and all(map(_same, passed, expected)):
                return compiled, every
        return _JIT


def _same(a: Any, b: Any) -> bool:
    """The same object, or equal plain values (never a tensor comparison)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    return bool(a == b)


def cached_launch(fn: Any = None, **options: Any) -> Any:
    """Decorate a ``@triton.jit`` kernel launched from Python (not one other kernels
    call): ``kernel[grid](...)`` keeps working, through ``CachedLaunch``.
    ``@cached_launch(num_warps=8)`` launches with those Triton options every time."""
    if fn is None:
        return lambda f: CachedLaunch(f, options)
    return CachedLaunch(fn, options)
