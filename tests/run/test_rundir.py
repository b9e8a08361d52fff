"""Every run gets a directory of its own; a resumed run adds a segment."""

import json
import multiprocessing as mp
import threading
import time

import pytest
from run_store_helpers import make_run, truncate, write_shards

from syncless.errors import UsageError
from syncless.run import RankInfo, Run
from syncless.run import open as open_run
from syncless.testing import spawn_gloo

FROZEN = "20260101-000000"  # every run below is "started in the same second"


def _segments(run_dir):
    return json.loads((run_dir / "run.json").read_text())["segments"]


def _run_in_frozen_second(root, seed, start):
    """A Run named as if started in FROZEN, once ``start`` lets every caller go."""
    time.strftime = lambda *_: FROZEN  # this process only (a forked child, or a test)
    start.wait()
    with Run(name="same", root=root, config={"seed": seed}) as run:
        run.log(0, {"test/step/seed": seed})
        return str(run.dir)


def _check_distinct(root, dirs, seeds):
    assert len(set(dirs)) == len(dirs)
    assert {d.rsplit("/", 1)[1] for d in dirs} == {f"{FROZEN}-same"} | {
        f"{FROZEN}-same-{n}" for n in range(2, len(dirs) + 1)
    }
    for d, seed in zip(dirs, seeds, strict=True):
        meta = json.loads((root / d.rsplit("/", 1)[1] / "run.json").read_text())
        assert meta["config"]["seed"] == meta["segments"][0]["seed"] == seed
        with open_run(d) as store:  # only its own steps: one record, its own seed
            _, rows = store.query("SELECT value FROM metrics")
        assert rows == [(float(seed),)]


def test_runs_started_together_in_threads_get_directories_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", time.strftime)  # restored after the test
    n = 8
    start = threading.Barrier(n)
    dirs: list = [None] * n

    def one(i):
        dirs[i] = _run_in_frozen_second(tmp_path, i, start)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _check_distinct(tmp_path, dirs, range(n))


def _process(root, seed, start, results):
    results.put((seed, _run_in_frozen_second(root, seed, start)))


def test_runs_started_together_in_processes_get_directories_of_their_own(tmp_path):
    ctx = mp.get_context("fork")
    n = 4
    start, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_process, args=(tmp_path, i, start, results)) for i in range(n)]
    for p in procs:
        p.start()
    by_seed = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    _check_distinct(tmp_path, [by_seed[i] for i in range(n)], range(n))


def test_a_named_directory_that_holds_a_run_is_refused(tmp_path):
    with Run(run_dir=tmp_path / "r") as run:
        run.log(0, {"test/step/x": 1.0})
    before = (tmp_path / "r" / "run.json").read_text()
    with pytest.raises(UsageError) as err:
        Run(run_dir=tmp_path / "r")
    message = str(err.value)
    assert "already holds a run (run.json, 1 metric shard(s))" in message  # what
    assert "mix its steps" in message  # why
    assert "Run(resume=True)" in message and "new directory" in message  # what to do
    assert "\n" not in message
    assert (tmp_path / "r" / "run.json").read_text() == before  # untouched


def test_a_named_directory_with_other_files_is_refused_and_an_empty_one_taken(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="already holds 1 entry"):
        Run(run_dir=tmp_path / "full")
    with pytest.raises(UsageError, match=r"no run\.json, so it is not a syncless run"):
        Run(run_dir=tmp_path / "full", resume=True)
    (tmp_path / "empty").mkdir()
    Run(run_dir=tmp_path / "empty").close()
    assert (tmp_path / "empty" / "run.json").is_file()


def test_resume_appends_a_segment_and_keeps_the_earlier_data(tmp_path):
    run_dir = tmp_path / "r"
    with Run(run_dir=run_dir, config={"seed": 1}) as run:
        assert run.next_step == 0
        for step in range(3):
            run.log(step, {"test/step/seed": 1.0})
    first = json.loads((run_dir / "run.json").read_text())
    with Run(run_dir=run_dir, config={"seed": 2}, resume=True) as run:
        assert run.next_step == 3  # on from the last stored step
        for step in range(run.next_step, run.next_step + 2):
            run.log(step, {"test/step/seed": 2.0})
    meta = json.loads((run_dir / "run.json").read_text())
    assert [(s["seed"], s["first_step"]) for s in meta["segments"]] == [(1, 0), (2, 3)]
    assert meta["segments"][0] == first["segments"][0]  # the first segment is kept
    assert meta["start_time"] == first["start_time"]  # as are the top-level keys
    assert meta["segments"][1]["start_time"] >= meta["segments"][0]["start_time"]
    with open_run(run_dir) as store:
        _, rows = store.query("SELECT step, value FROM metrics ORDER BY step")
    assert rows == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0)]


def test_resume_of_a_run_json_from_before_segments(tmp_path):
    run_dir = tmp_path / "old"
    Run(run_dir=run_dir, config={"seed": 5}).close()
    meta = json.loads((run_dir / "run.json").read_text())
    del meta["segments"]
    (run_dir / "run.json").write_text(json.dumps(meta))
    Run(run_dir=run_dir, config={"seed": 6}, resume=True).close()
    assert [s["config"]["seed"] for s in _segments(run_dir)] == [5, 6]


def test_resume_of_a_missing_directory_starts_the_run(tmp_path):
    with Run(run_dir=tmp_path / "new", resume=True) as run:
        assert run.next_step == 0
    assert len(_segments(tmp_path / "new")) == 1


def test_resume_needs_a_directory():
    with pytest.raises(UsageError, match="needs run_dir"):
        Run(resume=True)


def test_a_rank_without_a_process_group_needs_the_directory(tmp_path):
    with pytest.raises(UsageError, match="init_process_group"):
        Run(root=tmp_path, ranks=RankInfo(rank=1, world_size=2, local_rank=1))


def _gloo_run(rank, world, root, run_dir):
    time.strftime = lambda *_: FROZEN
    try:
        with Run(name="same", root=root, run_dir=run_dir) as run:
            return str(run.dir)
    except UsageError as e:
        return f"UsageError: {e}"


@pytest.mark.dist
def test_ranks_agree_on_the_suffixed_directory_and_on_a_refusal(tmp_path):
    (tmp_path / f"{FROZEN}-same").mkdir()  # a run of the same name in the same second
    dirs = spawn_gloo(_gloo_run, 2, tmp_path, None)
    assert dirs == [str(tmp_path / f"{FROZEN}-same-2")] * 2
    refused = spawn_gloo(_gloo_run, 2, tmp_path, tmp_path / f"{FROZEN}-same-2")
    assert all(r.startswith("UsageError: ") and "already holds a run" in r for r in refused)


def test_resume_after_a_crash_skips_a_truncated_shard_with_a_warning(tmp_path, caplog):
    """The shard a crash cut short: resume goes on from the last step it can read, and
    names the shard, instead of failing with pyarrow's error."""
    run_dir = make_run(tmp_path / "crashed")
    first, second = write_shards(run_dir, 0, [[0, 1, 2, 3], [4, 5, 6]])
    truncate(second)
    with (
        caplog.at_level("WARNING", logger="syncless.run.rundir"),
        Run(run_dir=run_dir, resume=True) as run,
    ):
        assert run.next_step == 4  # steps 0-3 are the readable ones
    assert second.name in caplog.text and "syncless check" in caplog.text
    assert first.name not in caplog.text
