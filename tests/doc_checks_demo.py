"""The checks of the documented demo commands (tests/test_documented_commands.py)."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
from doc_commands import DEMO_NAMES, Ctx, runs, sql, steps_of

from syncless.demo.config import DemoConfig, preset

# ---- the demo ---------------------------------------------------------------------


@runs("syncless demo")
def _demo(ctx: Ctx) -> None:
    p, run_dir = ctx.demo()
    assert re.fullmatch(r"\d{8}-\d{6}-demo-tiny", run_dir.name)  # runs/<time>-<name>/
    for shown in ("loss", "tokens/s", "step ms"):
        assert shown in p.stderr  # the live view (plain lines in a pipe)
    info = json.loads((run_dir / "run.json").read_text())
    assert {"format", "name", "start_time", "world_size", "config", "env", "segments"} <= set(info)
    env = {"python", "torch", "syncless", "cuda", "host", "platform", "argv", "git_commit"}
    assert env <= set(info["env"])  # and "gpu" on CUDA
    assert info["world_size"] == 1 and len(info["segments"]) == 1
    assert list((run_dir / "metrics").glob("rank00000-*.parquet"))
    assert steps_of(run_dir, "demo/%") == {n: [0, 1, 2] for n in DEMO_NAMES}


@runs("syncless demo --preset small", "syncless demo --preset large")
def _demo_preset(ctx: Ctx) -> None:
    # the GPU-sized presets become tiny; their documented sizes are checked here
    # (docs/demo.md's preset table; README: "8 layers, d_model 2560, 8 experts top-2 + shared,
    # seq 2048")
    documented = {
        "small": (4, 192, 6, 8, 2, 384, 128, 16, 300),
        "large": (8, 2560, 20, 8, 2, 2048, 2048, 12, 120),
    }[ctx.command.split()[-1]]
    c = preset(ctx.command.split()[-1])
    keys = ("n_layers", "d_model", "n_heads", "n_experts", "top_k", "expert_hidden", "seq_len",
            "batch_size", "steps")  # fmt: skip
    assert tuple(getattr(c, k) for k in keys) == documented
    _, run_dir = ctx.demo()
    assert steps_of(run_dir, "demo/step/loss") == {"demo/step/loss": [0, 1, 2]}


@runs("syncless demo --steps 500 --lr 1e-3 --n-experts 8 --no-shared-expert")
def _demo_knobs(ctx: Ctx) -> None:
    _, run_dir = ctx.demo()  # the appended --steps 3 wins
    config = json.loads((run_dir / "run.json").read_text())["config"]
    assert (config["steps"], config["lr"], config["n_experts"], config["shared_expert"]) == (
        3, 1e-3, 8, False,
    )  # fmt: skip
    assert steps_of(run_dir, "demo/step/loss") == {"demo/step/loss": [0, 1, 2]}


@runs(
    "syncless demo --nproc 2",
    "syncless demo --nproc 2 --expert-parallel",
    "torchrun --nproc-per-node 8 -m syncless.demo --preset large --expert-parallel",
)
def _demo_two_ranks(ctx: Ctx) -> None:
    _, run_dir = ctx.demo()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["world_size"] == 2
    assert info["config"]["expert_parallel"] == ("--expert-parallel" in ctx.command)
    rows = sql(run_dir, "SELECT step, list(value ORDER BY rank), list(rank ORDER BY rank) "
                        "FROM metrics WHERE name = 'demo/step/loss' GROUP BY step ORDER BY step")  # fmt: skip
    assert [r[0] for r in rows] == [0, 1, 2]
    for _, losses, ranks in rows:
        assert ranks == [0, 1] and losses[0] == losses[1]  # a global mean, on every rank


@runs("syncless demo --quiet")
def _demo_quiet(ctx: Ctx) -> None:
    p, run_dir = ctx.demo()
    assert p.stdout.splitlines() == [f"runs/{run_dir.name}"]  # only the run directory


@runs("syncless demo --run-dir runs/mine --resume")
def _demo_resume(ctx: Ctx) -> None:
    ctx.demo()  # no run there: it starts one
    _, run_dir = ctx.demo()  # a second segment; steps go on from the last stored one
    assert run_dir.name == "mine"
    segments = json.loads((run_dir / "run.json").read_text())["segments"]
    assert [s["first_step"] for s in segments] == [0, 3]
    assert sql(run_dir, "SELECT count(*), count(DISTINCT step), min(step), max(step) "
                        "FROM metrics WHERE name = 'demo/step/loss'") == [(6, 6, 0, 5)]  # fmt: skip


@runs("syncless demo --help")
def _demo_help(ctx: Ctx) -> None:
    out = " ".join(ctx.run(ctx.argv()).stdout.split())
    flags = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(DemoConfig)]
    flags += ["--preset", "--nproc", "--run-dir", "--resume", "--quiet", "--sync-census",
              "--monitors", "--monitor-every", "--monitor-budget", "--profile", "--profile-every",
              "--profile-trace", "--dataplane", "--capture", "--capture-every", "--capture-point",
              "--capture-windows", "--no-shared-expert", "--sink"]  # fmt: skip
    assert [f for f in flags if f"{f} " not in out and f"[{f}" not in out] == []


@runs("syncless demo --sink tensorboard --sink wandb")
def _demo_sinks(ctx: Ctx) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = ctx.demo()
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for name in DEMO_NAMES:  # rank 0's records, as the shards hold them
        query = f"SELECT step, value FROM metrics WHERE name = '{name}' ORDER BY step"
        stored = sql(run_dir, query)
        assert [(e.step, np.float32(e.value)) for e in events.Scalars(name)] == [
            (step, np.float32(value)) for step, value in stored
        ], name
    (log,) = (run_dir / "wandb").glob("wandb/offline-run-*/run-*.wandb")  # an offline run
    # Its history rows; tests/run/test_sink_wandb.py reads them back one by one.
    assert b"tokens_per_s" in log.read_bytes()


# ---- the demo's tools -------------------------------------------------------------


@runs("syncless demo --monitors all")
def _demo_monitors(ctx: Ctx) -> None:
    p, run_dir = ctx.demo()
    line = (
        r"syncless monitors: budget 1\.0% of a [\d.]+ ms step, stack [\d.]+%: attention every \d+ "
    )
    assert re.search(line + r".*; moe every \d+ .*; norms every \d+ ", p.stderr), p.stderr
    found = steps_of(run_dir, "monitors/layer_01/%")
    for name in ("attn_qk_logit_max", "moe_tokens_count", "act_absmax", "nonfinite_count"):
        assert any(n.startswith(f"monitors/layer_01/{name}") for n in found), name


@runs("syncless demo --monitors all --monitor-budget 0")
def _demo_fixed_cadences(ctx: Ctx) -> None:
    _, run_dir = ctx.demo()
    found = steps_of(run_dir, "monitors/layer_00/%")
    # docs/monitors/README.md's fastest cadences: every step, norms every 10 steps
    for name, steps in (("attn_qk_logit_max", [0, 1, 2]), ("moe_tokens_count", [0, 1, 2]),
                        ("act_absmax", [0, 1, 2]), ("nonfinite_count", [0, 1, 2]),
                        ("param_norm", [0]), ("grad_norm", [0])):  # fmt: skip
        hits = [s for n, s in found.items() if n.startswith(f"monitors/layer_00/{name}")]
        assert hits and all(s == steps for s in hits), (name, hits)


PHASES = ("data", "forward", "backward", "grad_sync", "optimizer", "log",
          "attention", "router", "experts", "shared_expert")  # fmt: skip


@runs(
    "syncless demo --profile events", "syncless demo --monitors all --profile events --sync-census"
)
def _demo_profile(ctx: Ctx) -> None:
    _, run_dir = ctx.demo(steps=10)  # the profiler reports every 10 steps: once, at step 9
    found = steps_of(run_dir, "profile/%/time_ms")
    assert {f"profile/{s}/time_ms": [9] for s in PHASES}.items() <= found.items()
    if "--monitors" in ctx.command:
        assert steps_of(run_dir, "monitors/layer_00/attn_qk_logit_max%")
        assert steps_of(run_dir, "guard/step/syncs_count") == {"guard/step/syncs_count": [1, 2, 3]}


@runs("syncless demo --profile events --profile-trace")
def _demo_profile_trace(ctx: Ctx) -> None:
    _, run_dir = ctx.demo()
    assert {f"profile/{s}/time_ms": [0, 1, 2] for s in PHASES}.items() <= steps_of(
        run_dir, "profile/%/time_ms"
    ).items()  # every step
    routing = run_dir / "trace" / "routing" / "rank00000"
    assert sorted(f.name for f in routing.iterdir()) == [f"step_{s:07d}.npz" for s in range(3)]
    with np.load(routing / "step_0000001.npz") as z:  # tiny: 8 x 64 tokens, top 2 of 4 experts
        assert sorted(z) == ["layer_00", "layer_01"]
        for ids in z.values():
            assert ids.shape == (512, 2) and ids.min() >= 0 and ids.max() < 4


@runs("syncless demo --sync-census", "syncless demo --sync-census 3")
def _demo_census(ctx: Ctx) -> None:
    p, run_dir = ctx.demo(steps=4)  # three steps after step 0
    # none (docs/demo.md): the experts' counts stay on the device, the loss is read late
    assert sql(run_dir, "SELECT step, value FROM metrics WHERE name = 'guard/step/syncs_count' "
                        "ORDER BY step") == [(1, 0.0), (2, 0.0), (3, 0.0)]  # fmt: skip
    assert "sync census: 0 syncs in 3 step(s)" in p.stderr  # the table's title


@runs("syncless demo --dataplane")
def _demo_dataplane(ctx: Ctx) -> None:
    _, run_dir = ctx.demo()
    rows = sql(run_dir, "SELECT name, list(value ORDER BY step) FROM metrics WHERE name IN ("
                        "'dataplane/step/put/keys_count', 'dataplane/step/get/keys_count', "
                        "'dataplane/step/guard/mismatches_count') GROUP BY name")  # fmt: skip
    assert dict(rows) == {  # one key per sequence: tiny's batch of 8, every row verified
        "dataplane/step/put/keys_count": [8.0] * 3,
        "dataplane/step/get/keys_count": [8.0] * 3,
        "dataplane/step/guard/mismatches_count": [0.0] * 3,
    }


@runs("syncless demo --capture 0,1", "syncless demo --capture all --capture-point moe_input")
def _demo_capture(ctx: Ctx) -> None:
    _, run_dir = ctx.demo()
    point = "moe_input" if "moe_input" in ctx.command else "hidden"
    rows = sql(run_dir, "SELECT tag, step, shape FROM captures ORDER BY tag")
    # every 10 steps by default: step 0; tiny's [batch 8, seq 64, d_model 64]
    assert rows == [(f"layer_0{i}/{point}", 0, [8, 64, 64]) for i in (0, 1)]


@runs(
    "syncless demo --nproc 2 --expert-parallel --fix-router --ep-splits static-paced --run-ahead 2"
)
def _demo_pacing(ctx: Ctx) -> None:
    _, run_dir = ctx.demo()
    rows = sql(run_dir, "SELECT name, sum(value) FILTER (WHERE step >= 1), count(DISTINCT rank) "
                        "FROM metrics WHERE name IN ('pacing/step/drains_count', "
                        "'pacing/plan/hits_count', 'pacing/step/run_ahead_points_count') "
                        "GROUP BY name")  # fmt: skip
    found = {name: (total, ranks) for name, total, ranks in rows}
    assert found["pacing/step/drains_count"] == (0.0, 2)  # no drain after step 0
    assert found["pacing/plan/hits_count"][0] > 0
    assert found["pacing/step/run_ahead_points_count"][0] > 0
