"""The checks of the documented query, check, lint, simulator, example and bench commands
(tests/test_documented_commands.py)."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import sys

import doc_commands as dc
from doc_commands import DEMO_NAMES, Ctx, runs, sql, table_rows

from syncless.demo.config import preset

HOOK = """import torch


class Monitor:
    def attach(self, module: torch.nn.Module) -> None:
        module.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.last = output.abs().max().item()
"""  # one finding: SL001 on line 9, in forward hook `Monitor._hook`


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


@runs("syncless compact RUN_DIR")
def _compact(ctx: Ctx) -> None:
    run_dir = ctx.cwd / "compacted"
    shutil.copytree(ctx.request.getfixturevalue("shared_run"), run_dir)
    before = ctx.run([dc.SYNCLESS, "query", str(run_dir), "SELECT count(*) FROM metrics"]).stdout
    out = ctx.run([dc.SYNCLESS, "compact", str(run_dir)]).stdout
    assert re.match(r"syncless compact: \d+ shards -> 1 \(", out), out  # the demo: rank 0
    after = ctx.run([dc.SYNCLESS, "query", str(run_dir), "SELECT count(*) FROM metrics"]).stdout
    assert table_rows(after) == table_rows(before) == [["18"]]


@runs(
    "syncless check", "syncless lint", "syncless trace", "syncless query", "syncless compact",
    "syncless compare", "syncless report",
)  # fmt: skip
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


@runs("python -m bench.demo pacing_ep --nproc 2")
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


@runs("python -m bench.demo mfu --sweep")
def _demo_mfu_sweep(ctx: Ctx) -> None:  # every shape shrunk to seconds on a CPU (--smoke)
    results = (dc.ROOT / "bench" / "RESULTS.md").read_bytes()
    out = ctx.run([*ctx.argv(), "--smoke", "--no-record"]).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("--sweep around demo")]
    assert line.count("tokens/s") == 7, line  # every shape of bench/demo/mfu.py's SHAPES ran
    assert (dc.ROOT / "bench" / "RESULTS.md").read_bytes() == results


@runs("python -m bench.demo mfu --ranks")
def _demo_mfu_ranks(ctx: Ctx) -> None:  # tiny on CPU ranks over gloo (--smoke)
    results = (dc.ROOT / "bench" / "RESULTS.md").read_bytes()
    out = ctx.run([*ctx.argv(), "--smoke", "--no-record"]).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("--ranks, demo")]
    runs = line.split(": ", 1)[1].split("; syncless check: ")
    assert len(runs) == 4, line  # one rank, expert parallel, data parallel
    assert all(r.startswith("exit 0 (healthy)") for r in runs[1:]), line
    assert line.count("(finite)") == 3 and "NOT FINITE" not in line, line
    assert "2 rank(s) on CPU, backend gloo, ep lookahead" in line, line  # --ep-splits auto
    assert "2 rank(s) on CPU, backend gloo, ep None" in line, line
    assert (dc.ROOT / "bench" / "RESULTS.md").read_bytes() == results


# ---- syncless report (docs/report.md) -----------------------------------------------


@runs("syncless report RUN_DIR")
def _report_html(ctx: Ctx) -> None:
    argv = ctx.argv()
    run_dir = ctx.cwd / "run"  # a copy: the shared run stays as the demo left it
    shutil.copytree(argv[2], run_dir)
    argv[2] = str(run_dir)
    p = ctx.run(argv)
    page = run_dir / "report.html"  # the default: RUN_DIR/report.html
    assert f"wrote {page}" in p.stdout
    text = page.read_text()
    for section in ("run", "curves"):  # a plain demo run: no monitors, no profiler
        assert f'<section id="{section}">' in text
    assert '<section id="attention">' not in text and "Plotly.newPlot(" in text
    markup = re.sub(r"<script[^>]*>.*?</script>", "", text, flags=re.S)
    assert not re.search(r"(?:src|href)=[\"']?https?://", markup)  # opens offline
    out = ctx.cwd / "elsewhere.html"
    ctx.run([*argv, "-o", str(out)])
    assert out.stat().st_size > 4_000_000  # plotly.js inlined


# ---- syncless summary and trace (docs/report.md) ------------------------------------


def _profiled_run(ctx: Ctx) -> str:
    """A tiny demo run with profiler records: it reports every 2 steps (every 10 by
    default, which 5 steps never reach)."""
    run_dir = ctx.cwd / "profiled"
    demo = ["demo", "--profile", "events", "--profile-every", "2", "--steps", "5"]
    ctx.run([dc.SYNCLESS, *demo, "--run-dir", str(run_dir), "--quiet"])
    return str(run_dir)


@runs("syncless summary RUN_DIR")
def _summary(ctx: Ctx) -> None:
    out = ctx.run(ctx.argv()).stdout  # the shared run: a plain demo, no profiler
    assert re.search(r"world size\s+1 \(1 with records\)", out) and "demo/step/loss" in out
    assert "where step time goes" not in out and "worst layers" not in out
    argv = ctx.argv()
    argv[2] = _profiled_run(ctx)
    out = ctx.run(argv).stdout
    assert "where step time goes" in out and re.search(r"^\s+forward\s", out, re.M)
    assert "profile/self/host_ms" in out  # what syncless cost


@runs("syncless trace RUN_DIR -o trace.json")
def _trace(ctx: Ctx) -> None:
    argv = ctx.argv()
    p = ctx.run(argv, status=1)  # the shared run was trained without a profiler
    assert "no profiler records" in p.stderr
    argv[2] = _profiled_run(ctx)
    assert "ui.perfetto.dev" in ctx.run(argv).stdout
    events = json.loads((ctx.cwd / "trace.json").read_text())["traceEvents"]
    slices = {e["name"]: e for e in events if e["ph"] == "X"}
    assert {"step 1", "step 3", "forward", "attention", "backward"} <= slices.keys()
    forward, attention = slices["forward"], slices["attention"]
    assert forward["ts"] <= attention["ts"] <= forward["ts"] + forward["dur"]  # nested
    recorded = sql(argv[2], "SELECT value FROM metrics WHERE name = 'profile/backward/time_ms' "
                            "AND step = 3")[0][0]  # fmt: skip
    assert slices["backward"]["dur"] == round(recorded * 1e3, 3)  # the last window's


# ---- captures ---------------------------------------------------------------------


_CAPTURED: list[str] = []  # one demo run with captures, shared by the checks below


def _capture_run(ctx: Ctx) -> str:
    """A demo run with the hidden states of both layers captured for 3 steps (made once)."""
    if not _CAPTURED:
        run_dir = ctx.request.getfixturevalue("tmp_path_factory").mktemp("captured") / "run"
        argv = [dc.SYNCLESS, "demo", "--steps", "3", "--capture", "0,1", "--run-dir", str(run_dir)]
        ctx.run([*argv, "--quiet", "--no-report"])
        _CAPTURED.append(str(run_dir))
    return _CAPTURED[0]


@runs("syncless captures RUN_DIR")
def _captures(ctx: Ctx) -> None:
    run_dir = _capture_run(ctx)
    words = [run_dir if w == str(ctx.request.getfixturevalue("shared_run")) else w
             for w in ctx.argv()]  # fmt: skip
    out = ctx.run([*words, "--format", "csv"]).stdout
    rows = {r["tag"]: r for r in csv.DictReader(io.StringIO(out))}
    tiny = preset("tiny")  # the demo's documented capture: [batch, seq, d_model] per layer
    shape = f"{tiny.batch_size}x{tiny.seq_len}x{tiny.d_model}"
    assert sorted(rows) == ["layer_00/hidden", "layer_01/hidden"]
    for row in rows.values():
        assert (row["shapes"], row["dtypes"], row["ranks"]) == (shape, "float32", "1")
        assert (
            int(row["bytes"])
            == int(row["tensors"]) * 4 * tiny.batch_size * tiny.seq_len * tiny.d_model
        )


@runs('syncless query RUN_DIR "SELECT tag, step, rank, nbytes FROM captures WHERE step = 100"')
def _query_captures(ctx: Ctx) -> None:
    run_dir = _capture_run(ctx)
    words = [run_dir if w == str(ctx.request.getfixturevalue("shared_run")) else w
             for w in ctx.argv()]  # fmt: skip
    out = ctx.run(words).stdout
    assert re.search(r"\btag\b.*\bstep\b.*\brank\b.*\bnbytes\b", out)  # the columns exist
    assert "0 row(s)" in out  # 3 steps: nothing at step 100
    every = ctx.run([*words[:-1], "SELECT tag, step FROM captures ORDER BY step, tag",
                     "--format", "csv"]).stdout  # fmt: skip
    assert every.splitlines()[1] == "layer_00/hidden,0"


# ---- several runs: compare, overlay, queries (docs/report.md, docs/run.md) ---------


_ABLATIONS: list[str] = []  # runs/base and runs/lr-1e-2, made once for the checks below


def _ablations(ctx: Ctx) -> dict[str, str]:
    """The docs' runs/base and runs/lr-1e-2: two 3-step demo runs, one with lr 1e-2."""
    if not _ABLATIONS:
        root = ctx.request.getfixturevalue("tmp_path_factory").mktemp("ablations") / "runs"
        for name, lr in (("base", None), ("lr-1e-2", "1e-2")):
            argv = [dc.SYNCLESS, "demo", "--steps", "3", "--run-dir", str(root / name)]
            ctx.run([*argv, *(["--lr", lr] if lr else []), "--quiet", "--no-report"])
        _ABLATIONS.append(str(root))
    root = _ABLATIONS[0]
    return {"runs": root, "runs/base": f"{root}/base", "runs/lr-1e-2": f"{root}/lr-1e-2"}


