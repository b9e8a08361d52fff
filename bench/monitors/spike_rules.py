"""How far ordinary training's loss and gradient norm stray, against the spike rule (#46).

A spike alarm that cries wolf gets turned off. This measures, on ordinary CPU runs (the
demo's presets and tiny Hugging Face models as the tests train them), how far each step's
loss and total gradient norm sit above the mean of the previous ``window`` values that
were not spikes, in standard deviations (z) and as a fraction of the mean (rel): a rule
(``sigmas``, ``min_rel``) raises a false alarm where both are exceeded at once. It also
plants spikes of a few sizes into the same series and says which the rule catches. The
defaults of ``syncless.monitors.spikes.SpikeRule`` are chosen from this table.

    python -m bench.monitors spike_rules                 # ~3 min on 2 CPU cores
    python -m bench.monitors spike_rules --no-append     # print only
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.harness import append_result, metric_values
from syncless.monitors.spikes import DEFAULT_SPIKES, SpikeRule


def excursions(series: list[float], rule: SpikeRule) -> list[tuple[int, float, float]]:
    """(step, z, rel) of every value after the warm-up, against the window of the values
    before it that the rule kept (itself, where it calls it a spike, is not kept)."""
    kept: list[float] = []
    out = []
    for i, x in enumerate(series):
        if not math.isfinite(x):
            continue
        window = kept[-rule.window :]
        if len(window) >= rule.warmup:
            mean, std = statistics.fmean(window), statistics.pstdev(window)
            z = (x - mean) / std if std > 0 else math.inf
            rel = (x - mean) / abs(mean) if mean else math.inf
            out.append((i, z, rel))
            if z > rule.sigmas and rel > rule.min_rel:
                continue
        kept.append(x)
    return out


def false_alarms(series: list[float], rule: SpikeRule) -> int:
    return sum(
        1 for _, z, rel in excursions(series, rule) if z > rule.sigmas and rel > rule.min_rel
    )


def caught(series: list[float], rule: SpikeRule, at: int, factor: float) -> bool:
    planted = list(series)
    planted[at] *= factor
    return any(
        i == at and z > rule.sigmas and rel > rule.min_rel
        for i, z, rel in excursions(planted, rule)
    )


def demo_series(preset: str, steps: int, seed: int) -> dict[str, list[float]]:
    """The demo's loss and gradient norm per step, from its run store."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "syncless.cli", "demo", "--preset", preset,
            "--steps", str(steps), "--seed", str(seed), "--quiet", "--no-report",
            "--run-dir", str(run_dir),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return {
            "loss": metric_values(run_dir, "demo/step/loss"),
            "grad_norm": metric_values(run_dir, "demo/step/grad_norm"),
        }


def llama_series(batch: tuple[int, int], steps: int, seed: int) -> dict[str, list[float]]:
    """A tiny Hugging Face Llama trained by SGD, as the alarm tests train it."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    losses, norms = [], []
    for _ in range(steps):
        ids = torch.randint(0, 64, batch, generator=gen)
        loss = model(ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return {"loss": losses, "grad_norm": norms}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args(argv)
    runs: dict[str, dict[str, list[float]]] = {}
    for seed in (0, 1, 2):
        runs[f"demo tiny s{seed}"] = demo_series("tiny", args.steps, seed)
        runs[f"llama 4x16 s{seed}"] = llama_series((4, 16), args.steps, seed)
        runs[f"llama 2x8 s{seed}"] = llama_series((2, 8), args.steps, seed)
    rows = []
    for run, values in runs.items():
        for name, series in values.items():
            rule = DEFAULT_SPIKES[name]
            ex = excursions(series, rule)
            z = max(z for _, z, _ in ex)
            rel = max(rel for _, _, rel in ex)
            both = max((min(z / rule.sigmas, rel / rule.min_rel) for _, z, rel in ex), default=0)
            alarms = false_alarms(series, rule)
            at = len(series) * 3 // 4
            catch = {f: caught(series, rule, at, f) for f in (1.5, 2.0, 3.0, 10.0)}
            rows.append(
                f"{run} {name}: max z {z:.1f}, max rel {rel:.2f}, closest to both "
                f"{both:.2f} of the rule, false alarms {alarms}, caught x"
                + ",".join(f"{f:g}" for f, ok in catch.items() if ok)
            )
    print("\n".join(rows))
    rules = ", ".join(
        f"{name} (window {r.window}, warmup {r.warmup}, sigmas {r.sigmas}, min_rel {r.min_rel})"
        for name, r in DEFAULT_SPIKES.items()
    )
    summary = f"rules {rules}; {len(runs)} ordinary CPU runs of {args.steps} steps: " + "; ".join(
        rows
    )
    if not args.no_append:
        print(append_result("spike_rules", summary))
