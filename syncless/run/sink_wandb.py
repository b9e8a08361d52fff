"""Step records as a wandb run's history, each value at its own step."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from syncless.run.records import StepRecords
from syncless.run.sink_thread import ThreadedSink

# The x axis of every chart: the record's step, logged with each history row.
STEP_METRIC = "syncless/step"


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ImportError('WandbSink needs wandb: pip install "syncless[wandb]"') from e
    return wandb


class WandbSink(ThreadedSink):
    """Logs every record to a wandb run, charted against its own step.

    Records arrive lagged: a monitor's record for step s can come after step s + 1.
    wandb drops a value logged with ``step=s`` once it has seen a later step. So this
    sink never passes ``step=``. Each row carries the record's step as the metric
    ``syncless/step``, and ``define_metric("*", step_metric="syncless/step")`` makes
    it every chart's x axis. A late record is a row of its own at its own step, however
    late it is. A buffer that waits out a lag window would drop anything later than the
    window.

    ``wandb.init`` runs on the sink's writer thread, at the first batch, so its seconds
    of setup never stall a step. If it fails (no network, a bad argument), the error is
    raised once from the next ``write`` (the :class:`~syncless.run.Run` counts it) and
    the sink drops everything after.

    Example::

        with Run(sinks=[WandbSink(project="my-job", mode="online")]) as run:
            run.log(0, {"train/step/loss": 2.5})

    Args:
        project: the wandb project (wandb's default when ``None``).
        mode: ``"offline"`` (the default: written under ``dir``, ``wandb sync`` later),
            ``"online"`` or ``"disabled"``.
        init_kwargs: passed on to ``wandb.init`` (``dir``, ``name``, ``config``,
            ``settings``, ...). ``reinit`` defaults to ``"create_new"``, so a wandb
            run of your own stays open beside this one.
    """

    def __init__(self, project: str | None = None, mode: str = "offline", **init_kwargs: Any):
        # Checked here, on the caller's thread: a missing extra is a setup error.
        self._wandb = _wandb()
        super().__init__(thread_name="syncless-wandb")
        self.init_kwargs = {"project": project, "mode": mode, **init_kwargs}
        self.init_kwargs.setdefault("reinit", "create_new")
        self.run: Any = None

    def open(self) -> None:
        self.run = self._wandb.init(**self.init_kwargs)
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def consume(self, records: StepRecords) -> None:
        rows: dict[int, dict[str, float]] = defaultdict(dict)
        for _, step, _, names, values, _ in records.chunks():
            rows[step].update(zip(names, values, strict=True))
        for step in sorted(rows):
            self.run.log({STEP_METRIC: step, **rows[step]})

    def finish(self) -> None:
        self.run.finish()  # uploads (online) or writes out (offline) what is queued
