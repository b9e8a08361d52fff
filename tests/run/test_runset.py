"""Several runs read as one (issue #48): which paths are runs, their ids, the ``runs``
table, and ``metrics`` with a run column, checked against DuckDB reading the Parquet
files directly."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import duckdb
import pytest
from run_store_helpers import make_run, write_shards

from syncless.cli import main
from syncless.errors import UsageError
from syncless.run import open_runs
from syncless.run.rundir import METRICS_DIR, write_run_json
from syncless.run.runset import find_runs


def ablation(root: Path, folder: str, lr: float, steps: list[int], **config) -> Path:
    """A run under ``root`` whose config holds ``lr`` and ``config``, with 2 names a step."""
    run = make_run(root / folder)
    write_run_json(run, {"name": f"abl-{folder}", "world_size": 1, "start_time": 1.8e9,
                         "config": {"lr": lr, **config}})  # fmt: skip
    write_shards(run, 0, [steps])
    return run


def direct(sql: str, runs: dict[str, Path]) -> list[tuple]:
    """``sql`` over a ``metrics`` built by DuckDB from the shard files, the run id added."""
    parts = [
        f"SELECT '{rid}' AS run, step, rank, name, value, time "
        f"FROM read_parquet('{path / METRICS_DIR}/*.parquet')"
        for rid, path in runs.items()
    ]
    con = duckdb.connect()
    con.execute(f"CREATE VIEW metrics AS {' UNION ALL '.join(parts)}")
    return con.sql(sql).fetchall()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    ablation(tmp_path / "runs", "a", 0.1, [0, 1, 2], layers=2)
    ablation(tmp_path / "runs", "b", 0.2, [0, 1], layers=4, opt={"beta": 0.9})
    ablation(tmp_path / "runs" / "project", "c", 0.3, [5, 6, 7])  # two levels down
    (tmp_path / "runs" / "tensorboard").mkdir()  # not a run: passed over
    return tmp_path / "runs"


def test_a_root_folder_finds_its_runs_two_levels_down(root):
    runs = find_runs([root])
    assert [r.id for r in runs] == ["a", "b", "c"]
    assert [r.info["name"] for r in runs] == ["abl-a", "abl-b", "abl-c"]


def test_metrics_of_several_runs_match_duckdb_on_the_files(root):
    paths = {"a": root / "a", "b": root / "b", "c": root / "project" / "c"}
    sql = "SELECT run, name, count(*), sum(value), min(step), max(step) FROM metrics "
    sql += "GROUP BY ALL ORDER BY ALL"
    with open_runs([root]) as store:
        assert store.query(sql)[1] == direct(sql, paths)
        assert store.query("SELECT DISTINCT run FROM metrics ORDER BY 1")[1] == [
            ("a",),
            ("b",),
            ("c",),
        ]
    with open_runs([root / "a", root / "project" / "c"]) as store:  # runs named one by one
        assert store.query(sql)[1] == direct(sql, {"a": paths["a"], "c": paths["c"]})


def test_the_runs_table_has_a_typed_column_per_config_field(root):
    with open_runs([root]) as store:
        columns, rows = store.query("SELECT * FROM runs ORDER BY run")
        assert columns == ["run", "name", "path", "start", "world_size", "git_commit",
                           "lr", "layers", "opt.beta"]  # fmt: skip
        start = datetime.datetime.fromtimestamp(1.8e9)
        assert rows == [
            ("a", "abl-a", str(root / "a"), start, 1, None, 0.1, 2, None),
            ("b", "abl-b", str(root / "b"), start, 1, None, 0.2, 4, 0.9),
            ("c", "abl-c", str(root / "project" / "c"), start, 1, None, 0.3, None, None),
        ]
        # Numbers stay numbers: a config field filters and joins as one.
        joined = store.query(
            "SELECT m.run, count(*) FROM metrics m JOIN runs r USING (run) "
            "WHERE r.lr > 0.15 GROUP BY ALL ORDER BY 1"
        )[1]
    assert joined == [("b", 4), ("c", 6)]


def test_a_config_key_named_like_a_column_is_kept_apart_unless_it_says_the_same(tmp_path):
    same = ablation(tmp_path, "same", 0.1, [0], world_size=1)  # equal to the column: dropped
    other = ablation(tmp_path, "other", 0.1, [0], name="mine")  # differs: config.name
    with open_runs([same, other]) as store:
        columns, rows = store.query("SELECT * FROM runs ORDER BY run")
    assert "world_size" in columns and "config.world_size" not in columns
    assert columns[-1] == "config.name" and [r[-1] for r in rows] == ["mine", None]


def test_mixed_values_are_text_and_lists_are_json(tmp_path):
    a = ablation(tmp_path, "a", 0.1, [0], tag="x", dims=[1, 2])
    b = ablation(tmp_path, "b", 0.1, [0], tag=3, dims=[3])
    with open_runs([a, b]) as store:
        rows = store.query("SELECT tag, dims, typeof(tag) FROM runs ORDER BY run")[1]
    assert rows == [("x", "[1, 2]", "VARCHAR"), ("3", "[3]", "VARCHAR")]


def test_two_runs_of_one_name_get_their_paths_as_ids(tmp_path):
    one = ablation(tmp_path / "x", "run", 0.1, [0])
    two = ablation(tmp_path / "y", "run", 0.2, [0, 1])
    with open_runs([one, two]) as store:
        assert [r.id for r in store.runs] == ["x/run", "y/run"]
        rows = store.query("SELECT run, count(*) FROM metrics GROUP BY run ORDER BY run")[1]
    assert rows == [("x/run", 2), ("y/run", 4)]


def test_the_same_run_twice_is_read_once(root):
    with open_runs([root / "a", root / "a", root]) as store:
        assert [r.id for r in store.runs] == ["a", "b", "c"]


def test_the_cli_reads_a_root_and_several_paths(root, capsys):
    assert main(["query", str(root), "SELECT run, lr FROM runs ORDER BY run", "--format",
                 "json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out) == [
        {"run": "a", "lr": 0.1}, {"run": "b", "lr": 0.2}, {"run": "c", "lr": 0.3}
    ]  # fmt: skip
    sql = "SELECT run, count(*) AS n FROM metrics GROUP BY run ORDER BY run"
    assert main(["query", str(root / "a"), str(root / "b"), sql, "--format", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["run,n", "a,6", "b,4"]


def test_the_sandbox_is_the_same_over_several_runs(root, tmp_path):
    secret = tmp_path / "secret.csv"
    secret.write_text("token\nhunter2\n")
    with open_runs([root]) as store:
        for sql in (f"SELECT * FROM read_csv('{secret}')", "COPY runs TO 'x.csv'",
                    "CREATE TABLE t AS SELECT 1", "DROP TABLE runs"):  # fmt: skip
            with pytest.raises(UsageError, match=r"refused|outside the run"):
                store.query(sql)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: tmp / "missing", "does not exist"),
        (lambda tmp: tmp, "is not a syncless run: it has no run.json, and neither do its"),
    ],
)
def test_a_path_that_is_not_a_run_and_holds_none_is_a_usage_error(tmp_path, make, says):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=says):
        open_runs([make(tmp_path)])


def test_a_broken_run_below_a_root_is_skipped_with_a_warning(root, caplog):
    (root / "broken").mkdir()
    (root / "broken" / "run.json").write_text("{not json")
    with open_runs([root]) as store:
        assert [r.id for r in store.runs] == ["a", "b", "c"]
    assert "skipped" in caplog.text and "broken" in caplog.text


def test_one_store_of_several_runs_has_no_single_info(root):
    with open_runs([root]) as store, pytest.raises(UsageError, match="reads 3 runs"):
        store.info  # noqa: B018
