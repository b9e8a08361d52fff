"""Every command shown in README.md and docs/ runs here, so the docs cannot drift (#21).

tests/doc_commands.py extracts the commands from the Markdown. Each has an entry in
``RUN`` (a check that runs it for real, as a subprocess in a fresh directory, and
asserts what the docs promise) or ``SKIP`` (a one-line reason); a command without an
entry fails ``test_every_documented_command_has_an_entry``. Substitutions (``Ctx.argv``):
a GPU preset becomes ``tiny``, a demo gets ``--steps`` (3 unless its check needs more),
``--nproc-per-node 8`` becomes 2, ``RUN_DIR`` a demo run made once per module,
``my_monitors.py`` and ``src/`` are files made here.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import doc_commands as dc
import numpy as np
import pytest
from doc_commands import Ctx, sql, steps_of, table_rows

from syncless.demo.config import DemoConfig, preset

DEMO_NAMES = {f"demo/step/{n}" for n in
              ("loss", "balance_loss", "grad_norm", "lr", "step_ms", "tokens_per_s")}  # fmt: skip
HOOK = """import torch


class Monitor:
    def attach(self, module: torch.nn.Module) -> None:
        module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.last = output.abs().max().item()
"""  # one finding: SL001 on line 9, in forward hook `Monitor._hook`


SKIP: dict[str, str] = {
    "pip install -e . && syncless demo": "CI's .ci/run installs the package; `syncless demo` runs as its own entry",
    'pip install -e ".[test]" && python -m pytest -q': "CI's .ci/run installs the test extra and runs the suite (this file included)",
    'pip install "syncless[transformers]"': "an install; the test extra CI's .ci/run installs includes it (fsdp2_loop below needs it)",
    'pip install "syncless[lightning]"': "an install; the test extra CI's .ci/run installs includes it",
    "bash .ci/run": "CI itself: a fresh venv and the whole suite, this file included",
    "syncless demo --nproc N": "placeholder N; its twin `syncless demo --nproc 2` runs",
    "torchrun ... -m syncless.demo": "placeholder; its twin `torchrun --nproc-per-node 8 -m syncless.demo ...` runs",
    "syncless lint PATH...": "placeholder PATH; its twin `syncless lint syncless/ my_monitors.py` runs",
    "python -m syncless.capture.simulate TRACE.json": "placeholder; its twin with tests/capture/traces/static.json runs",
    'syncless query RUN_DIR "SELECT ..." --format csv': "placeholder SQL; README's concrete --format csv query runs (and json)",
    "syncless lint: 1 finding in 1 file (12 files checked)": "program output; its form is asserted by `syncless lint syncless/ my_monitors.py`",
    "syncless monitors: budget 1.0% of a 183.7 ms step, stack 0.73%: attention every 7 (2.80 ms per active step, 0.22%); moe every 1 (0.00 ms per active step, 0.00%); activations every 2 (0.44 ms per active step, 0.12%); nonfinite every 2 (0.58 ms per active step, 0.16%); norms every 16 (6.89 ms per active step, 0.23%)": "program output (H200 numbers); its form is asserted by `syncless demo --monitors all`",
}  # fmt: skip

RUN: dict[str, Callable[[Ctx], None]] = {}


def runs(*commands: str):
    def register(fn):
        for command in commands:
            RUN[command] = fn
        return fn

    return register


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("shared") / "run"
    argv = [dc.SYNCLESS, "demo", "--steps", "3", "--run-dir", str(run_dir), "--quiet"]
    p = subprocess.run(argv, cwd=run_dir.parent, capture_output=True, text=True, timeout=dc.TIMEOUT)
    assert p.returncode == 0, p.stderr
    return run_dir


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
    # (docs/demo.md's preset table; README: "24 layers, d_model 1024, 8 experts top-2, seq 1024")
    documented = {
        "small": (4, 192, 6, 8, 2, 384, 128, 16, 300),
        "large": (24, 1024, 16, 8, 2, 2048, 1024, 8, 100),
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
              "--capture-windows", "--no-shared-expert"]  # fmt: skip
    assert [f for f in flags if f"{f} " not in out and f"[{f}" not in out] == []


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
    # tiny: one count drain per MoE layer (2) and one loss read-back per step
    assert sql(run_dir, "SELECT step, value FROM metrics WHERE name = 'guard/step/syncs_count' "
                        "ORDER BY step") == [(1, 3.0), (2, 3.0), (3, 3.0)]  # fmt: skip
    assert "syncless.demo.dispatch" in p.stderr and "syncless.demo.train" in p.stderr  # the table


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


# ---- the run store ----------------------------------------------------------------


@runs(
    f"syncless query {dc.README_RUN} \"SELECT step, value FROM metrics WHERE name = 'demo/step/loss'\""
)
def _query_loss(ctx: Ctx) -> None:
    rows = table_rows(ctx.run(ctx.argv()).stdout)
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert all(4.0 < float(r[1]) < 7.0 for r in rows)  # near ln(256) = 5.55 at the start


@runs(
    "syncless query RUN_DIR \"SELECT step, rank, value FROM metrics WHERE name = 'demo/step/step_ms'\""
)
def _query_step_ms(ctx: Ctx) -> None:
    rows = table_rows(ctx.run(ctx.argv()).stdout)
    assert [r[:2] for r in rows] == [["0", "0"], ["1", "0"], ["2", "0"]]
    assert all(float(r[2]) > 0 for r in rows)


@runs('syncless query RUN_DIR "SELECT name, avg(value) FROM metrics GROUP BY name" --format csv')
def _query_csv(ctx: Ctx) -> None:
    table = list(csv.reader(io.StringIO(ctx.run(ctx.argv()).stdout)))
    assert table[0][0] == "name" and {r[0] for r in table[1:]} == DEMO_NAMES
    argv = ctx.argv()
    argv[-1] = "json"  # "# or json"
    rows = json.loads(ctx.run(argv).stdout)
    assert {r["name"] for r in rows} == DEMO_NAMES and all(len(r) == 2 for r in rows)


@runs('syncless query RUN_DIR "SELECT ..." --strict')
def _query_strict(ctx: Ctx) -> None:
    argv = ctx.argv(**{"SELECT ...": "SELECT count(*) FROM metrics"})
    assert table_rows(ctx.run(argv).stdout) == [["18"]]  # 6 names x 3 steps
    broken = ctx.cwd / "broken"
    shutil.copytree(argv[2], broken)
    (broken / "metrics" / "rank00000-000099.parquet").write_bytes(b"not parquet")
    argv[2] = str(broken)
    p = ctx.run(argv, status=1)  # fails on the unreadable shard, naming it
    assert "rank00000-000099.parquet" in p.stderr
    p = ctx.run(argv[:-1])  # without --strict: skipped with a warning
    assert "syncless: warning:" in p.stderr and "rank00000-000099.parquet" in p.stderr
    assert table_rows(p.stdout) == [["18"]]


@runs("syncless query ... | head -1")
def _query_head(ctx: Ctx) -> None:
    run_dir = str(ctx.request.getfixturevalue("shared_run"))
    big = "SELECT a.* FROM metrics a, metrics b, metrics c"  # 18^3 rows: far past a pipe buffer
    script = '"$0" query "$1" "$2" --format csv | head -1; exit "${PIPESTATUS[0]}"'
    p = ctx.run(["bash", "-c", script, dc.SYNCLESS, run_dir, big])
    assert p.stdout == "run,step,rank,name,value,time\n" and p.stderr == ""  # quietly, status 0


@runs("syncless check RUN_DIR")
def _check(ctx: Ctx) -> None:
    out = ctx.run(ctx.argv()).stdout
    assert out.rstrip().endswith(": healthy")
    # rank 0: 18 records, steps 0..2, 3 distinct, stride 1, none missing
    assert re.search(r"^\s*0\s+18\s+0\s+2\s+3\s+1\s+0\s", out, re.M), out


@runs("syncless check", "syncless lint")
def _bare(ctx: Ctx) -> None:  # the command's name: without its arguments, a usage error
    p = ctx.run(ctx.argv(), status=2)
    assert f"usage: {ctx.command} " in p.stderr


# ---- lint, the simulator, examples and benches ------------------------------------


@runs("syncless lint [--format {text,json}] [--config FILE] [--hot-path-pattern GLOB]")
def _lint_synopsis(ctx: Ctx) -> None:
    usage = " ".join(ctx.run([dc.SYNCLESS, "lint", "--help"]).stdout.split()).replace(" [-h]", "")
    assert f"usage: {ctx.command} [--exclude GLOB] [--ignore CODE] PATH [PATH ...]" in usage


@runs("syncless lint syncless/ my_monitors.py")
def _lint(ctx: Ctx) -> None:
    (ctx.cwd / "my_monitors.py").write_text(HOOK)
    checked = len(list((dc.ROOT / "syncless").rglob("*.py"))) + 1
    col = HOOK.splitlines()[8].index(".item()") + 1
    # also the comment's `python -m syncless.lint PATH...`
    for argv in (ctx.argv(), [sys.executable, "-m", "syncless.lint", *ctx.argv()[2:]]):
        p = ctx.run(argv, status=1)  # 1: findings (in my_monitors.py; syncless/ is clean)
        m = re.fullmatch(r"my_monitors\.py:9:(\d+): SL001 `\.item\(\)` .* in forward hook "
                         r"`Monitor\._hook` \(.*\)\n", p.stdout)  # fmt: skip
        assert m and col <= int(m.group(1)) <= col + 1, p.stdout
        assert p.stderr == f"syncless lint: 1 finding in 1 file ({checked} files checked)\n"


@runs("syncless lint --format json src/ > findings.json")
def _lint_json(ctx: Ctx) -> None:
    (ctx.cwd / "src").mkdir()
    (ctx.cwd / "src" / "mon.py").write_text(HOOK)
    with (ctx.cwd / "findings.json").open("w") as out:
        ctx.run(ctx.argv()[: ctx.argv().index(">")], status=1, stdout=out)
    (finding,) = json.loads((ctx.cwd / "findings.json").read_text())
    assert set(finding) == {"path", "line", "col", "rule", "message", "function", "hint"}
    assert (finding["rule"], finding["line"], finding["function"]) == ("SL001", 9, "Monitor._hook")


@runs("python -m syncless.capture.simulate tests/capture/traces/static.json")
def _simulate(ctx: Ctx) -> None:
    summary = json.loads(ctx.run(ctx.argv()).stdout)
    shown = {"occurrences": 20, "transfers": 20, "overruns": 5, "converged_at_occurrence": 5,
             "grants": [8388608], "bytes_overlapping_critical": 90509184, "fallback": False}  # fmt: skip
    assert {k: summary[k] for k in shown} == shown  # docs/capture.md's summary


@runs("python -m syncless.capture.simulate: error: ...")
def _simulate_error(ctx: Ctx) -> None:  # the documented message of an invalid trace
    (ctx.cwd / "bad.json").write_text('{"bogus": 1}')
    argv = [sys.executable, "-m", "syncless.capture.simulate", "bad.json"]
    assert ctx.run(argv, status=2).stderr.startswith(ctx.command.removesuffix("..."))


@runs(
    "torchrun --nproc-per-node 2 examples/fsdp2_loop.py",
    "torchrun --nproc-per-node 2 examples/fsdp2_loop.py --compile-backend aot_eager",
)
def _fsdp2_loop(ctx: Ctx) -> None:  # gloo on CPU; the default backend compiles with inductor
    p = ctx.run([*ctx.argv(), "--steps", "3"])
    run_dir = ctx.cwd / p.stdout.splitlines()[-1]  # rank 0 prints the run directory
    assert json.loads((run_dir / "run.json").read_text())["world_size"] == 2
    found = dict(sql(run_dir, "SELECT name, max(value) FROM metrics WHERE name IN ("
                              "'monitors/layer_01/param_norm', 'monitors/layer_01/grad_norm', "
                              "'monitors/global/attn_qk_logit_max', 'monitors/global/act_absmax', "
                              "'monitors/self/attention_recompute_skipped_count') GROUP BY name"))  # fmt: skip
    assert len(found) == 5  # every monitor recorded
    assert found["monitors/self/attention_recompute_skipped_count"] > 0  # recomputes skipped


@runs("python bench/pacing_ep.py --nproc 2")
def _pacing_bench(ctx: Ctx) -> None:  # gloo on CPU at tiny size; --no-record keeps RESULTS.md
    results = (dc.ROOT / "bench" / "RESULTS.md").read_bytes()
    tiny = ["--preset", "tiny", "--rounds", "1", "--warmup", "1", "--block", "2", "--no-record"]
    out = ctx.run([*ctx.argv(), *tiny]).stdout
    names = [line.split()[0] for line in out.splitlines() if line[:1].isalpha()]
    for config in ("drain", "static", *(f"static-paced/{d}" for d in (0, 1, 2, 4, 8)), "lookahead"):
        assert config in names, out
    assert re.search(
        r"^(faster than drain with peak within 5%|no configuration is faster)", out, re.M
    )
    assert (dc.ROOT / "bench" / "RESULTS.md").read_bytes() == results


# ---- the table --------------------------------------------------------------------


def test_extract_finds_fenced_prompted_and_wrapped_inline_commands():
    text = "Run `syncless demo\n--quiet` or\n```bash\n$ syncless  check X   # why\nls\n```\n"
    text += "```text\n`syncless lint` inside a fence\n```\n`python -m a` and `pip x`\n"
    found = [(4, "syncless check X"), (1, "syncless demo --quiet"), (10, "python -m a")]
    assert dc.extract(text) == found


def test_every_documented_command_has_an_entry():
    found = dc.documented_commands()
    assert not set(RUN) & set(SKIP)
    missing = [f"{where[0]}: {cmd!r}" for cmd, where in found.items() if cmd not in RUN | SKIP]
    assert not missing, (
        "documented commands without an entry in RUN (a check that runs it) or SKIP (a reason) "
        "in tests/test_documented_commands.py:\n" + "\n".join(missing)
    )
    stale = sorted((set(RUN) | set(SKIP)) - set(found))
    assert not stale, (
        "entries for commands no longer in the docs (update or remove):\n" + "\n".join(stale)
    )


def params(table: dict) -> list:
    """One test id per command; several ranks are `dist`, the examples and benches `slow`."""
    out = []
    for c in sorted(table):
        marks = [pytest.mark.dist] if re.search(r"--nproc|^torchrun", c) else []
        marks += [pytest.mark.slow] if re.search(r"examples/|bench/", c) else []
        out.append(pytest.param(c, marks=marks, id=c if len(c) <= 100 else c[:97] + "..."))
    return out


@pytest.mark.parametrize("command", params(RUN))
def test_documented_command_runs(command, tmp_path, request):
    RUN[command](Ctx(command, tmp_path, request))


@pytest.mark.parametrize("command", params(SKIP))
def test_documented_command_skipped(command):
    pytest.skip(SKIP[command])
