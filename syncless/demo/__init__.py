"""The embedded default workload: a small MoE transformer trainer."""

from syncless.demo.config import PRESETS, DemoConfig, preset

__all__ = ["PRESETS", "DemoConfig", "preset"]
