"""Reading the figures back out of a ``syncless report`` page, as plotly wrote them."""

from __future__ import annotations

import base64
import json
import re

import numpy as np


def figure_data(page: str, anchor: str) -> list[dict]:
    """The traces of the figure ``fig-<anchor>``, as plotly wrote them."""
    match = re.search(r'Plotly\.newPlot\(\s*"fig-' + re.escape(anchor) + r'",\s*', page)
    assert match, f"no figure fig-{anchor}"
    return json.JSONDecoder().raw_decode(page, match.end())[0]


def array(value: dict | list) -> np.ndarray:
    """A plotly array: a list, or the typed-array form ``{"dtype", "bdata", "shape"}``."""
    if isinstance(value, list):
        return np.array(value, dtype=float)
    flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
    shape = [int(n) for n in str(value.get("shape", len(flat))).split(",")]
    return flat.reshape(shape)
