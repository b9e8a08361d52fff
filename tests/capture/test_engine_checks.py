"""CaptureEngine: bad configs and bad captures are refused, with errors that say what was
expected."""

from __future__ import annotations

import pytest
import torch

from syncless.capture import CaptureEngine, EngineConfig, GrantController, MemorySink, WindowPattern


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ring_bytes": 1 << 10, "staging_bytes": 1 << 12}, "staging_bytes .* > ring_bytes"),
        ({"ring_bytes": -1}, "ring_bytes must be an integer >= 64"),
        ({"ring_bytes": 0}, "ring_bytes"),
        ({"ring_bytes": 1.5e6}, "ring_bytes"),
        ({"staging_bytes": True}, "staging_bytes"),
        ({"staging_bytes": 32}, "staging_bytes must be an integer >= 64"),
        ({"on_full": "wait"}, "on_full='wait': expected one of 'drop', 'block', 'flush'"),
        ({"device": "meta"}, "expected a CUDA device or the CPU"),
        ({"device": "nonsense"}, "not a torch device"),
        ({"sink": 42}, "sink must be a CaptureSink"),
        ({"sink": None}, "no sink"),
        ({"config": {"align": 64}}, "config must be an EngineConfig"),
        ({"controller": GrantController(1 << 20)}, r"grants up to 1048576 bytes"),
    ],
)
def test_bad_configs_are_rejected(kwargs: dict, match: str) -> None:
    args = {"ring_bytes": 1 << 16, "staging_bytes": 1 << 12, "sink": MemorySink(), "device": "cpu"}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CaptureEngine(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_device_without_cuda_is_rejected() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        CaptureEngine(1 << 16, 1 << 12, MemorySink(), device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"align": 8}, "align must be an integer >= 16"),
        ({"align": 48}, "power of two"),
        ({"max_records": 0}, "max_records"),
        ({"boundary_pool": 1}, "boundary_pool"),
        ({"poll_interval_s": 0}, "poll_interval_s"),
        ({"late_issue_s": -1.0}, "late_issue_s"),
        ({"shard_bytes": 0}, "shard_bytes"),
        ({"shard_interval_s": float("nan")}, "shard_interval_s"),
    ],
)
def test_bad_engine_config_is_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_bad_captures_are_rejected_with_clear_errors() -> None:
    engine = CaptureEngine(1 << 16, 1 << 12, MemorySink(), device="cpu", background=False)
    x = torch.zeros(3)
    with pytest.raises(ValueError, match=r"expected a torch\.Tensor"):
        engine.capture("x", [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dense strided"):
        engine.capture("x", torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match="on meta but the engine captures from cpu"):
        engine.capture("x", torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="tag must be a non-empty string"):
        engine.capture("", x)
    with pytest.raises(ValueError, match="step must be an int"):
        engine.capture("x", x, step=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="JSON-serialisable"):
        engine.capture("x", x, meta={"value": torch.ones(1)})
    with pytest.raises(ValueError, match="meta must be a mapping"):
        engine.capture("x", x, meta=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_full='later'"):
        engine.capture("x", x, on_full="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected a WindowPattern"):
        engine.define_pattern([(0, 1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="overlap"):
        engine.define_pattern(WindowPattern(4, [(0, 2), (1, 3)]))
    with pytest.raises(RuntimeError, match="resume\\(\\) called while not suspended"):
        engine.resume()
    engine.close()
    assert engine.counters()["offered_count"] == 0  # refused calls are errors, not records
