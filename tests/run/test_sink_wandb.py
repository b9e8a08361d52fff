"""WandbSink, offline: the run's .wandb file is read back record by record.

wandb 0.31 keeps no Python reader of its own files, so ``logged_rows`` parses the
format here: a LevelDB-style log of ``wandb_internal_pb2.Record`` protobufs.
"""

import json
import struct
import time
from pathlib import Path

import pytest
import wandb
from wandb.proto import wandb_internal_pb2

from syncless.run import Run, StepRecord, WandbSink
from syncless.run.sink_wandb import STEP_METRIC

BLOCK = 32 * 1024  # the log's block size; a record header is 7 bytes: crc, length, type
FULL, LAST = 1, 4


@pytest.fixture(autouse=True)
def _quiet_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    # wandb.init puts its service's address in os.environ (WANDB_SERVICE) for child
    # processes to share. Left behind, every later subprocess of the suite (a demo
    # with --sink wandb) dialled this process's service, failed and logged nothing.
    monkeypatch.setenv("WANDB_SERVICE", "")
    monkeypatch.delenv("WANDB_SERVICE")
    yield
    wandb.teardown()  # its service process goes with the test


def offline_sink(tmp_path: Path, **kwargs: object) -> WandbSink:
    settings = wandb.Settings(x_disable_stats=True)  # no system-stats sampler left behind
    return WandbSink(project="t", dir=str(tmp_path), settings=settings, **kwargs)


def logged_rows(tmp_path: Path, timeout_s: float = 10.0) -> list[dict[str, float]]:
    """The history rows of the one offline run under ``tmp_path``, in logged order.

    wandb-core, a process of its own, writes the file: ``finish()`` can return a moment
    before the last records are on disk, so this waits for the run's exit record.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
        kinds, rows = parse_log(path.read_bytes())
        if "exit" in kinds or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def parse_log(data: bytes) -> tuple[list[str], list[dict[str, float]]]:
    """(every record's type, the history rows without wandb's own `_` keys)."""
    assert data[:4] == b":W&B"
    position, pending, kinds, rows = 7, b"", [], []
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (length, kind) == (0, 0):  # the rest of the block is padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            kinds.append(record.WhichOneof("record_type"))
            if kinds[-1] == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }  # a key with slashes is kept as its parts
                rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    return kinds, rows


def test_each_value_lands_at_its_own_step_lagged_and_out_of_order_ones_included(tmp_path):
    # A monitor reads step s during step s + 1: its records come after the next loss.
    batches = [
        [StepRecord("r", 0, 0, "train/step/loss", 2.5, 1.0)],
        [StepRecord("r", 1, 0, "train/step/loss", 2.25, 2.0),
         StepRecord("r", 0, 0, "monitors/layer_00/attn_qk_logit_max/head_0", 11.5, 2.0),
         StepRecord("r", 0, 0, "monitors/layer_00/attn_qk_logit_max/head_1", -3.0, 2.0)],
        [StepRecord("r", 2, 0, "train/step/loss", 2.125, 3.0),
         StepRecord("r", 1, 0, "monitors/layer_00/attn_qk_logit_max/head_0", 12.5, 3.0)],
        [StepRecord("r", 0, 0, "train/step/late_ms", 40.0, 4.0)],  # three steps late
    ]  # fmt: skip
    with Run(run_dir=tmp_path / "r", sinks=[offline_sink(tmp_path)]) as run:
        for batch in batches:
            run.emit(batch)
    assert run.sink_errors == {}
    landed = {
        (name, row[STEP_METRIC], value)
        for row in logged_rows(tmp_path)
        for name, value in row.items()
        if name != STEP_METRIC
    }
    assert landed == {(r.name, r.step, r.value) for batch in batches for r in batch}


def test_records_of_one_step_in_one_batch_share_one_row(tmp_path):
    sink = offline_sink(tmp_path)
    sink.write([StepRecord("r", 5, 0, "a/b/x", 1.0, 0.0), StepRecord("r", 4, 0, "a/b/x", 2.0, 0.0),
                StepRecord("r", 5, 0, "a/b/y", 3.0, 0.0)])  # fmt: skip
    sink.close()
    assert logged_rows(tmp_path) == [
        {STEP_METRIC: 4, "a/b/x": 2.0},
        {STEP_METRIC: 5, "a/b/x": 1.0, "a/b/y": 3.0},
    ]


def test_a_failing_wandb_init_is_counted_once_and_disables_the_sink(tmp_path):
    sink = offline_sink(tmp_path, mode="no-such-mode")
    run = Run(run_dir=tmp_path / "r", sinks=[sink])
    for step in range(4):
        run.log(step, {"train/step/loss": float(step)})  # never raises
    run.close()
    assert run.sink_errors == {"WandbSink": 1}
    assert sink.disabled
