"""How balanced the demo's MoE trains under each ``--balance`` mode (issue 46).

Trains the demo once per mode (default: ``aux``, the sequence-wise loss alone, the
default before; ``bias``, DeepSeek-V3's bias balancing, the default now) with the moe
monitor reading every step, and reports per window of steps:

- routed: each layer's largest share of the (token, expert) picks the routers made,
  counted from the experts they returned (a forward hook here, on the device; read at
  the end), with the imbalance (max / mean) and coefficient of variation;
- monitor: ``monitors/layer_XX/moe_imbalance`` and ``moe_load_cv`` from the run store.
  The monitor counts a top-k of the gate's logits (the demo adapter hands it no
  routing map), which is the routing under ``aux`` and ``none``, and the gate's own
  preference under ``bias``, where the bias changes the choice.

Balanced is a share of 1/E (imbalance 1, CV 0); top-2 caps a share at 50%.

    python -m bench.demo balance                         # small preset, 300 steps
    python -m bench.demo balance --steps 60 --set n_layers=2 --no-record
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from pathlib import Path

import torch

from bench.harness import append_result
from syncless.demo.config import preset
from syncless.demo.monitors_tool import MonitorsTool
from syncless.demo.tools import DemoContext
from syncless.demo.train import run_demo
from syncless.run import open as open_run


class RoutedPicks:
    """A demo tool: each step's picks per layer and expert, counted on the device from
    the experts each router returned."""

    name = "routed-picks"

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []
        self._counts: torch.Tensor | None = None

    def attach(self, ctx: DemoContext) -> None:
        routers = [block.moe.router for block in ctx.model.layers]
        device = next(ctx.model.parameters()).device
        self._counts = torch.zeros(len(routers), ctx.cfg.n_experts, device=device)
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._count(layer))

    def _count(self, layer: int):
        def hook(module, args, out) -> None:
            experts = out[1].reshape(-1)
            assert self._counts is not None
            self._counts[layer].index_add_(
                0, experts, torch.ones_like(experts, dtype=torch.float32)
            )

        return hook

    def step_begin(self, step: int) -> None:
        assert self._counts is not None
        self._counts.zero_()

    def step_end(self, step: int) -> None:
        assert self._counts is not None
        self.steps.append(self._counts.clone())

    def close(self) -> None:
        pass


def load_stats(counts: list[float]) -> tuple[float, float, float]:
    """(largest share, max / mean, std / mean) of one layer's picks per expert."""
    total, n = sum(counts), len(counts)
    mean = total / n
    std = (sum((c - mean) ** 2 for c in counts) / n) ** 0.5
    return max(counts) / total, max(counts) / mean, std / mean


def _windows(steps: int, width: int) -> list[range]:
    middle = steps // 2 - width // 2
    return [range(0, width), range(middle, middle + width), range(steps - width, steps)]


def _span(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if low == high else f"{low:{fmt}}-{high:{fmt}}"


def _seen(monitor: dict, window: range, metric: str, layer: int) -> float:
    """The monitor's mean of ``metric`` for ``layer`` over the window's steps."""
    return statistics.mean(monitor[s, f"layer_{layer:02d}", metric] for s in window)


def run_mode(cfg, mode: str, run_dir: Path, width: int) -> tuple[str, dict]:
    cfg = dataclasses.replace(cfg, balance=mode)
    probe = RoutedPicks()
    tools = [MonitorsTool("moe", every=1, budget=None), probe]
    result = run_demo(cfg, run_dir=run_dir, quiet=True, tools=tools)
    routed = [step.cpu().tolist() for step in probe.steps]  # [step][layer][expert]
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT step, name, value FROM metrics WHERE name LIKE 'monitors/layer_%/moe_%' "
            "AND (name LIKE '%moe_imbalance' OR name LIKE '%moe_load_cv')"
        )
    monitor = {
        (step, name.rsplit("/", 2)[-2], name.rsplit("/", 1)[-1]): v for step, name, v in rows
    }
    layers = range(cfg.n_layers)
    parts, out = [], {}
    for window in _windows(cfg.steps, width):
        per_layer = [[load_stats(routed[s][layer]) for s in window] for layer in layers]
        share = [statistics.mean(x[0] for x in stats) for stats in per_layer]
        imbalance = [statistics.mean(x[1] for x in stats) for stats in per_layer]
        cv = [statistics.mean(x[2] for x in stats) for stats in per_layer]

        m_imbalance = [_seen(monitor, window, "moe_imbalance", layer) for layer in layers]
        m_cv = [_seen(monitor, window, "moe_load_cv", layer) for layer in layers]
        label = f"steps {window.start}-{window.stop - 1}"
        out[label] = {"share": share, "imbalance": imbalance, "cv": cv,
                      "monitor_imbalance": m_imbalance, "monitor_cv": m_cv}  # fmt: skip
        parts.append(
            f"{label}: routed max share {_span(share, '.1%')} (imbalance "
            f"{_span(imbalance, '.2f')}, CV {_span(cv, '.2f')}); monitor imbalance "
            f"{_span(m_imbalance, '.2f')}, CV {_span(m_cv, '.2f')}"
        )
    losses = [loss for step, loss in result.losses if step >= cfg.steps - width]
    parts.append(f"loss {statistics.mean(losses):.3f} (last {width} steps)")
    return f"--balance {mode}: " + "; ".join(parts), out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=None, help="default: the preset's")
    parser.add_argument("--modes", default="aux,bias")
    parser.add_argument("--window", type=int, default=10, help="steps per reported window")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a DemoConfig field, e.g. --set n_layers=2")  # fmt: skip
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args(argv)

    types = {f.name: f.type for f in dataclasses.fields(preset(args.preset))}
    overrides = {}
    for item in args.set:
        name, value = item.split("=", 1)
        overrides[name] = {"int": int, "float": float, "bool": lambda v: v == "true"}.get(
            types[name], str
        )(value)
    if args.steps is not None:
        overrides["steps"] = args.steps
    cfg = preset(args.preset, **overrides)
    flags = "".join(f" --{name.replace('_', '-')} {value}" for name, value in overrides.items())
    shape = (
        f"demo --preset {args.preset}{flags} --monitors moe ({cfg.n_layers} layers, "
        f"{cfg.n_experts} experts top-{cfg.top_k}, seq {cfg.seq_len} x batch {cfg.batch_size})"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            line, _ = run_mode(cfg, mode, Path(tmp) / mode, args.window)
            line = f"{shape}, {line}"
            print(line, flush=True)
            if not args.no_record:
                append_result("demo_balance", line)
