"""Small structural helpers shared by the adapters (registration time only)."""

from __future__ import annotations

from torch import nn

# Wrappers that put the real module one attribute down: torch.compile's OptimizedModule
# (_orig_mod), activation checkpointing's CheckpointWrapper (_checkpoint_wrapped_module),
# FSDP1 (_fsdp_wrapped_module).
_WRAPPED_ATTRS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside compile / checkpoint / DDP / FSDP1 wrappers (itself if none)."""
    for _ in range(16):  # wrappers nest a few levels at most; bound it against cycles
        inner = next((getattr(module, a) for a in _WRAPPED_ATTRS if hasattr(module, a)), None)
        if inner is None and isinstance(
            module, (nn.parallel.DistributedDataParallel, nn.DataParallel)
        ):
            inner = module.module
        if not isinstance(inner, nn.Module):
            return module
        module = inner
    return module


def get_path(root: nn.Module, path: str) -> object | None:
    """``root.a.b.c`` for ``path="a.b.c"``, unwrapping wrappers on the way; None if absent."""
    obj: object = root
    for part in path.split("."):
        if isinstance(obj, nn.Module):
            obj = unwrap(obj)
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def layer_list(container: object) -> list[nn.Module] | None:
    """The blocks of a ModuleList / Sequential / ModuleDict, in order; None otherwise.

    A ModuleDict is how pipeline-parallel stages (torchtitan) keep the layers they own.
    """
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return list(container)
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    return None
