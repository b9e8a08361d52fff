"""Run directories for the summary and trace tests, written record by record with the
run store's own ParquetSink, so the tests know every number in them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from syncless.run import ParquetSink, StepRecord
from syncless.run.rundir import METRICS_DIR, write_run_json

STEPS = 10
LAYERS = ("layer_00", "layer_01", "layer_02")
HEADS = 4
EXPERTS = 4
WINDOWS = (4, 9)  # the profiler's report steps
# Per-step ms of each section, in the profiler's depth-first order: forward holds
# attention and router, "a2a" is a collective (its parts below), backward is a leaf.
SECTIONS = {"data": 1.0, "forward": 10.0, "attention": 4.0, "router": 2.0, "a2a": 3.0,
            "backward": 12.0, "optimizer": 1.5}  # fmt: skip
PARTS = {"rendezvous": 1.25, "transfer": 1.5, "enqueue": 1.75}
STEP_MS = 28.0  # top-level sections hold 27.5: forward's children cannot fit outside
# Each row's (depth, order) as the profiler records them since it writes its nesting:
# depth 0 is the step row and the sections directly inside the step.
NESTING = {"step": (0, 0), "data": (0, 1), "forward": (0, 2), "attention": (1, 3),
           "router": (1, 4), "a2a": (0, 5), "backward": (0, 6), "optimizer": (0, 7)}  # fmt: skip


def values(seed: int = 0, nested: bool = False) -> dict[tuple[int, int, str], float]:
    """(step, rank, name) -> value of every record the test run holds; ``nested``: with
    the profiler's nesting records (without them: a run recorded before it wrote them)."""
    rng = np.random.default_rng(seed)
    out: dict[tuple[int, int, str], float] = {}
    for rank in (0, 1):
        for step in range(STEPS):
            out[step, rank, "demo/step/loss"] = float(5 - step * 0.3 + rng.random())
            out[step, rank, "demo/step/lr"] = 1e-3 * (step + 1)
            out[step, rank, "demo/step/step_ms"] = float(20 + rng.random() * 10)
            out[step, rank, "demo/step/tokens_per_s"] = float(1000 + rng.random() * 100)
            for op, scale in (("get", 1.0), ("put", 3.0)):
                out[step, rank, f"dataplane/step/{op}/wall_ms"] = float(scale * rng.random())
                out[step, rank, f"dataplane/step/{op}/mb"] = scale
                out[step, rank, f"dataplane/step/{op}/calls_count"] = 1.0
                out[step, rank, f"dataplane/step/{op}/errors_count"] = float(op == "put")
            out[step, rank, "dataplane/step/self/overhead_ms"] = float(rng.random())
            for layer in LAYERS:
                prefix = f"monitors/{layer}"
                heads = rng.random(HEADS) * 10
                for h in range(HEADS):
                    out[step, rank, f"{prefix}/attn_qk_logit_max/head_{h}"] = float(heads[h])
                    out[step, rank, f"{prefix}/attn_entropy_nats/head_{h}"] = float(heads[h] / 3)
                out[step, rank, f"{prefix}/attn_qk_logit_max"] = float(heads.max())
                out[step, rank, f"{prefix}/attn_entropy_nats"] = float(heads.mean() / 3)
                out[step, rank, f"{prefix}/act_absmax"] = float(rng.random() * 100)
                out[step, rank, f"{prefix}/grad_norm"] = float(rng.random())
                out[step, rank, f"{prefix}/update_ratio"] = float(rng.random() / 100)
                tokens = rng.integers(0, 100, EXPERTS)
                for e in range(EXPERTS):
                    out[step, rank, f"{prefix}/moe_tokens_count/expert_{e}"] = float(tokens[e])
                out[step, rank, f"{prefix}/moe_imbalance"] = float(tokens.max() / tokens.mean())
                nonfinite = 2.0 if (layer, step, rank) == ("layer_01", 7, 1) else 0.0
                out[step, rank, f"{prefix}/nonfinite_count"] = nonfinite
            out[step, rank, "monitors/global/attn_qk_logit_max"] = 1e9  # not a layer
        for step in WINDOWS:
            out.update(profile_window(step, rank, nested))
        out[9, rank, "capture/step/captured_count"] = 3.0
        out[9, rank, "capture/step/dropped_ring_full_count"] = 2.0 + rank
        out[9, rank, "capture/step/dropped_ring_full_bytes"] = 1024.0
        out[9, rank, "capture/step/dropped_closed_count"] = 0.0
    return out


def profile_window(step: int, rank: int, nested: bool = False) -> dict[tuple[int, int, str], float]:
    """One report window, names in the order the profiler writes them; ``nested`` adds
    the depth and order records and stores the sections in reverse order, so a reader
    that nests them correctly relies on the records, not on storage order."""
    scale = 1.0 + step / 100 + rank / 10  # each window and rank differs
    out = {(step, rank, "profile/step/time_ms"): STEP_MS * scale}
    for name, ms in SECTIONS.items():
        out[step, rank, f"profile/{name}/time_ms"] = ms * scale
        out[step, rank, f"profile/{name}/calls_count"] = 1.0
        if name == "a2a":
            for part, part_ms in PARTS.items():
                out[step, rank, f"profile/a2a/{part}_ms"] = part_ms * scale
    # Rank 1 is late: its router runs 3 ms longer than rank 0's.
    out[step, rank, "profile/router/time_ms"] += 3.0 * rank
    out[step, rank, "profile/a2a/late_rank"] = 1.0
    out[step, rank, "profile/self/host_ms"] = 0.05
    if not nested:
        return out
    out = dict(reversed(out.items()))
    for name, (depth, order) in NESTING.items():
        out[step, rank, f"profile/{name}/depth_count"] = float(depth)
        out[step, rank, f"profile/{name}/order_count"] = float(order)
    return out


def write_run(run_dir: Path, vals: dict[tuple[int, int, str], float], world_size: int = 2,
              ranks: tuple[int, ...] = (0, 1)) -> Path:  # fmt: skip
    """A run directory holding ``vals``: one shard per rank per half of the steps."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_json(run_dir, {"name": "known", "world_size": world_size,
                             "config": {"n_layers": 3, "lr": 0.001},
                             "env": {"torch": "9.9", "syncless": "0.1.0"}})  # fmt: skip
    for rank in ranks:
        sink = ParquetSink(run_dir / METRICS_DIR, rank, flush_interval_s=3600)
        for half in (range(0, 5), range(5, STEPS)):
            sink.write([StepRecord("known", s, r, n, v, 1000.0 + s)
                        for (s, r, n), v in vals.items() if r == rank and s in half])  # fmt: skip
            sink.flush()
        sink.close()
    return run_dir
