"""``syncless.kernels.launch``: the compiled kernel's runner from the third launch of a
specialisation, checked against fakes of both Triton launcher conventions."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from syncless.kernels.launch import CachedLaunch, cached_launch


@dataclass
class _Param:
    name: str
    is_constexpr: bool = False
    do_not_specialize: bool = False


class _Compiled:
    """A compiled kernel: ``_run`` is its launcher, ``[grid]`` its runner."""

    def __init__(self, every: bool, reversed_args: bool = False) -> None:
        self.every, self.reversed_args = every, reversed_args
        self._run = self._launcher
        self.launches: list[tuple] = []

    def _launcher(self, g0, g1, g2, stream, function, meta, launch_meta, enter, exit_, *args):
        self.launches.append(((g0, g1, g2), args))

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self._run(grid[0], grid[1], grid[2], 7, None, None, None, None, None, *args)

        return runner


class _JITFunction:
    """Triton's side: binds, keys on dtype/alignment/value, launches, returns the
    compiled kernel. ``every``: the launcher takes constexprs too (newer Triton)."""

    def __init__(self, every: bool, reversed_args: bool = False) -> None:
        self.params = [_Param("x"), _Param("n", do_not_specialize=True), _Param("scale"),
                       _Param("BLOCK", is_constexpr=True)]  # fmt: skip
        self.device_caches: dict = {}
        self.every, self.reversed_args = every, reversed_args
        self.compiled: dict[tuple, _Compiled] = {}
        self.jit_launches = 0
        self.options: list[dict] = []  # the launch options of each launch through Triton

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._run(grid, args, kwargs)

    def _run(self, grid, args, kwargs):
        names = {p.name for p in self.params}
        self.options.append({k: v for k, v in kwargs.items() if k not in names})
        values = [*args, *(kwargs[p.name] for p in self.params[len(args) :])]
        x, n, scale, block = values
        key = (x.dtype, x.data_ptr() % 16 == 0, n < 2**31, repr(scale), block)
        compiled = self.compiled.setdefault(key, _Compiled(self.every))
        passed = values if self.every else [x, n, scale]
        if self.reversed_args:
            passed = passed[::-1]
        grid = (*grid, 1, 1)[:3]
        compiled._run(*grid, 7, None, None, None, None, None, *passed)
        self.jit_launches += 1
        return compiled


@pytest.mark.parametrize("every", [True, False])
def test_third_launch_on_goes_through_the_runner_with_what_triton_would_pass(every):
    fn = _JITFunction(every)
    kernel = CachedLaunch(fn)
    x = torch.zeros(64)
    for n in (10, 11, 12, 13):  # n is not specialised: one key for all of them
        kernel[(4,)](x, n, 0.5, BLOCK=128)
    assert fn.jit_launches == 2 and kernel.direct_launches == 2
    (compiled,) = fn.compiled.values()
    runtime = lambda n: (x, n, 0.5, 128) if every else (x, n, 0.5)  # noqa: E731
    assert compiled.launches == [((4, 1, 1), runtime(n)) for n in (10, 11, 12, 13)]


def test_launch_options_reach_every_launch_through_triton():
    fn = _JITFunction(every=True)
    kernel = cached_launch(num_warps=8)(fn)
    x = torch.zeros(64)
    for _ in range(4):
        kernel[(2,)](x, 5, 0.5, BLOCK=128)
    # the options are not the kernel's arguments: the runner still takes over
    assert fn.options == [{"num_warps": 8}] * 2 and kernel.direct_launches == 2


def test_a_new_specialisation_starts_over_through_triton():
    fn = _JITFunction(every=True)
    kernel = CachedLaunch(fn)
    x = torch.zeros(64)
    for _ in range(3):
        kernel[(1,)](x, 1, 0.5, BLOCK=128)
    assert kernel.direct_launches == 1
    kernel[(1,)](x, 1, 0.25, BLOCK=128)  # another scale: another compiled kernel
    kernel[(1,)](x[1:], 1, 0.5, BLOCK=128)  # misaligned by 4 bytes: another one
    kernel[(1,)](x.double(), 1, 0.5, BLOCK=128)  # another dtype
    assert kernel.direct_launches == 1 and fn.jit_launches == 5
    assert len(fn.compiled) == 4


def test_an_unknown_launcher_convention_keeps_every_launch_on_triton():
    fn = _JITFunction(every=True, reversed_args=True)
    kernel = CachedLaunch(fn)
    x = torch.zeros(64)
    for _ in range(5):
        kernel[(1,)](x, 3, 0.5, BLOCK=128)
    assert kernel.direct_launches == 0 and fn.jit_launches == 5


def test_the_interpreter_and_odd_calls_pass_through():
    class _Interpreted:
        def __init__(self):
            self.params = _JITFunction(every=True).params  # no device_caches: interpreted
            self.calls = 0

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.calls += 1

            return run

    interpreted = _Interpreted()
    kernel = CachedLaunch(interpreted)
    for _ in range(3):
        kernel[(1,)](torch.zeros(4), 1, 0.5, BLOCK=128)
    assert interpreted.calls == 3 and kernel.direct_launches == 0

    fn = _JITFunction(every=True)
    kernel = CachedLaunch(fn)
    for _ in range(3):  # an unhashable argument: uncached, still launched
        kernel[(1,)](torch.zeros(4), 1, [0.5], BLOCK=128)
    assert kernel.direct_launches == 0
