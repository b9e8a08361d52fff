"""The detection engine: one pair of torch modes per thread, shared by nested guards.

The outermost ``no_sync()`` / ``census()`` on a thread opens a session: it pushes a
``TorchFunctionMode`` and a ``TorchDispatchMode`` that both report to it. Nested
guards, censuses and ``allow_sync`` blocks only push *frames* onto the session, so
every user action is detected exactly once however deep the nesting, and the
decision is made in one place:

* every active census counts the sync (it observes, it never changes control flow);
* the innermost of the ``no_sync`` / ``allow_sync`` frames decides: ``no_sync``
  raises ``SyncError``, ``allow_sync`` lets it run and logs it on every active guard.

Sessions are found through torch's mode stack, not a Python thread-local: torch
propagates that stack into the autograd engine's device threads, so a hook running
there still reaches the session of the ``backward()`` call that started it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from syncless.guard import _bridge, _cuda
from syncless.guard._rules import DISPATCH_RULES, FUNCTION_RULES, OpInfo
from syncless.guard._sites import Site, user_site
from syncless.guard.errors import AllowedSync, SyncError


class Counter(Protocol):
    """What a census frame reports to."""

    def _count(self, op: str, site: Site) -> None: ...


class AllowLog(Protocol):
    """What a no_sync frame reports permitted syncs to."""

    allowed: list[AllowedSync]


@dataclass(eq=False)
class ForbidFrame:
    guard: AllowLog
    cpu_as_device: bool


@dataclass(eq=False)
class AllowFrame:
    reason: str


@dataclass(eq=False)
class CountFrame:
    census: Counter
    cpu_as_device: bool


Frame = ForbidFrame | AllowFrame | CountFrame

# Per thread: > 0 while a flagged function-level op runs its own implementation, so
# the dispatch mode does not report the aten ops it is made of (``.item()`` is seen
# as ``Tensor.item`` and must not count again as ``aten._local_scalar_dense``).
_suppress = threading.local()


def _suppressed() -> bool:
    return getattr(_suppress, "depth", 0) > 0


@contextmanager
def _suppressing() -> Iterator[None]:
    _suppress.depth = getattr(_suppress, "depth", 0) + 1
    try:
        yield
    finally:
        _suppress.depth -= 1


class Session:
    """One pair of detection modes and the stack of frames they report to."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.cpu_as_device = False
        self.closed = False
        self._lock = threading.RLock()
        self.function_mode = _SyncFunctionMode(self)
        self.dispatch_mode = _SyncDispatchMode(self)

    # -- lifecycle -------------------------------------------------------------

    def open(self) -> None:
        _bridge.install()
        self.function_mode.__enter__()
        self.dispatch_mode.__enter__()

    def close(self) -> None:
        self.closed = True
        _cuda.set_forbidding(id(self), False)
        _bridge.uninstall()
        on_top = (
            _top_function_mode() is self.function_mode
            and _top_dispatch_mode() is self.dispatch_mode
        )
        if not on_top:
            # Popping would remove someone else's mode; ours stays behind, inert.
            raise RuntimeError(
                "syncless.guard: a torch mode entered inside no_sync()/census() is still "
                "active when the guard exits; exit it inside the guard's `with` block"
            )
        self.dispatch_mode.__exit__(None, None, None)
        self.function_mode.__exit__(None, None, None)

    def push(self, frame: Frame) -> None:
        with self._lock:
            self.frames.append(frame)
            self._refresh()

    def pop(self, frame: Frame) -> None:
        with self._lock:
            if not self.frames or self.frames[-1] is not frame:
                self.frames.remove(frame)
                self._refresh()
                raise RuntimeError(
                    "syncless.guard: no_sync(), census() and allow_sync() blocks must be "
                    "exited in the reverse order of entry"
                )
            self.frames.pop()
            self._refresh()

    def _refresh(self) -> None:
        self.cpu_as_device = any(
            f.cpu_as_device for f in self.frames if not isinstance(f, AllowFrame)
        )
        _cuda.set_forbidding(id(self), self._forbidding())

    def _forbidding(self) -> bool:
        for frame in reversed(self.frames):
            if isinstance(frame, ForbidFrame):
                return True
            if isinstance(frame, AllowFrame):
                return False
        return False

    # -- detection ---------------------------------------------------------------

    def report(self, info: OpInfo) -> None:
        """A sync was detected: count it, then raise or log it as the frames say."""
        __tracebackhide__ = True  # pytest: show the user's line, not the guard's
        if self.closed:
            return
        site = user_site()
        with self._lock:
            frames = list(self.frames)
        for frame in frames:
            if isinstance(frame, CountFrame):
                frame.census._count(info.name, site)
        for i in range(len(frames) - 1, -1, -1):
            frame = frames[i]
            if isinstance(frame, ForbidFrame):
                raise SyncError(_message(info, site), info.name, site)
            if isinstance(frame, AllowFrame):
                entry = AllowedSync(frame.reason, info.name, site)
                for outer in frames[:i]:
                    if isinstance(outer, ForbidFrame):
                        outer.guard.allowed.append(entry)
                return


def _message(info: OpInfo, site: Site) -> str:
    return (
        f"{info.name} would force a device-to-host sync: {info.what}.\n"
        f"  at {site.file}:{site.line} in {site.function}\n"
        f"  fix: {info.hint}.\n"
        "  If this sync is intended, wrap it in "
        '`with syncless.guard.allow_sync("<why>"):`.'
    )


class _SyncFunctionMode(TorchFunctionMode):
    """Sees the Python tensor API by name (``tolist``, ``cpu``, ``__bool__``, ...)."""

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        __tracebackhide__ = True
        if kwargs is None:
            kwargs = {}
        try:
            rule = FUNCTION_RULES.get(func)
        except TypeError:  # an unhashable callable cannot be one of ours
            rule = None
        session = self.session
        if rule is not None and rule.applies(args, kwargs, session.cpu_as_device):
            session.report(rule.info)
            with _suppressing():
                return func(*args, **kwargs)
        if func in _bridge.AUTOGRAD_ENTRIES and not session.closed:
            return _bridge.call_with_mode(self, func, args, kwargs)
        return func(*args, **kwargs)


class _SyncDispatchMode(TorchDispatchMode):
    """Sees aten ops whatever produced them (``nonzero``, bool-mask ``index``, ...)."""

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        __tracebackhide__ = True
        if kwargs is None:
            kwargs = {}
        rule = DISPATCH_RULES.get(func.overloadpacket)
        if (
            rule is not None
            and not _suppressed()
            and (rule.overloads is None or func._overloadname in rule.overloads)
            and rule.applies(args, kwargs, self.session.cpu_as_device)
        ):
            self.session.report(rule.info)
        return func(*args, **kwargs)


def _top_function_mode() -> object:
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None


def _top_dispatch_mode() -> object:
    n = torch._C._len_torch_dispatch_stack()
    return torch._C._get_dispatch_stack_at(n - 1) if n else None


def current_session() -> Session | None:
    """The open session whose function mode is on this thread's torch mode stack."""
    for i in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, _SyncFunctionMode) and not mode.session.closed:
            return mode.session
    return None


def enter(frame: Frame) -> Session:
    """Push ``frame`` on this thread's session, opening one if there is none."""
    session = current_session()
    if session is None:
        session = Session()
        session.open()
    session.push(frame)
    return session


def leave(session: Session, frame: Frame) -> None:
    """Pop ``frame``; the last frame closes the session and removes its modes."""
    try:
        session.pop(frame)
    finally:
        if not session.frames and not session.closed:
            session.close()