@runs(
    "syncless query runs \"SELECT run, lr, min(value) AS best FROM metrics m JOIN runs r USING (run) WHERE m.name = 'demo/step/loss' GROUP BY ALL ORDER BY best\""
)
def _query_runs(ctx: Ctx) -> None:
    rows = table_rows(ctx.run(ctx.argv(**_ablations(ctx))).stdout)
    assert sorted((r[0], float(r[1])) for r in rows) == [("base", 3e-3), ("lr-1e-2", 1e-2)]
    for run, _, best in rows:
        losses = sql(_ablations(ctx)[f"runs/{run}"],
                     "SELECT min(value) FROM metrics WHERE name = 'demo/step/loss'")  # fmt: skip
        assert float(best) == losses[0][0]


@runs('syncless query runs/base runs/lr-1e-2 "SELECT run, count(*) FROM metrics GROUP BY run"')
def _query_two_runs(ctx: Ctx) -> None:
    rows = table_rows(ctx.run(ctx.argv(**_ablations(ctx))).stdout)
    assert sorted(rows) == [["base", "18"], ["lr-1e-2", "18"]]  # 6 names x 3 steps each


@runs("syncless compare runs/base runs/lr-1e-2")
def _compare(ctx: Ctx) -> None:
    out = ctx.run(ctx.argv(**_ablations(ctx))).stdout
    assert "2 runs against the baseline base" in out and "demo/step/loss" in out
    assert re.search(r"lr-1e-2\s+0\.01\b", out)  # the one config key that differs
    assert re.search(r"^\s+lr-1e-2\s.*\s1\s+\S+\s*$", out, re.M)  # differs from step 1


