"""Shared helpers for the adapter tests: guard the adapters' hooks, count hooks."""

from __future__ import annotations

import pytest
from hook_guard import HookGuard


@pytest.fixture
def hook_guard() -> HookGuard:
    return HookGuard()
