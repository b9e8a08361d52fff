"""The run's first NaN/Inf and first spike: the lines at the top of the report and of
``syncless summary``, with the layer that moved first.

:func:`first_nonfinite` reads them in two small queries over the alarms' step records
(``docs/monitors``); :class:`FirstNonfinite` holds them and words them.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncless.run.store import RunStore

__all__ = ["FirstNonfinite", "first_nonfinite"]

# Each readout that saw a NaN/Inf writes its first step (a step label) and first layer.
OUTPUT_STEP = "monitors/step/nonfinite_first_step"
OUTPUT_LAYER = "monitors/step/nonfinite_first_layer"
OUTPUT_VALUES = "monitors/global/nonfinite_count"
LOSS_STEP = "monitors/step/loss_nonfinite_first_step"
GRAD_NORM_STEP = "monitors/step/grad_norm_nonfinite_first_step"
# The norms monitor's readouts: the record's own step is the step.
GRAD_LAYER = "monitors/step/grad_nonfinite_first_layer"
GRAD_LAYERS = "monitors/step/grad_nonfinite_layers_count"
# The spike alarms' readouts, and the layer that moved first where one was found.
LOSS_SPIKE = "monitors/step/loss_spike_first_step"
GRAD_NORM_SPIKE = "monitors/step/grad_norm_spike_first_step"
MOVED_STEP = "monitors/step/moved_first_step"
MOVED_LAYER = "monitors/step/moved_first_layer"

# The earliest record of each name, then the records of the same readout step that go
# with it, on every rank (each rank counts its own outputs: their counts add up). Only
# rank 0 writes the step records; on several ranks the lowest value wins. A few rows,
# whatever the run's length: 8 ms on 101k records (bench/store/summary_speed.py's run, 2 cores).
_QUERY = f"""
WITH earliest AS (
    SELECT name, step, value FROM metrics
    WHERE name IN ('{OUTPUT_STEP}', '{LOSS_STEP}', '{GRAD_NORM_STEP}', '{GRAD_LAYER}',
                   '{LOSS_SPIKE}', '{GRAD_NORM_SPIKE}')
        AND isfinite(value)
    QUALIFY row_number() OVER (
        PARTITION BY name ORDER BY if(name = '{GRAD_LAYER}', step, value), value, step
    ) = 1
)
SELECT e.name, e.step, e.value, c.name, min(c.value), max(c.value), sum(c.value)
FROM earliest e LEFT JOIN metrics c ON c.step = e.step AND (
    (e.name = '{OUTPUT_STEP}' AND c.name IN ('{OUTPUT_LAYER}', '{OUTPUT_VALUES}'))
    OR (e.name = '{GRAD_LAYER}' AND c.name = '{GRAD_LAYERS}'))
GROUP BY ALL
"""

# The layer that moved first, as the readout of a record step found it.
_MOVED = f"""
SELECT min(s.value), min(l.value) FROM metrics s JOIN metrics l ON l.step = s.step
WHERE s.name = '{MOVED_STEP}' AND l.name = '{MOVED_LAYER}' AND s.step = {{step}}
"""


@dataclass(frozen=True)
class FirstNonfinite:
    """The earliest NaN/Inf of each kind a run recorded; None where it recorded none."""

    output_step: int | None = None  # first step some layer's block output held one
    output_layer: int | None = None  # the lowest layer that held one at that step
    output_values: int | None = None  # NaN/Inf counted in that readout, every layer and rank
    loss_step: int | None = None  # first step the loss handed to the monitors was one
    grad_norm_step: int | None = None  # first step the total gradient norm was one
    grad_step: int | None = None  # first norms readout with a nonfinite layer grad norm
    grad_layer: int | None = None  # the lowest such layer at that step
    grad_layers: int | None = None  # how many layers had one at that step
    loss_spike_step: int | None = None  # first step the loss spiked
    grad_norm_spike_step: int | None = None  # first step the gradient norm spiked
    moved_step: int | None = None  # where the first of these was read: the layer that
    moved_layer: int | None = None  # moved first, and the step it did

    def lines(self) -> list[str]:
        """One sentence per kind recorded, the layer outputs first, and the layer that
        moved first."""
        out = []
        if self.output_step is not None:
            where = "a layer" if self.output_layer is None else f"layer {self.output_layer}"
            line = f"First nonfinite value: step {self.output_step}, {where} output"
            if self.output_values is not None:
                line += f" ({_count(self.output_values, 'value')} in that readout)"
            out.append(line)
        if self.loss_step is not None:
            out.append(f"First nonfinite loss: step {self.loss_step}")
        if self.grad_norm_step is not None:
            out.append(f"First nonfinite total gradient norm: step {self.grad_norm_step}")
        if self.grad_step is not None:
            line = "First nonfinite layer gradient norm: "
            line += f"step {self.grad_step}, layer {self.grad_layer}"
            if self.grad_layers is not None:
                line += f" ({_count(self.grad_layers, 'layer')} nonfinite at that step)"
            out.append(line)
        if self.loss_spike_step is not None:
            out.append(f"First loss spike: step {self.loss_spike_step}")
        if self.grad_norm_spike_step is not None:
            out.append(f"First gradient norm spike: step {self.grad_norm_spike_step}")
        if self.moved_layer is not None:
            out.append(
                f"Layer that moved first: layer {self.moved_layer}, at step {self.moved_step}"
            )
        return out


def first_nonfinite(store: RunStore) -> FirstNonfinite | None:
    """The run's earliest nonfinite records, or None when it has none."""
    earliest: dict[str, tuple[int, int]] = {}  # name -> (record step, value)
    low: dict[str, int] = {}
    high: dict[str, int] = {}
    total: dict[str, int] = {}
    for name, step, value, companion, lowest, highest, summed in store.sql(_QUERY).fetchall():
        earliest[name] = (int(step), round(value))
        if companion is not None:  # each goes with one name of earliest
            low[companion], high[companion] = round(lowest), round(highest)
            total[companion] = round(summed)
    if not earliest:
        return None
    none: tuple[None, None] = (None, None)
    # the readout that found the earliest trouble, by its step: did it name a layer?
    first_read = min(earliest.values(), key=lambda read: (read[1], read[0]))[0]
    query = _MOVED.format(step=int(first_read))  # an int of our own query: no injection
    ((moved_step, moved_layer),) = store.sql(query).fetchall()  # min(): one row, or NULLs
    return FirstNonfinite(
        output_step=earliest.get(OUTPUT_STEP, none)[1],
        output_layer=low.get(OUTPUT_LAYER),
        output_values=total.get(OUTPUT_VALUES),
        loss_step=earliest.get(LOSS_STEP, none)[1],
        grad_norm_step=earliest.get(GRAD_NORM_STEP, none)[1],
        grad_step=earliest.get(GRAD_LAYER, none)[0],
        grad_layer=earliest.get(GRAD_LAYER, none)[1],
        grad_layers=high.get(GRAD_LAYERS),
        loss_spike_step=earliest.get(LOSS_SPIKE, none)[1],
        grad_norm_spike_step=earliest.get(GRAD_NORM_SPIKE, none)[1],
        moved_step=None if moved_step is None else round(moved_step),
        moved_layer=None if moved_layer is None else round(moved_layer),
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