@runs("syncless compare runs/base runs --format json")
def _compare_json(ctx: Ctx) -> None:
    doc = json.loads(ctx.run(ctx.argv(**_ablations(ctx))).stdout)
    assert [r["id"] for r in doc["runs"]] == ["base", "lr-1e-2"]  # base once, then the rest
    assert doc["config"]["differences"][0] == {"key": "lr", "values": [3e-3, 1e-2]}
    loss = doc["runs"][1]["divergence"]
    assert loss["first_different"] == 1  # step 0 is before the first update: equal


@runs("syncless report runs/base runs/lr-1e-2 -o compare.html")
def _report_overlay(ctx: Ctx) -> None:
    p = ctx.run(ctx.argv(**_ablations(ctx)))
    assert p.stdout.startswith("wrote compare.html (")
    text = (ctx.cwd / "compare.html").read_text()
    titles = re.findall(r'"title":\{"text":"([^"]*)"', text)
    assert '<section id="metrics">' in text
    assert "demo/step/loss" in [json.loads(f'"{t}"') for t in titles]  # plotly writes "\u002f"
    assert "1 key(s) differ" in text


# ---- stragglers (README, docs/stragglers.md) ----------------------------------------


@runs("syncless stragglers RUN_DIR")
def _stragglers(ctx: Ctx) -> None:
    assert "no stragglers" in ctx.run(ctx.argv()).stdout  # the shared run has no profiler


@runs("syncless demo --nproc 4 --straggle 2:backward:20")
def _demo_straggle(ctx: Ctx) -> None:
    p, run_dir = ctx.demo(steps=30)  # the profiler reports every 10 steps; the first warms up
    assert "rank 2 slow in backward" in p.stderr, p.stderr[-2000:]
    got = json.loads(ctx.run([dc.SYNCLESS, "stragglers", str(run_dir), "--format", "json"]).stdout)
    assert (2, "backward") in {(v["rank"], v["section"]) for v in got}
