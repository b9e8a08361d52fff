"""Which calls would force a device-to-host sync on a GPU, and what to do instead.

Two tables. ``FUNCTION_RULES`` is keyed by the Python-level tensor API that a
``TorchFunctionMode`` sees (``Tensor.item``, ``Tensor.__bool__``, ...): on a CPU build
``tolist``, ``numpy``, ``cpu`` and ``repr`` never reach the dispatcher, so they can
only be caught by name. ``DISPATCH_RULES`` is keyed by aten overload packet, for ops
whose output shape or result depends on tensor values (``nonzero``, bool-mask
indexing, ...), which a ``TorchDispatchMode`` sees whatever Python API produced them.

Each rule is a predicate over the call's arguments, because most of these calls only
sync when their input lives on the device: with ``cpu_as_device`` every CPU tensor is
treated as if it lived on the GPU (the CPU-build simulation).

This module is where the detection engine (``_session``) looks the rules up. The
tables are built in ``_function_rules`` and ``_dispatch_rules``, from the parts in
``_rule_base`` (``OpInfo``, ``Rule``, the device test and the shared hints).
"""

from __future__ import annotations

from syncless.guard._dispatch_rules import DISPATCH_RULES, DispatchRule
from syncless.guard._function_rules import FUNCTION_RULES
from syncless.guard._rule_base import OpInfo, Rule, on_device

__all__ = ["DISPATCH_RULES", "FUNCTION_RULES", "DispatchRule", "OpInfo", "Rule", "on_device"]
